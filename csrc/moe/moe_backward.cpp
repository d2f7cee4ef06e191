// MoeLayer::backward: the gradients of the input and of the routing weights through one layer's frozen experts.
//
// Per (token t, slot k) with expert e and routing weight w the forward computes g = Wg x (+ b_gate),
// u = Wu x (+ b_up), h = glu(g, u), y = Wd h (+ b_down) and out = sum_k w y. Given dout = d loss / d out:
//   d = Wd^T dout;   dw = <dout, y> = <d, h> + <dout, b_down>;   dg, du = w d through glu (glu_backward.h);
//   dx = sum_k Wg^T dg + Wu^T du.
// g and u are recomputed from x with the forward's kernels: nothing is kept from the forward but its inputs. y is
// never formed (<dout, Wd h> = <Wd^T dout, h>). The (token, slot) rows are grouped by expert as in the forward, and
// each step is one run on the layer's pool whose items write disjoint outputs (no atomics; results do not depend on
// the thread count):
//   convert  x rows in the forward kernels' activations (per row) and dout in the transposed products' vectors
//            (per token)
//   expert   per expert: its gate and up sums (block ranges, the forward's kernels) and d (column chunks of Wd^T dout)
//   rows     per row: dw, dg and du (in the transposed products' vectors)
//   input    per column chunk of x: every expert's Wg^T dg + Wu^T du added into its tokens' rows, the experts in id
//            order, then stored in x's dtype
// The transposed products (backward_kernels.h) read each expert's weights once per pass. AMX layers run the
// AVX-512 kernels (the forward's few-token ones and the AVX-512 transposed products). A call of many tokens runs in
// passes of at most kBackwardBytes of workspace (or MoeBackwardCall::chunk_tokens tokens).
#include <algorithm>
#include <numeric>
#include <vector>

#include "moe/backward_kernels.h"
#include "moe/glu_backward.h"
#include "moe/moe_layer.h"

namespace hmoe {
namespace {

constexpr int kRowsPerItem = 16;     // rows (or tokens) per item of the convert and rows steps
constexpr int kBlocksPerItem = 4;    // 32-row blocks per gate or up item of the expert step
constexpr int kChunksPerItem = 2;    // column chunks of d per item of the expert step

const BackwardKernels& backward_kernels_for(Isa isa) {
  switch (isa) {
    case Isa::generic: return backward_kernels_generic();
    case Isa::avx2: return backward_kernels_avx2();
    default: return backward_kernels_avx512();  // avx512, amx, amx_emulated
  }
}

template <class T>
T* grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// The expert step's items: gate or up sums of slot j's expert over blocks [a0, a1) of slice s, or its d over
// column chunks [a0, a1).
struct Item {
  enum Kind { gate_sums, up_sums, down_chunks } kind;
  int j, s, a0, a1;
};

// The rows step's items: rows [r0, r1) of slot j's expert.
struct RowRange {
  int j, r0, r1;
};

// A pass's buffers, reused by the next call on the same thread (the calling thread's, also in the steps the pool's
// workers run).
struct Workspace {
  std::vector<int> counts, slot_of, fill, order, row_begin, tok, slot, by_size;
  std::vector<Item> items;
  std::vector<RowRange> row_ranges;
  std::vector<uint16_t> xb;     // x rows, kind bf16
  std::vector<int16_t> xq;      // x rows, kind i16
  std::vector<float> xscale;
  std::vector<int32_t> xsums;
  std::vector<float> g, u, d;   // gate sums, up sums, Wd^T dout per row
  std::vector<uint8_t> vout, vg, vu;  // the vectors: dout per token, dg and du per row (fp32 or bf16)
  std::vector<float> gx;        // x's gradient per token, fp32
};
thread_local Workspace backward_ws;

}  // namespace

struct MoeLayer::Backward {
  Backward(MoeLayer& layer, const MoeBackwardCall& call);
  void run();

 private:
  int tokens_per_pass() const;
  void pass(int first, int tokens);
  void group_tokens();
  void layout();
  void convert_step();
  void expert_step();
  void expert_item(const Item& it);
  void rows_step();
  void row(int j, int r);
  void input_step();
  void input_chunk(int chunk);

  int id_at(size_t i) const {
    return c.ids64 ? int(static_cast<const int64_t*>(c.ids)[i]) : static_cast<const int32_t*>(c.ids)[i];
  }
  int n_of(int j) const { return row_begin[j + 1] - row_begin[j]; }
  ActView x_rows(int j) const;
  // The vectors of `rows` rows from row r0 of buffer v (ld elements a row).
  TRows vectors(const uint8_t* v, size_t ld, int r0, int rows, const int* index) const {
    return {v + size_t(r0) * ld * vsize, ld, index, rows, 0};
  }
  void store_vector(const void* src, bool src_bf16, int n, int npad, uint8_t* dst) const;

  MoeLayer& L;
  const MoeBackwardCall& c;
  Workspace& ws;
  const Kernels& fk;         // the forward's kernels for few tokens (AVX-512 on AMX layers)
  const BackwardKernels& bk;
  const Format fmt;
  const int E, H, I, K, S;
  const Matrix &gate, &up, &down;
  const ActKind x_kind;
  const int x_group;         // int4: the group of x's i16 sums, else 0
  const size_t vsize;        // bytes per vector entry: 2 (bf16) or 4
  const size_t ldx, ldI, ldv, ldo, ldgx;  // row strides (elements): x rows, g/u/d, dg/du vectors, dout vectors, gx

  // The pass: tokens [t0, t0 + T), R = T * K rows; order[j] the expert of slot j (ascending ids), its rows
  // [row_begin[j], row_begin[j + 1]) in token order; tok[row] the row's token (from t0), slot[row] its slot k.
  int t0 = 0, T = 0, R = 0, A = 0;
  int* row_begin = nullptr;
  int* tok = nullptr;
  int* slot = nullptr;
  float *g = nullptr, *u = nullptr, *d = nullptr, *gx = nullptr;
  uint8_t *vout = nullptr, *vg = nullptr, *vu = nullptr;
};

MoeLayer::Backward::Backward(MoeLayer& layer, const MoeBackwardCall& call)
    : L(layer), c(call), ws(backward_ws), fk(*layer.base_), bk(backward_kernels_for(layer.cfg_.isa)),
      fmt(layer.cfg_.format), E(layer.cfg_.E), H(layer.cfg_.H), I(layer.cfg_.I), K(call.K), S(layer.cfg_.numa_nodes),
      gate(layer.mats_[0]), up(layer.mats_[1]), down(layer.mats_[2]), x_kind(act_of(fk, false, fmt)),
      x_group(fmt == Format::int4 ? layer.cfg_.group : 0), vsize(bk.v_bf16 ? 2 : 4), ldx(size_t(gate.Kp) + 32),
      ldI(size_t(gate.blocks) * kBlockRows + 16), ldv(size_t(gate.blocks) * kBlockRows + 32),
      ldo(size_t(down.blocks) * kBlockRows + 32), ldgx(size_t(gate.Kp) + 16) {}

void MoeLayer::Backward::run() {
  const int step = tokens_per_pass();
  for (int first = 0; first < c.T; first += step) pass(first, std::min(step, c.T - first));
}

// As many tokens as kBackwardBytes of workspace hold (at least one), or the call's chunk_tokens.
int MoeLayer::Backward::tokens_per_pass() const {
  if (c.chunk_tokens > 0) return c.chunk_tokens;
  const size_t per_row = ldx * 2 + 4 + (x_group ? size_t(gate.Kp / x_group) * 4 : 0) + 3 * ldI * 4 + 2 * ldv * vsize +
                         4 * sizeof(int);
  const size_t per_token = ldo * vsize + ldgx * 4;
  return int(std::clamp<size_t>(kBackwardBytes / (size_t(K) * per_row + per_token), 1, size_t(c.T)));
}

void MoeLayer::Backward::pass(int first, int tokens) {
  t0 = first;
  T = tokens;
  R = T * K;
  group_tokens();
  layout();
  convert_step();
  expert_step();
  rows_step();
  input_step();
}

// Counts each expert's rows, then places them: experts in ascending id order, each one's rows in token order.
void MoeLayer::Backward::group_tokens() {
  int* counts = grow(ws.counts, E);
  std::fill(counts, counts + E, 0);
  const size_t base = size_t(t0) * K;
  for (int i = 0; i < R; ++i) ++counts[id_at(base + i)];
  ws.order.clear();
  for (int e = 0; e < E; ++e)
    if (counts[e]) ws.order.push_back(e);
  A = int(ws.order.size());
  row_begin = grow(ws.row_begin, A + 1);
  int* slot_of = grow(ws.slot_of, E);
  row_begin[0] = 0;
  for (int j = 0; j < A; ++j) {
    slot_of[ws.order[j]] = j;
    row_begin[j + 1] = row_begin[j] + counts[ws.order[j]];
  }
  int* fill = std::copy(row_begin, row_begin + A, grow(ws.fill, A)) - A;
  tok = grow(ws.tok, R);
  slot = grow(ws.slot, R);
  for (int i = 0; i < R; ++i) {
    const int r = fill[slot_of[id_at(base + i)]]++;
    tok[r] = i / K;
    slot[r] = i % K;
  }
}

void MoeLayer::Backward::layout() {
  if (x_kind == ActKind::bf16) {
    grow(ws.xb, size_t(R) * ldx);
  } else {
    grow(ws.xq, size_t(R) * ldx);
    grow(ws.xscale, R);
    if (x_group) grow(ws.xsums, size_t(R) * (gate.Kp / x_group));
  }
  g = grow(ws.g, size_t(R) * ldI);
  u = grow(ws.u, size_t(R) * ldI);
  d = grow(ws.d, size_t(R) * ldI);
  vg = grow(ws.vg, size_t(R) * ldv * vsize);
  vu = grow(ws.vu, size_t(R) * ldv * vsize);
  vout = grow(ws.vout, size_t(T) * ldo * vsize);
  gx = grow(ws.gx, size_t(T) * ldgx);
}

// dst[0:npad] = the vector entries of src[0:n] (fp32, or bf16 if src_bf16), zeros in [n, npad).
void MoeLayer::Backward::store_vector(const void* src, bool src_bf16, int n, int npad, uint8_t* dst) const {
  if (bk.v_bf16) {
    fk.ops.to_bf16(src, src_bf16, n, npad, reinterpret_cast<uint16_t*>(dst));
    return;
  }
  float* out = reinterpret_cast<float*>(dst);
  for (int i = 0; i < n; ++i)
    out[i] = src_bf16 ? bf16_to_f32(static_cast<const uint16_t*>(src)[i]) : static_cast<const float*>(src)[i];
  std::fill(out + n, out + npad, 0.f);
}

// Items: x's rows in the kind the forward's gate/up kernels read, kRowsPerItem rows each; then dout's vectors,
// kRowsPerItem tokens each.
void MoeLayer::Backward::convert_step() {
  const int row_items = (R + kRowsPerItem - 1) / kRowsPerItem, token_items = (T + kRowsPerItem - 1) / kRowsPerItem;
  const size_t esize = c.x_bf16 ? 2 : 4, gsize = c.grad_out_bf16 ? 2 : 4;
  const int Kx = gate.Kp, groups = x_group ? Kx / x_group : 0;
  L.pool_->run(row_items + token_items, [&](int item, int) {
    if (item < row_items) {
      for (int r = item * kRowsPerItem; r < std::min(R, (item + 1) * kRowsPerItem); ++r) {
        const void* src = static_cast<const char*>(c.x) + size_t(t0 + tok[r]) * H * esize;
        if (x_kind == ActKind::bf16)
          fk.ops.to_bf16(src, c.x_bf16, H, Kx, ws.xb.data() + r * ldx);
        else
          fk.ops.to_i16(src, c.x_bf16, H, Kx, x_group, ws.xq.data() + r * ldx, ws.xscale.data() + r,
                        x_group ? ws.xsums.data() + size_t(r) * groups : nullptr);
      }
      return;
    }
    const int first = (item - row_items) * kRowsPerItem;
    for (int t = first; t < std::min(T, first + kRowsPerItem); ++t)
      store_vector(static_cast<const char*>(c.grad_out) + size_t(t0 + t) * H * gsize, c.grad_out_bf16, H,
                   down.blocks * kBlockRows, vout + t * ldo * vsize);
  });
}

ActView MoeLayer::Backward::x_rows(int j) const {
  ActView a;
  a.n = n_of(j);
  a.ld = int(ldx);
  const size_t r0 = row_begin[j];
  if (x_kind == ActKind::bf16) {
    a.bf16 = ws.xb.data() + r0 * ldx;
  } else {
    a.q = ws.xq.data() + r0 * ldx;
    a.qscale = ws.xscale.data() + r0;
    if (x_group) a.qsum = ws.xsums.data() + r0 * (gate.Kp / x_group);
  }
  return a;
}

// Items of every expert, most rows first: gate and up sums by block ranges of each slice, d by column chunks.
void MoeLayer::Backward::expert_step() {
  int* by_size = grow(ws.by_size, A);
  std::iota(by_size, by_size + A, 0);
  std::stable_sort(by_size, by_size + A, [&](int a, int b) { return n_of(a) > n_of(b); });
  std::vector<Item>& items = ws.items;
  items.clear();
  const int chunks = down.Kp / kChunkK;
  for (int q = 0; q < A; ++q) {
    const int j = by_size[q];
    for (int s = 0; s < S; ++s) {
      const int nb = gate.slice_begin[s + 1] - gate.slice_begin[s];
      for (int b = 0; b < nb; b += kBlocksPerItem)
        for (Item::Kind kind : {Item::gate_sums, Item::up_sums})
          items.push_back({kind, j, s, b, std::min(nb, b + kBlocksPerItem)});
    }
    for (int ch = 0; ch < chunks; ch += kChunksPerItem)
      items.push_back({Item::down_chunks, j, 0, ch, std::min(chunks, ch + kChunksPerItem)});
  }
  L.pool_->run(int(items.size()), [&](int i, int) { expert_item(ws.items[i]); });
}

void MoeLayer::Backward::expert_item(const Item& it) {
  const int e = ws.order[it.j], r0 = row_begin[it.j];
  if (it.kind != Item::down_chunks) {
    const Matrix& mat = it.kind == Item::gate_sums ? gate : up;
    float* sums = (it.kind == Item::gate_sums ? g : u) + size_t(r0) * ldI + (mat.slice_begin[it.s] + it.a0) * kBlockRows;
    gemm_of(fk, false, fmt)(L.view(mat, e, it.s), it.a0, it.a1, x_rows(it.j), sums, int(ldI));
    return;
  }
  const GemmTFn gemm_t = bk.gemm_t[int(fmt)];
  TRows v = vectors(vout, ldo, 0, n_of(it.j), tok + r0);
  for (int ch = it.a0; ch < it.a1; ++ch) {
    const TOut out{d + size_t(r0) * ldI + ch * kChunkK, ldI, nullptr};
    for (int s = 0; s < S; ++s) {
      v.col0 = down.slice_begin[s] * kBlockRows;
      gemm_t(L.view(down, e, s), down.slice_begin[s + 1] - down.slice_begin[s], ch * kChunkK, v, out, s > 0);
    }
  }
}

// Items of kRowsPerItem rows of one expert.
void MoeLayer::Backward::rows_step() {
  std::vector<RowRange>& items = ws.row_ranges;
  items.clear();
  for (int j = 0; j < A; ++j)
    for (int r = row_begin[j]; r < row_begin[j + 1]; r += kRowsPerItem)
      items.push_back({j, r, std::min(row_begin[j + 1], r + kRowsPerItem)});
  L.pool_->run(int(items.size()), [&](int i, int) {
    const RowRange& it = ws.row_ranges[i];
    for (int r = it.r0; r < it.r1; ++r) row(it.j, r);
  });
}

// Row r (of slot j's expert): its routing weight's gradient, and dg, du as vectors.
void MoeLayer::Backward::row(int j, int r) {
  thread_local std::vector<float> dbuf;
  float* dg = grow(dbuf, 2 * size_t(I));
  float* du = dg + I;
  const int e = ws.order[j];
  const size_t at = size_t(t0 + tok[r]) * K + slot[r];
  Glu scratch;
  const Glu* glu = L.glu_of(e, 0, scratch);
  const size_t o = size_t(r) * ldI;
  float dw = glu_backward(glu, g + o, u + o, d + o, c.weights[at], I, dg, du);
  if (const float* bias = L.down_bias(e, 0)) {
    const size_t first = size_t(t0 + tok[r]) * H;
    for (int i = 0; i < H; ++i)
      dw += bias[i] * (c.grad_out_bf16 ? bf16_to_f32(static_cast<const uint16_t*>(c.grad_out)[first + i])
                                       : static_cast<const float*>(c.grad_out)[first + i]);
  }
  c.grad_weights[at] = dw;
  store_vector(dg, false, I, gate.blocks * kBlockRows, vg + r * ldv * vsize);
  store_vector(du, false, I, gate.blocks * kBlockRows, vu + r * ldv * vsize);
}

// Items: the column chunks of x.
void MoeLayer::Backward::input_step() {
  L.pool_->run(gate.Kp / kChunkK, [&](int chunk, int) { input_chunk(chunk); });
}

// gx[t][chunk's columns] = sum over t's experts, in id order, of (Wg^T dg + Wu^T du); then stored in x's dtype.
// A token that lists an expert twice (a slot of weight 0 repeats it) has two rows of it, one after the other: they
// go to separate products, whose output rows must be distinct (TOut).
void MoeLayer::Backward::input_chunk(int chunk) {
  const int k0 = chunk * kChunkK;
  const GemmTFn gemm_t = bk.gemm_t[int(fmt)];
  for (int t = 0; t < T; ++t) std::fill(gx + t * ldgx + k0, gx + t * ldgx + k0 + kChunkK, 0.f);
  for (int j = 0; j < A; ++j)
    for (int r0 = row_begin[j], r1 = r0; r0 < row_begin[j + 1]; r0 = r1) {
      do ++r1;
      while (r1 < row_begin[j + 1] && tok[r1] != tok[r1 - 1]);
      const TOut out{gx + k0, ldgx, tok + r0};
      for (const Matrix* mat : {&gate, &up}) {
        TRows v = vectors(mat == &gate ? vg : vu, ldv, r0, r1 - r0, nullptr);
        for (int s = 0; s < S; ++s) {
          v.col0 = mat->slice_begin[s] * kBlockRows;
          gemm_t(L.view(*mat, ws.order[j], s), mat->slice_begin[s + 1] - mat->slice_begin[s], k0, v, out, true);
        }
      }
    }
  const float one = 1.f;
  const int n = std::min(kChunkK, H - k0);
  const size_t esize = c.x_bf16 ? 2 : 4;
  for (int t = 0; t < T; ++t) {
    const float* src = gx + t * ldgx + k0;
    fk.ops.combine(1, &src, &one, n, static_cast<char*>(c.grad_x) + (size_t(t0 + t) * H + k0) * esize, c.x_bf16);
  }
}

void MoeLayer::backward(const MoeBackwardCall& call) {
  if (call.T == 0) return;
  pool_->prewake();
  pool_->run_here([&] { Backward(*this, call).run(); });
}

}  // namespace hmoe
