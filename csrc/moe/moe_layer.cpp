#include "moe/moe_layer.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstring>
#include <new>
#include <stdexcept>
#include <thread>
#include <tuple>

#include "moe/pack.h"

namespace hmoe {
namespace {

constexpr int kAmxMinTokens = 16;  // below this an expert's tile rows would be mostly padding
// Up to this many tokens the weighted sum runs inside the GEMM run, per block of output columns
// (decode: a few us on one thread after the run otherwise); above it, as its own parallel phase.
constexpr int kCombineInRunTokens = 16;
constexpr const char* kMatName[3] = {"gate", "up", "down"};
// Calls of up to this many (token, slot) pairs group them by sorting (decode), not counting.
constexpr int kFewRows = 64;

const Kernels& kernels_for(Isa isa) {
  switch (isa) {
    case Isa::generic: return kernels_generic();
    case Isa::avx2: return kernels_avx2();
    case Isa::avx512: return kernels_avx512();
    case Isa::amx: return kernels_amx();
    case Isa::amx_emulated: return kernels_amx_emulated();
  }
  return kernels_generic();
}

// Page-aligned zeroed memory; bound to `node` when the machine really has that many nodes.
// Backed by huge pages where the kernel's THP mode allows it ("madvise" or "always"): decode
// streams each expert's weights once, and with 4 KiB pages every 4 KiB read is a TLB miss
// (the host read probe, read_bandwidth.cpp, asks for huge pages too). Huge pages made a decode
// loop faster in 11 of 12 cells (int4 T=1 176-210 us vs 217-223).
void* alloc_on_node(size_t bytes, int node, int nodes) {
  if (bytes == 0) bytes = 1;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::runtime_error("out of memory packing expert weights");
  madvise(p, bytes, MADV_HUGEPAGE);  // a hint: where THP is off it fails, harmlessly
  if (nodes > 1 && numa_node_count() == nodes) {
    unsigned long mask = 1ul << node;
    syscall(SYS_mbind, p, bytes, 2 /* MPOL_BIND */, &mask, sizeof(mask) * 8, 0);
  }
  return p;
}

// Scratch of the thread that runs a job (the pool's driver, or run()'s caller), reused by every
// layer of the pool (jobs run one at a time). Any std::vector, AlignedVec below included.
template <class T, class Alloc>
T* grow(std::vector<T, Alloc>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// 64-byte aligned vectors for the workspace: AMX tile rows and AVX-512 rows must not straddle
// cache lines (malloc's large blocks start 16 bytes past a page).
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <class U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};
template <class T>
using AlignedVec = std::vector<T, Aligned64<T>>;

// Scratch atomics (std::vector cannot hold them), grown like grow() above; callers set every
// entry they use (growing does not keep the old values).
struct AtomicInts {
  std::unique_ptr<std::atomic<int>[]> data;
  size_t size = 0;
};

std::atomic<int>* grow(AtomicInts& v, size_t n) {
  if (v.size < n) {
    v.data.reset(new std::atomic<int>[n]);
    v.size = n;
  }
  return v.data.get();
}

// A call's counters (one per active expert, one per down block), `stride` ints apart: 16 puts
// each on a cache line of its own, so that workers counting down different ones do not bounce
// one line between their cores.
struct Counters {
  std::atomic<int>* base;
  int stride;
  std::atomic<int>& operator[](int i) const { return base[size_t(i) * stride]; }
};

// One side's activation rows (x for gate/up, h for down), each row in the kind its expert's
// kernels read: bf16 and i16 rows at stride Kp + 32, i8 and i8_groups rows at Kq + 64 (Kq = Kp
// rounded up to 64, a whole AMX-INT8 step). Strides are not multiples of 4 KiB: rows that far
// apart would put all of a kernel's per-token loads into one L1 set. Tile kinds (AMX experts)
// share the buffer of their row-major kind: 16-row tiles of Kp (bf16) or Kq (i8) per row, back
// to back from the start, tile t holding rows 16t..16t+15. The AMX experts come first (most
// tokens first) with whole tiles each, so their tiles end before the first row-major row starts.
struct ActRows {
  AlignedVec<uint16_t> bf16;
  AlignedVec<int16_t> q;
  AlignedVec<int8_t> q8;
  AlignedVec<float> scale;
  AlignedVec<float> gscale;  // i8_groups: [rows][Kq / kActGroupK rounded up]
  AlignedVec<int32_t> sums;
};

struct ActLayout {
  int Kp = 0, Kq = 0, group = 0;  // group: int4 groups of i16 rows (0: no sums)
  int ng = 0;                      // i8_groups scales per row
  size_t ld = 0, ld8 = 0;
  uint16_t* bf16 = nullptr;
  int16_t* q = nullptr;
  int8_t* q8 = nullptr;
  float* scale = nullptr;
  float* gscale = nullptr;
  int32_t* sums = nullptr;

  ActLayout() = default;
  // Rows for Ra activation rows, buffers only for the kinds in use[].
  ActLayout(ActRows& rows, int Kp_, int group_, size_t Ra, const bool use[kActKinds])
      : Kp(Kp_), Kq(round_up(Kp_, 64)), group(group_), ng((Kq + kActGroupK - 1) / kActGroupK), ld(Kp_ + 32),
        ld8(Kq + 64) {
    if (use[int(ActKind::bf16)] || use[int(ActKind::bf16_tiles)]) bf16 = grow(rows.bf16, Ra * ld);
    if (use[int(ActKind::i16)]) q = grow(rows.q, Ra * ld);
    for (int k = 0; k < kActKinds; ++k)
      if (use[k] && act_int8(ActKind(k))) q8 = grow(rows.q8, Ra * ld8);
    scale = grow(rows.scale, Ra);
    if (use[int(ActKind::i8_groups)] || use[int(ActKind::i8_groups_tiles)]) gscale = grow(rows.gscale, Ra * ng);
    if (group && use[int(ActKind::i16)]) sums = grow(rows.sums, Ra * (Kp / group));
  }

  // Row r from src[0:n] (n = 0: a padding row of zeros); row-major kinds.
  void write(const RowOps& ops, const RowOps& ops8, ActKind kind, size_t r, const void* src, bool src_bf16, int n) {
    switch (kind) {
      case ActKind::bf16: ops.to_bf16(src, src_bf16, n, Kp, bf16 + r * ld); break;
      case ActKind::i16:
        ops.to_i16(src, src_bf16, n, Kp, group, q + r * ld, scale + r, sums ? sums + r * (Kp / group) : nullptr);
        break;
      case ActKind::i8: ops8.to_i8(src, src_bf16, n, Kq, 0, q8 + r * ld8, scale + r); break;
      case ActKind::i8_groups: ops8.to_i8(src, src_bf16, n, Kq, kActGroupK, q8 + r * ld8, gscale + r * ng); break;
      default: throw std::logic_error("tile-order rows are written a tile at a time (write_rows)");
    }
  }

  // Rows [r0, r1) from row(r) = {src, n} (n = 0: a padding row of zeros), any kind; tile kinds
  // need r0 and r1 at whole tiles, each written in order by the tile kinds' kernel set: bf16
  // converted straight into tile order (RowOps::to_bf16_tile), int8 (a scale per row or group
  // first) quantized into a scratch block of the writing thread, then copied out step by step
  // (RowOps::to_tiles): written row by row (each row's 64-byte pieces 1 KiB apart), or here
  // 64 bytes at a time, the h conversion took 1.3-2x the thread time of row-major rows.
  template <class Row>
  void write_rows(const RowOps& ops, const RowOps& ops8, ActKind kind, size_t r0, size_t r1, bool src_bf16,
                  Row row) {
    if (!act_tiles(kind)) {
      for (size_t r = r0; r < r1; ++r) {
        const auto [src, n] = row(r);
        write(ops, ops8, kind, r, src, src_bf16, n);
      }
      return;
    }
    if (r0 % 16 || r1 % 16) throw std::logic_error("tile-order activations are written in whole tiles");
    if (kind == ActKind::bf16_tiles) {
      for (size_t t0 = r0; t0 < r1; t0 += 16) {
        const void* src[16];
        int n[16];
        for (int i = 0; i < 16; ++i) std::tie(src[i], n[i]) = row(t0 + i);
        ops8.to_bf16_tile(src, src_bf16, n, Kp, bf16 + t0 * Kp);  // tile t0 / 16
      }
      return;
    }
    const size_t lds = size_t(Kq) + 64;  // scratch rows not 4 KiB apart
    thread_local AlignedVec<int8_t> scratch;
    int8_t* blk = grow(scratch, 16 * lds);
    for (size_t t0 = r0; t0 < r1; t0 += 16) {
      for (int i = 0; i < 16; ++i) {
        const size_t r = t0 + i;
        const auto [src, n] = row(r);
        if (kind == ActKind::i8_tiles) ops8.to_i8(src, src_bf16, n, Kq, 0, blk + i * lds, scale + r);
        else ops8.to_i8(src, src_bf16, n, Kq, kActGroupK, blk + i * lds, gscale + r * ng);
      }
      // tile t0 / 16: [Kq / 64 steps][16 rows][64 B]
      ops8.to_tiles(reinterpret_cast<const uint8_t*>(blk), lds, Kq / 64, reinterpret_cast<uint8_t*>(q8 + t0 * Kq));
    }
  }

  // Row r = row sr of `src` (same Kp and group; kinds bf16 and i16, whose rows hold all of it).
  void copy(ActKind kind, size_t r, const ActLayout& src, size_t sr) {
    if (kind == ActKind::bf16) {
      std::memcpy(bf16 + r * ld, src.bf16 + sr * src.ld, size_t(Kp) * 2);
      return;
    }
    std::memcpy(q + r * ld, src.q + sr * src.ld, size_t(Kp) * 2);
    scale[r] = src.scale[sr];
    if (sums) std::memcpy(sums + r * (Kp / group), src.sums + sr * (Kp / group), size_t(Kp / group) * 4);
  }

  // The rows of n tokens starting at activation row r0 (tile kinds: a multiple of 16).
  ActView view(ActKind kind, size_t r0, int n) const {
    ActView a;
    a.n = n;
    if (act_tiles(kind)) {
      if (r0 % 16) throw std::logic_error("tile-order activations must start at a whole tile");
      if (bf16) a.bf16 = bf16 + r0 * Kp;
      if (q8) a.q8 = q8 + r0 * Kq;
    } else {
      a.ld = int(act_int8(kind) ? ld8 : ld);
      if (bf16) a.bf16 = bf16 + r0 * ld;
      if (q) a.q = q + r0 * ld;
      if (q8) a.q8 = q8 + r0 * ld8;
    }
    a.qscale = scale + r0;
    if (act_groups(kind)) {
      a.qscale = gscale + r0 * ng;
      a.qgroups = ng;
    }
    if (sums) a.qsum = sums + r0 * (Kp / group);
    return a;
  }
};

// One GEMM work item: gate/up (down = 0) or down rows of expert j, slice s, blocks [b0, b1).
struct Item { int down, j, s, b0, b1; };

// What a call's GEMM item list depends on: it names active slots j, not experts, so every call
// with the same number of active experts, blocks and item sizes (a decode step's layers, one
// after the other) has the same list, built once. A = 0: nothing built yet.
struct PlanKey {
  int A = 0, A_own = 0, A_tiles = 0, A_tiles_own = 0, S = 0, gate_blocks = 0, down_blocks = 0;
  int step_own = 0, step_deferred = 0, threads = 0;
  bool tail_split = false, gate_up_tail = false;
  bool operator==(const PlanKey& o) const {
    return A == o.A && A_own == o.A_own && A_tiles == o.A_tiles && A_tiles_own == o.A_tiles_own && S == o.S &&
           gate_blocks == o.gate_blocks && down_blocks == o.down_blocks && step_own == o.step_own &&
           step_deferred == o.step_deferred && threads == o.threads && tail_split == o.tail_split &&
           gate_up_tail == o.gate_up_tail;
  }
};

// Asks for [p, p + bytes) into L2 (prefetcht1); lines already on their way cost little.
inline void prefetch_l2(const void* p, size_t bytes) {
  for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(static_cast<const char*>(p) + o, 0, 2);
}

inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

struct Workspace {
  std::vector<int> counts, order, row_begin, act_begin, tok, pos, items, offsets, slot_of, fill, chunk_first,
      tok_used;
  std::vector<uint64_t> keys;  // (expert << 32 | i) of a decode call's (token, slot) pairs
  std::vector<int> run_start, run_of, run_own;
  std::vector<uint8_t> own;       // per expert: in an own slot of some token (MoeCall::deferred)
  std::vector<uint8_t> slot_own;  // the same per active slot j
  std::vector<Item> gemm_items, tail_items;
  std::vector<int> gate_up_count;  // per active slot j: its gate/up items in gemm_items
  PlanKey plan;  // what gemm_items, offsets and gate_up_count were built for (Forward::plan_items)
  AtomicInts pending;   // per active expert
  AtomicInts col_left;  // per down block: experts whose y is still missing
  AtomicInts col_own;   // the same for the own experts alone (MoeCall::deferred)
  ActRows act, act2;  // activations of gate/up (x) and of down (h)
  ActRows act_tok;    // x once per token, for the experts of one token (decode)
  AlignedVec<float> h, y;
};
// One per thread that runs calls. A call's steps that run on the pool's workers read the calling
// thread's workspace through MoeLayer::Forward::ws, never through their own.
thread_local Workspace thread_ws;

}  // namespace

MoeLayer::MoeLayer(const MoeConfig& cfg, bool adopt) : cfg_(cfg), adopt_(adopt) {
  const int S = cfg_.numa_nodes;
  for (int m = 0; m < 3; ++m) {
    Matrix& mat = mats_[m];
    mat.N = m < 2 ? cfg_.I : cfg_.H;
    mat.K = m < 2 ? cfg_.H : cfg_.I;
    mat.Kp = cfg_.format == Format::int4 || cfg_.format == Format::mxfp4 ? mat.K : round_up(mat.K, 32);
    mat.blocks = round_up(mat.N, kBlockRows) / kBlockRows;
    for (int s = 0; s <= S; ++s) mat.slice_begin.push_back(int(int64_t(mat.blocks) * s / S));
    mat.w.assign(S, nullptr);
    mat.scale.assign(S, nullptr);
    mat.zero.assign(S, nullptr);
  }
  if (!adopt_)
    for (const auto& b : buffers()) {
      const int s = std::stoi(b.name.substr(b.name.find('.') + 1));
      void* p = alloc_on_node(b.bytes, s, S);
      owned_.emplace_back(p, b.bytes);
      set_buffer(b.name, p, b.bytes);
    }
  pool_ = shared_pool(cfg_.threads, cfg_.numa_nodes);
  if (cfg_.isa == Isa::amx || cfg_.isa == Isa::amx_emulated) {
    base_ = &kernels_avx512();
    many_ = &kernels_for(cfg_.isa);
  } else {
    base_ = many_ = &kernels_for(cfg_.isa);
  }
}

MoeLayer::~MoeLayer() {
  if (last_ticket_) {
    try {
      pool_->wait(last_ticket_);
    } catch (...) {
    }
  }
  for (auto& [p, n] : owned_) munmap(p, n);
}

size_t MoeLayer::scale_bytes(const Matrix& m, int blocks) const {
  if (cfg_.format == Format::int8) return size_t(blocks) * kBlockRows * 4;
  if (cfg_.format == Format::int4) return size_t(blocks) * (m.Kp / cfg_.group) * kBlockRows * 4;
  if (cfg_.format == Format::fp8) return size_t(blocks) * fp8_groups(m.Kp) * 4;
  if (cfg_.format == Format::mxfp4) return size_t(blocks) * (m.Kp / kMxfp4GroupK) * kBlockRows;
  return 0;
}

std::vector<PackedBuffer> MoeLayer::buffers() const {
  std::vector<PackedBuffer> out;
  for (int m = 0; m < 3; ++m) {
    const Matrix& mat = mats_[m];
    for (int s = 0; s < cfg_.numa_nodes; ++s) {
      const int nb = mat.slice_begin[s + 1] - mat.slice_begin[s];
      const std::string base = std::string(kMatName[m]) + "." + std::to_string(s) + ".";
      out.push_back({base + "w", mat.w[s], size_t(cfg_.E) * nb * block_bytes(cfg_.format, mat.Kp), false});
      const size_t sb = size_t(cfg_.E) * scale_bytes(mat, nb);
      if (sb) out.push_back({base + "scale", mat.scale[s], sb, cfg_.format != Format::mxfp4});
      if (sb && cfg_.format == Format::int4 && cfg_.zero_points) out.push_back({base + "zero", mat.zero[s], sb, true});
    }
  }
  return out;
}

void MoeLayer::set_buffer(const std::string& name, void* data, size_t bytes) {
  for (const auto& b : buffers()) {
    if (b.name != name) continue;
    if (b.bytes != bytes)
      throw std::invalid_argument("packed buffer '" + name + "' has " + std::to_string(bytes) +
                                  " bytes, expected " + std::to_string(b.bytes) +
                                  " for this shape and format");
    const auto dot1 = name.find('.'), dot2 = name.rfind('.');
    const int m = int(std::find(kMatName, kMatName + 3, name.substr(0, dot1)) - kMatName);
    const int s = std::stoi(name.substr(dot1 + 1, dot2 - dot1 - 1));
    const std::string kind = name.substr(dot2 + 1);
    if (kind == "w") mats_[m].w[s] = static_cast<uint8_t*>(data);
    if (kind == "scale") mats_[m].scale[s] = static_cast<uint8_t*>(data);
    if (kind == "zero") mats_[m].zero[s] = static_cast<uint8_t*>(data);
    return;
  }
  throw std::invalid_argument("unknown packed buffer '" + name + "' for this shape and format");
}

PackedView MoeLayer::view(const Matrix& m, int e, int s) const {
  const int nb = m.slice_begin[s + 1] - m.slice_begin[s];
  PackedView v;
  v.w = m.w[s] + size_t(e) * nb * block_bytes(cfg_.format, m.Kp);
  const size_t sb = scale_bytes(m, nb);
  const uint8_t* scale = m.scale[s] ? m.scale[s] + size_t(e) * sb : nullptr;
  if (cfg_.format == Format::mxfp4) v.e8m0 = scale;
  else v.scale = reinterpret_cast<const float*>(scale);
  v.zero = m.zero[s] ? reinterpret_cast<const float*>(m.zero[s] + size_t(e) * sb) : nullptr;
  v.Kp = m.Kp;
  v.group = cfg_.group;
  v.prefetch_l1 = tuning_.kernel_prefetch_l1;
  v.prefetch_l2 = tuning_.kernel_prefetch_l2;
  return v;
}

template <class PackBlock>
void MoeLayer::each_block(int e, PackBlock pack) {
  last_ticket_ = pool_->submit([&] {
    // Items: one block of one matrix; a packer writes only that block's bytes and scales.
    std::vector<int> offsets{0};
    std::vector<std::pair<int, int>> items;  // (matrix, global block)
    for (int s = 0; s < cfg_.numa_nodes; ++s) {
      for (int m = 0; m < 3; ++m)
        for (int b = mats_[m].slice_begin[s]; b < mats_[m].slice_begin[s + 1]; ++b) items.emplace_back(m, b);
      offsets.push_back(int(items.size()));
    }
    pool_->run(offsets, [&](int i, int) {
      const auto [m, b] = items[i];
      const Matrix& mat = mats_[m];
      int s = 0;
      while (b >= mat.slice_begin[s + 1]) ++s;
      pack(m, b, view(mat, e, s), b - mat.slice_begin[s]);
    });
  });
  pool_->wait(last_ticket_);
}

void MoeLayer::pack_expert(int e, const float* gate, const float* up, const float* down) {
  const float* src[3] = {gate, up, down};
  each_block(e, [&](int m, int b, const PackedView& v, int lb) {
    const Matrix& mat = mats_[m];
    uint8_t* w = const_cast<uint8_t*>(v.w) + size_t(lb) * block_bytes(cfg_.format, mat.Kp);
    if (cfg_.format == Format::mxfp4) {
      uint8_t* e8m0 = const_cast<uint8_t*>(v.e8m0) + lb * scale_bytes(mat, 1);
      pack_blocks_mxfp4_float(src[m], mat.N, mat.K, b, b + 1, w, e8m0);
      return;
    }
    const size_t sf = scale_bytes(mat, 1) / 4;
    pack_blocks(cfg_.format, cfg_.group, src[m], mat.N, mat.K, mat.Kp, b, b + 1, w,
                v.scale ? const_cast<float*>(v.scale) + lb * sf : nullptr,
                v.zero ? const_cast<float*>(v.zero) + lb * sf : nullptr);
  });
}

void MoeLayer::pack_expert_fp8(int e, const Fp8Codes mats[3]) {
  if (cfg_.format != Format::fp8) throw std::invalid_argument("packing from fp8 codes needs format='fp8'");
  for (int m = 0; m < 3; ++m) {
    const Matrix& mat = mats_[m];
    const size_t ns = size_t((mat.N + kFp8GroupK - 1) / kFp8GroupK) * fp8_groups(mat.Kp);
    for (size_t i = 0; i < ns; ++i)
      if (!std::isfinite(mats[m].scale[i]))
        throw std::invalid_argument("expert " + std::to_string(e) + "'s " + kMatName[m] + " block scale " +
                                    std::to_string(i) + " is " + std::to_string(mats[m].scale[i]) +
                                    "; the checkpoint's scales are damaged");
  }
  std::atomic<bool> nan_in[3] = {false, false, false};
  each_block(e, [&](int m, int b, const PackedView& v, int lb) {
    const Matrix& mat = mats_[m];
    if (pack_blocks_fp8(mats[m], mat.N, mat.K, mat.Kp, b, b + 1,
                        const_cast<uint8_t*>(v.w) + size_t(lb) * block_bytes(Format::fp8, mat.Kp),
                        const_cast<float*>(v.scale) + lb * scale_bytes(mat, 1) / 4))
      nan_in[m].store(true, std::memory_order_relaxed);
  });
  for (int m = 0; m < 3; ++m) {  // a damaged matrix (rare): its first NaN code named
    if (!nan_in[m].load(std::memory_order_relaxed)) continue;
    const uint8_t* codes = mats[m].codes;
    const size_t at = size_t(std::find_if(codes, codes + size_t(mats_[m].N) * mats_[m].K, e4m3_is_nan) - codes);
    throw std::invalid_argument("expert " + std::to_string(e) + "'s " + kMatName[m] + " code " +
                                std::to_string(codes[at]) + " at " + std::to_string(at) +
                                " is NaN in e4m3; the checkpoint's weights are damaged");
  }
}

void MoeLayer::pack_expert_mxfp4(int e, const Mxfp4Codes mats[3]) {
  if (cfg_.format != Format::mxfp4) throw std::invalid_argument("packing from mxfp4 codes needs format='mxfp4'");
  std::atomic<int64_t> bad[3] = {INT64_MAX, INT64_MAX, INT64_MAX};  // per matrix: its first refused group
  each_block(e, [&](int m, int b, const PackedView& v, int lb) {
    const Matrix& mat = mats_[m];
    const int64_t at = pack_blocks_mxfp4(mats[m], mat.N, mat.K, b, b + 1,
                                         const_cast<uint8_t*>(v.w) + size_t(lb) * block_bytes(Format::mxfp4, mat.Kp),
                                         const_cast<uint8_t*>(v.e8m0) + lb * scale_bytes(mat, 1));
    for (int64_t seen = bad[m].load(std::memory_order_relaxed); at >= 0 && at < seen;)
      bad[m].compare_exchange_weak(seen, at, std::memory_order_relaxed);
  });
  for (int m = 0; m < 3; ++m) {
    const int64_t at = bad[m].load(std::memory_order_relaxed);
    if (at == INT64_MAX) continue;
    const int G = mats_[m].K / kMxfp4GroupK;
    throw std::invalid_argument("expert " + std::to_string(e) + "'s " + kMatName[m] + " scale " +
                                std::to_string(mats[m].scales[at]) + " at row " + std::to_string(at / G) + ", block " +
                                std::to_string(at % G) + " is outside 2..252 (2^-125..2^125), the e8m0 scales the " +
                                "engine holds under nonzero codes; the checkpoint's weights are damaged");
  }
}

void MoeLayer::unpack_expert(int e, float* gate, float* up, float* down) const {
  float* dst[3] = {gate, up, down};
  for (int m = 0; m < 3; ++m) {
    const Matrix& mat = mats_[m];
    for (int s = 0; s < cfg_.numa_nodes; ++s) {
      PackedView v = view(mat, e, s);
      // unpack_blocks indexes blocks from the view's start: shift the destination rows.
      const int b0 = mat.slice_begin[s], b1 = mat.slice_begin[s + 1];
      for (int b = b0; b < b1; ++b) {
        PackedView vb = v;
        const int lb = b - b0;
        vb.w = v.w + size_t(lb) * block_bytes(cfg_.format, mat.Kp);
        const size_t sb = scale_bytes(mat, 1);
        if (vb.scale) vb.scale = v.scale + lb * sb / 4;
        if (vb.zero) vb.zero = v.zero + lb * sb / 4;
        if (vb.e8m0) vb.e8m0 = v.e8m0 + lb * sb;
        float* rows = dst[m] + size_t(b) * kBlockRows * mat.K;
        unpack_blocks(cfg_.format, vb, mat.N - b * kBlockRows, mat.K, 0, 1, rows);
      }
    }
  }
}

void MoeLayer::set_glu(GluKind kind, float alpha, float limit) {
  if (kind == GluKind::clamped_swiglu && !(std::isfinite(limit) && limit > 0.f))
    throw std::invalid_argument("the clamped SwiGLU's limit must be positive and finite, got " + std::to_string(limit));
  if (kind == GluKind::clamped_swiglu && !std::isfinite(alpha))
    throw std::invalid_argument("the clamped SwiGLU's alpha must be finite, got " + std::to_string(alpha));
  glu_ = Glu{};
  glu_.kind = kind;
  if (kind == GluKind::clamped_swiglu) glu_.alpha = alpha, glu_.limit = limit;
}

// Rows padded to whole blocks with zeros: a kernel's padding columns (zero weights) stay zero after their
// bias, and every row starts at a fixed stride.
void MoeLayer::set_biases(const float* gate, const float* up, const float* down) {
  const float* src[3] = {gate, up, down};
  for (int m = 0; m < 3; ++m) {
    const int n = mats_[m].N, ld = mats_[m].blocks * kBlockRows;
    bias_[m].assign(size_t(cfg_.E) * ld, 0.f);
    for (int e = 0; e < cfg_.E; ++e)
      std::copy(src[m] + size_t(e) * n, src[m] + size_t(e + 1) * n, bias_[m].data() + size_t(e) * ld);
  }
}

const Glu* MoeLayer::glu_of(int e, int col, Glu& scratch) const {
  if (glu_.kind == GluKind::silu && bias_[0].empty()) return nullptr;
  scratch = glu_;
  if (!bias_[0].empty()) {
    const size_t at = size_t(e) * mats_[0].blocks * kBlockRows + col;
    scratch.gate_bias = bias_[0].data() + at;
    scratch.up_bias = bias_[1].data() + at;
  }
  return &scratch;
}

const float* MoeLayer::down_bias(int e, int col) const {
  return bias_[2].empty() ? nullptr : bias_[2].data() + size_t(e) * mats_[2].blocks * kBlockRows + col;
}

uint64_t MoeLayer::submit(const MoeCall& call) {
  const int64_t call_ns = tracer_.armed() ? trace_now_ns() : 0;
  pool_->prewake();
  last_ticket_ = pool_->submit([this, call, call_ns] { forward(call, call_ns); });
  return last_ticket_;
}

void MoeLayer::wait(uint64_t ticket) { pool_->wait(ticket); }

void MoeLayer::prewake() { pool_->prewake(); }

void MoeLayer::run(const MoeCall& call) {
  const int64_t call_ns = tracer_.armed() ? trace_now_ns() : 0;
  pool_->prewake();
  pool_->run_here([&] { forward(call, call_ns); });
}

// One forward call: its state, and the steps MoeLayer::forward runs in turn. Tokens are grouped by
// expert (group_tokens), each expert's activation rows laid out (layout_activations) and written
// from x (plan_conversion, convert_x), the GEMM items planned or the last call's plan reused
// (plan_items), gate/up and down run in one pool run (run_items), and each token's expert outputs
// summed (inside the run for calls of few tokens, else after it: finish).
struct MoeLayer::Forward {
  Forward(MoeLayer& layer, const MoeCall& call, int64_t call_ns);
  void run();

 private:
  // Steps.
  void prefetch_decode_state();
  void group_tokens();
  void group_by_sorting();
  void group_by_counting();
  void layout_activations();
  void plan_conversion();
  void add_chunks(int j);
  void convert_x();
  void plan_items();
  int step_for(int experts) const;
  int gate_up_items(int step) const;
  void split_tail(size_t seg);
  void prepare_run();
  void run_items();
  void gate_up_item(int i, int worker);
  void down_item(int i, int worker);
  void combine_in_item(const Item& it);
  void finish();

  // Helpers of the steps.
  int id_at(int i) const {
    return c.ids64 ? int(static_cast<const int64_t*>(c.ids)[i]) : static_cast<const int32_t*>(c.ids)[i];
  }
  bool tiles(int n) const { return L.many_ != L.base_ && n >= kAmxMinTokens; }
  int n_of(int j) const { return row_begin[j + 1] - row_begin[j]; }
  const Kernels& kernels_of(int j) const { return n_of(j) >= kAmxMinTokens ? *L.many_ : *L.base_; }
  // Activation rows expert j's kernels read: AMX tiles read whole 16-row panels (padding rows
  // zeros), the other kernels n rows only; a decode step's experts (1 token each) would
  // otherwise write 15 rows of zeros per token, on the critical path.
  int rows_read(int j) const { return tiles(n_of(j)) ? round_up(n_of(j), 16) : n_of(j); }
  // Whether expert j reads token rows of tok1 (one token, or rows copied from tok1).
  bool from_tok1(int j) const { return &kernels_of(j) == L.base_ && (n_of(j) == 1 || copies); }
  const void* x_row(int t) const { return static_cast<const char*>(c.x) + size_t(t) * H * esize; }
  void parallel_or_inline(int n, size_t work, ItemFn fn);
  void combine_slots(int t, int k0, int k1, void* dst, int c0, int c1);
  void combine(int t, int c0, int c1) { combine_slots(t, 0, K_own, c.out, c0, c1); }
  void combine_deferred(int t, int c0, int c1) { combine_slots(t, K_own, K, c.out2, c0, c1); }
  void out_ready();
  void down_acts(int j);
  void prefetch_heads(const Matrix& mat, const Item& it) const;

  MoeLayer& L;
  const MoeCall& c;
  const MoeTuning tune;
  Workspace& ws;  // the calling thread's (thread_ws), also in the steps the workers run
  const int T, K, E, H, I, S, R;
  const int K_own;      // with deferral, the own slots k < K_own come first everywhere
  const size_t esize;   // bytes per value of x, out and out2
  const Matrix &gate, &up, &down;
  TraceCall trace;  // filled only when this call is traced (tr); empty vectors cost nothing
  TraceCall* const tr;

  // group_tokens: order[j] the expert of active slot j; rows of slot j [row_begin[j], row_begin[j+1])
  // in token order; tok[row] its token, pos[t * K + k] the row of (t, k); slot_own[j]: an own expert
  // (all are, without deferral). The first A_tiles slots are AMX experts, A_tiles_own of them own.
  std::vector<int>& order;
  int A = 0, A_own = 0, A_tiles = 0, A_tiles_own = 0;
  int* row_begin = nullptr;
  int* tok = nullptr;
  int* pos = nullptr;
  const uint8_t* slot_own = nullptr;

  // layout_activations: activation rows of slot j [act_begin[j], act_begin[j] + rows_read(j)), packed
  // back to back; act1 for gate/up (x), act2 for down (h), tok1 one row per token; h [R, ldh] and
  // y [R, ldy] fp32 rows, one per (token, slot).
  int* act_begin = nullptr;
  const RowOps* ops = nullptr;   // base_'s
  const RowOps* ops8 = nullptr;  // many_'s: to_i8, where a kernel set reads i8 rows
  size_t ldh = 0, ldy = 0;
  ActLayout act1, act2, tok1;
  ActKind tok_kind = ActKind::bf16;
  float* h = nullptr;
  float* y = nullptr;

  // plan_conversion: phase A's items (-1: token chunk_first[i]'s row of tok1; else slot j's 16 rows
  // from row chunk_first[i]); the first `converts` convert x, the rest copy tok1 rows.
  bool copies = false;  // tok1's kind holds whole rows (bf16, i16): copied, not converted again
  int converts = 0, chunks = 0;
  size_t rows_written = 0, rows_copied = 0;
  bool early = false;   // x converted inside the GEMM run (MoeTuning::early_start)
  std::atomic<bool> acts_ready{true};

  // prepare_run: the run's counters and how its outputs are summed.
  Counters pending{nullptr, 1};
  Counters col_left{nullptr, 1};
  Counters col_own{nullptr, 1};
  TraceItem* titems = nullptr;  // tracing: one record per GEMM item, written by its worker
  bool combine_in_run = false;
  bool ready_in_run = false;
  alignas(64) std::atomic<int> own_blocks_left{0};
};

MoeLayer::Forward::Forward(MoeLayer& layer, const MoeCall& call, int64_t call_ns)
    : L(layer), c(call), tune(layer.tuning_), ws(thread_ws), T(call.T), K(call.K), E(layer.cfg_.E), H(layer.cfg_.H),
      I(layer.cfg_.I), S(layer.cfg_.numa_nodes), R(call.T * call.K), K_own(call.K - call.deferred),
      esize(call.x_bf16 ? 2 : 4), gate(layer.mats_[0]), up(layer.mats_[1]), down(layer.mats_[2]),
      tr(layer.tracer_.claim() ? &trace : nullptr), order(ws.order) {
  if (tr) {
    tr->call_ns = call_ns;
    tr->entry_ns = trace_now_ns();
  }
}

void MoeLayer::Forward::run() {
  if (T <= kCombineInRunTokens) prefetch_decode_state();
  group_tokens();
  layout_activations();
  plan_conversion();
  if (!early) convert_x();
  // Traced: x converted, or (early) its conversion handed to the run, whose gate/up items' wait
  // then shows it.
  if (tr) tr->acts_ns = trace_now_ns();
  plan_items();
  prepare_run();
  run_items();
  finish();
}

// Decode: x (fresh from the caller, often not in this core's caches) and the rows its conversion
// writes, on their way while the tokens are grouped; each a few KiB. So are the item list this call
// will likely reuse (the plan) and the column counters it sets: evicted by the weights that streamed
// past since the last call.
void MoeLayer::Forward::prefetch_decode_state() {
  prefetch_l2(c.x, size_t(T) * H * esize);
  if (!ws.act_tok.q.empty()) prefetch_l2(ws.act_tok.q.data(), std::min(ws.act_tok.q.size(), size_t(T) * (H + 32)) * 2);
  if (!ws.act_tok.bf16.empty())
    prefetch_l2(ws.act_tok.bf16.data(), std::min(ws.act_tok.bf16.size(), size_t(T) * (H + 32)) * 2);
  prefetch_l2(ws.gemm_items.data(), ws.gemm_items.size() * sizeof(Item));
  for (size_t o = 0; o < ws.col_left.size * sizeof(int); o += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(ws.col_left.data.get()) + o, 1, 2);
}

// Groups the (token, slot) pairs by expert: most tokens first (longest work first), ties by expert
// id. With deferral the A_own experts that some token has in an own slot come first, each side in
// that order; but the experts of AMX tiles first of all (their activation rows are whole tiles from
// the start, see ActRows).
void MoeLayer::Forward::group_tokens() {
  order.clear();
  tok = grow(ws.tok, R);
  pos = grow(ws.pos, R);
  if (R <= kFewRows) group_by_sorting();
  else group_by_counting();
  A = int(order.size());
  if (tr) tr->grouped_ns = trace_now_ns();
  slot_own = ws.slot_own.data();
  for (int j = 0; j < A && tiles(n_of(j)); ++j) ++A_tiles, A_tiles_own += slot_own[j];
}

// Decode: sorts the R (expert, i) keys instead of counting over all E experts: only R-sized arrays
// are touched (counting clears and scans two E-sized ones, and sorts with a buffer).
void MoeLayer::Forward::group_by_sorting() {
  uint64_t* key = grow(ws.keys, R);
  for (int i = 0; i < R; ++i) {
    const uint64_t k = uint64_t(id_at(i)) << 32 | uint32_t(i);
    int r = i;
    for (; r > 0 && key[r - 1] > k; --r) key[r] = key[r - 1];
    key[r] = k;
  }
  int* run_start = grow(ws.run_start, R + 1);  // keys of the expert's run: [run_start[q], run_start[q+1])
  int runs = 0;
  for (int r = 0; r < R; ++r)
    if (r == 0 || key[r] >> 32 != key[r - 1] >> 32) run_start[runs++] = r;
  run_start[runs] = R;
  // Runs of AMX tiles first, then own runs, then by length, longest first, stably (insertion: runs are
  // few); slot j takes run q.
  int* run_own = grow(ws.run_own, runs);
  for (int q = 0; q < runs; ++q) {
    run_own[q] = 0;
    for (int r = run_start[q]; r < run_start[q + 1]; ++r) run_own[q] |= int(uint32_t(key[r]) % K) < K_own;
    A_own += run_own[q];
  }
  auto rank = [&](int q) {
    const int n = run_start[q + 1] - run_start[q];
    return n + run_own[q] * (R + 1) + tiles(n) * 2 * (R + 1);
  };
  int* run_of = grow(ws.run_of, runs);
  for (int q = 0; q < runs; ++q) {
    const int r = rank(q);
    int j = q;
    for (; j > 0 && rank(run_of[j - 1]) < r; --j) run_of[j] = run_of[j - 1];
    run_of[j] = q;
  }
  row_begin = grow(ws.row_begin, runs + 1);
  row_begin[0] = 0;
  uint8_t* own = grow(ws.slot_own, runs);
  for (int j = 0; j < runs; ++j) {
    const int q = run_of[j];
    own[j] = uint8_t(run_own[q]);
    order.push_back(int(key[run_start[q]] >> 32));
    for (int r = run_start[q]; r < run_start[q + 1]; ++r) {
      const int i = int(uint32_t(key[r])), row = row_begin[j] + (r - run_start[q]);
      tok[row] = i / K;
      pos[i] = row;
    }
    row_begin[j + 1] = row_begin[j] + run_start[q + 1] - run_start[q];
  }
}

// Many tokens: counts each expert's pairs, then places them.
void MoeLayer::Forward::group_by_counting() {
  int* counts = grow(ws.counts, E);
  std::fill(counts, counts + E, 0);
  for (int i = 0; i < R; ++i) ++counts[id_at(i)];
  uint8_t* own = grow(ws.own, E);
  std::fill(own, own + E, uint8_t(c.deferred == 0));
  if (c.deferred)
    for (int i = 0; i < R; ++i) own[id_at(i)] |= i % K < K_own;
  for (int e = 0; e < E; ++e)
    if (counts[e]) order.push_back(e), A_own += own[e];
  // Ties by id make it the stable order without std::stable_sort's buffer (a malloc per call).
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    if (tiles(counts[a]) != tiles(counts[b])) return tiles(counts[a]);
    return own[a] != own[b] ? own[a] > own[b] : counts[a] != counts[b] ? counts[a] > counts[b] : a < b;
  });
  const int n = int(order.size());
  row_begin = grow(ws.row_begin, n + 1);
  int* slot_of = grow(ws.slot_of, E);  // read only for active experts, all set below
  uint8_t* own_slot = grow(ws.slot_own, n);
  row_begin[0] = 0;
  for (int j = 0; j < n; ++j) {
    slot_of[order[j]] = j;
    own_slot[j] = own[order[j]];
    row_begin[j + 1] = row_begin[j] + counts[order[j]];
  }
  int* fill = std::copy(row_begin, row_begin + n, grow(ws.fill, n)) - n;
  for (int i = 0; i < R; ++i) {
    const int j = slot_of[id_at(i)];
    tok[fill[j]] = i / K;
    pos[i] = fill[j]++;
  }
}

// The activation rows of every active expert, and the h and y rows. h and y rows are 64 bytes past
// the padded width, so that neither stride is a multiple of 4 KiB (L1 sets, as for activations).
void MoeLayer::Forward::layout_activations() {
  act_begin = grow(ws.act_begin, A + 1);
  act_begin[0] = 0;
  for (int j = 0; j < A; ++j) act_begin[j + 1] = act_begin[j] + rows_read(j);
  const Format fmt = L.cfg_.format;
  ops = &L.base_->ops;
  ops8 = &L.many_->ops;
  const size_t Ra = act_begin[A];
  const int grp = fmt == Format::int4 ? L.cfg_.group : 0;
  ldh = size_t(gate.blocks) * kBlockRows + 16;
  ldy = size_t(down.blocks) * kBlockRows + 16;
  bool use1[kActKinds] = {}, use2[kActKinds] = {};
  for (const Kernels* k : {L.base_, L.many_}) {
    use1[int(act_of(*k, false, fmt))] = true;
    use2[int(act_of(*k, true, fmt))] = true;
  }
  act1 = ActLayout(ws.act, gate.Kp, grp, Ra, use1);
  act2 = ActLayout(ws.act2, down.Kp, grp, Ra, use2);
  // An expert with one token (every expert of a decode step) reads that token's row of tok1:
  // each token is converted once, not once per expert (K times at T = 1), and the rows stay few
  // and cache-hot. Those experts run base_'s kernels (one token is below kAmxMinTokens).
  tok1 = ActLayout(ws.act_tok, gate.Kp, grp, T, use1);
  tok_kind = act_of(*L.base_, false, fmt);
  h = grow(ws.h, size_t(R) * ldh);
  y = grow(ws.y, size_t(R) * ldy);
}

// Phase A's items: x -> activation rows, each token converted once for the experts that run base_'s
// kernels (all of a decode step's). A1 converts x rows into tok1 (items (-1, token)) and the AMX
// experts' rows (chunks of 16: (expert, first row), padding rows zeros); A2 copies tok1 rows into the
// rows of base_'s experts with several tokens (chunks likewise). One-token experts read tok1 itself.
void MoeLayer::Forward::plan_conversion() {
  copies = tok_kind == ActKind::bf16 || tok_kind == ActKind::i16;
  ws.items.clear();
  ws.chunk_first.clear();
  int* tok_used = grow(ws.tok_used, T);
  std::fill(tok_used, tok_used + T, 0);
  for (int j = 0; j < A; ++j)
    if (from_tok1(j))
      for (int r = row_begin[j]; r < row_begin[j + 1]; ++r)
        if (!tok_used[tok[r]]++) {
          ws.items.push_back(-1);
          ws.chunk_first.push_back(tok[r]);
          ++rows_written;
        }
  for (int j = 0; j < A; ++j) {
    if (from_tok1(j)) continue;
    rows_written += rows_read(j);
    add_chunks(j);
  }
  converts = int(ws.items.size());
  for (int j = 0; j < A; ++j) {
    if (!from_tok1(j) || n_of(j) == 1) continue;
    rows_copied += n_of(j);
    add_chunks(j);
  }
  chunks = int(ws.items.size());
  // x is converted before the run, or with early_start (a decode call, converted inline) inside the
  // GEMM run, by its caller once the workers are on their way (gate/up items wait for acts_ready).
  const bool inline_acts = rows_written * H < (1u << 15) && rows_copied * H / 4 < (1u << 15);
  early = tune.early_start && inline_acts;
  acts_ready.store(!early, std::memory_order_relaxed);
}

// Phase A items of slot j's activation rows, 16 at a time.
void MoeLayer::Forward::add_chunks(int j) {
  for (int r = act_begin[j]; r < act_begin[j + 1]; r += 16) {
    ws.items.push_back(j);
    ws.chunk_first.push_back(r);
  }
}

void MoeLayer::Forward::parallel_or_inline(int n, size_t work, ItemFn fn) {
  if (work < (1u << 15)) {
    for (int i = 0; i < n; ++i) fn(i, 0);
  } else {
    L.pool_->run(n, fn);
  }
}

// Phase A: A1 then A2 (plan_conversion), then acts_ready.
void MoeLayer::Forward::convert_x() {
  const std::vector<int>& items = ws.items;
  const std::vector<int>& chunk_first = ws.chunk_first;
  const Format fmt = L.cfg_.format;
  auto rows_of = [&](int i) {  // phase A item i's activation rows
    const int j = items[i], a0 = chunk_first[i];
    return std::make_pair(size_t(a0), std::min<size_t>(a0 + 16, act_begin[j] + rows_read(j)));
  };
  parallel_or_inline(converts, rows_written * H, [&](int i, int) {  // A1
    const int j = items[i], a0 = chunk_first[i];
    if (j < 0) {  // token a0's row of tok1
      tok1.write(*ops, *ops8, tok_kind, a0, x_row(a0), c.x_bf16, H);
      return;
    }
    const ActKind kind = act_of(kernels_of(j), false, fmt);
    const auto [r0, r1] = rows_of(i);
    act1.write_rows(*ops, *ops8, kind, r0, r1, c.x_bf16, [&](size_t r) {
      const int local = r - act_begin[j];
      const bool pad = local >= n_of(j);
      return std::make_pair(x_row(pad ? 0 : tok[row_begin[j] + local]), pad ? 0 : H);
    });
  });
  // A2: a row copy moves 2 bytes per K, a conversion reads x and works on it more than once
  parallel_or_inline(chunks - converts, rows_copied * H / 4, [&](int i, int) {
    const int j = items[converts + i];
    const auto [r0, r1] = rows_of(converts + i);
    for (size_t r = r0; r < r1; ++r) act1.copy(tok_kind, r, tok1, tok[row_begin[j] + (r - act_begin[j])]);
  });
  acts_ready.store(true, std::memory_order_release);
}

// Gate/up items per expert (the same for all of one side): each one counts down its expert's pending.
int MoeLayer::Forward::gate_up_items(int step) const {
  int n = 0;
  for (int s = 0; s < S; ++s) n += (gate.slice_begin[s + 1] - gate.slice_begin[s] + step - 1) / step;
  return n;
}

// 32-row blocks per GEMM item for `experts` experts, 1 to 8: each item restarts its weight streams,
// and split_tail keeps the end of the run fine-grained. Balanced (the default): the size with which
// the run should end soonest, in units of one gate/up block's time (a down block's is r = I / 2H of
// it, an item's restart ~0.2): the later of the critical path (the gate/up items' rounds over the
// workers, each round an item long, then the last expert's down items spread over the workers) and
// all the work spread over the workers. An expert's down items wait for all its gate/up items, so one
// round too many holds up the run: 6 one-token experts of Qwen3-30B-A3B (24 gate blocks) in 8-block
// items are 18 items for 15 workers, the last 3 run after the others and their experts' down items
// wait for them; in 6- or 7-block items the second round is full and short. Otherwise about 4 items
// per thread over gate/up and down blocks. Sized per side with deferral: the deferred experts (often
// one or two) in items as small as their own count asks for, so that every worker reads their weights.
int MoeLayer::Forward::step_for(int experts) const {
  if (tune.item_blocks > 0) return tune.item_blocks;
  const int threads = L.pool_->threads();
  if (!tune.balanced_items) {
    const int64_t blocks = int64_t(gate.blocks + down.blocks) * experts;
    return int(std::clamp<int64_t>(blocks / (4 * threads), 1, 8));
  }
  constexpr double kRestart = 0.2;
  const double r = double(down.K) / (2.0 * gate.K);  // a down block's bytes over a gate/up block's
  const double work = experts * (gate.blocks + down.blocks * r);
  int best = 8;
  double best_time = 1e300;
  for (int step = 8; step >= 1; --step) {  // ties: the larger items
    int down_items = 0;
    for (int s = 0; s < S; ++s) down_items += (down.slice_begin[s + 1] - down.slice_begin[s] + step - 1) / step;
    const int64_t gate_up = int64_t(experts) * gate_up_items(step), items = gate_up + int64_t(experts) * down_items;
    const int64_t rounds = (gate_up + threads - 1) / threads;
    const double critical = rounds * (step + kRestart) + down.blocks * r / threads;
    const double time = std::max(critical, (work + items * kRestart) / threads);
    if (time < best_time - 1e-9) best = step, best_time = time;
  }
  return best;
}

// The last items of the segment from seg on, about two blocks per thread of the group, become 1-block
// items: workers run out of work (or reach the deferred experts) within a small item of each other.
// For gate/up (gate_up_tail): the experts whose gate/up ends last hold up their down items, so every
// worker should finish its share of gate/up at about the same time.
void MoeLayer::Forward::split_tail(size_t seg) {
  std::vector<Item>& items = ws.gemm_items;
  size_t first = items.size();
  for (int covered = 0; first > seg && covered < 2 * L.pool_->threads() / S;)
    --first, covered += items[first].b1 - items[first].b0;
  ws.tail_items.assign(items.begin() + first, items.end());
  items.resize(first);
  for (const Item& it : ws.tail_items)
    for (int b = it.b0; b < it.b1; ++b) items.push_back({it.down, it.j, it.s, b, b + 1});
}

// The GEMM items (expert, slice, block range): per slice, all gate/up items (largest experts first),
// then all down items; with deferral that for the own experts, then again for the deferred ones. The
// list names active slots, not experts: a call with the same plan key as the last one (a decode
// step's layers, one after the other) reuses it.
void MoeLayer::Forward::plan_items() {
  const int step_own = step_for(A_own), step_deferred = step_for(A - A_own);
  // (with A_own and the AMX experts' counts, the own slots are known: own AMX experts, deferred ones, own others)
  const PlanKey plan{A, A_own, A_tiles, A_tiles_own, S, gate.blocks, down.blocks, step_own, step_deferred,
                     L.pool_->threads(), tune.tail_split, tune.gate_up_tail};
  if (plan == ws.plan) return;
  std::vector<Item>& items = ws.gemm_items;
  items.clear();
  ws.offsets.assign(1, 0);
  ws.gate_up_count.assign(A, 0);
  for (int s = 0; s < S; ++s) {
    for (const auto& [side, step] : {std::pair{1, step_own}, std::pair{0, step_deferred}})
      for (int m = 0; m < 2; ++m) {
        const Matrix& mat = m ? down : gate;
        const int nb = mat.slice_begin[s + 1] - mat.slice_begin[s];
        const size_t seg = items.size();
        for (int j = 0; j < A; ++j)
          if (slot_own[j] == side)
            for (int b = 0; b < nb; b += step) items.push_back({m, j, s, b, std::min(nb, b + step)});
        if (m ? tune.tail_split : tune.gate_up_tail) split_tail(seg);
        if (!m)
          for (size_t i = seg; i < items.size(); ++i) ws.gate_up_count[items[i].j] += 1;
      }
    ws.offsets.push_back(int(items.size()));
  }
  ws.plan = plan;
}

// The run's counters (pending gate/up items per expert; per down block, the experts whose y is still
// missing), the trace's records, and where the outputs are summed: out is ready inside the run once
// the own experts have all summed every block (own_blocks_left), with deferral in the run; else when
// the call ends. With no own slot at all, at once.
void MoeLayer::Forward::prepare_run() {
  const int stride = tune.padded_counters ? 64 / int(sizeof(std::atomic<int>)) : 1;
  pending = {grow(ws.pending, size_t(A) * stride), stride};
  for (int j = 0; j < A; ++j) pending[j].store(ws.gate_up_count[j], std::memory_order_relaxed);
  if (tr) {
    tr->T = T;
    tr->K = K;
    tr->A = A;
    tr->items.resize(ws.gemm_items.size());
    titems = tr->items.data();
    tr->join_ns.assign(L.pool_->threads(), 0);
    tr->slept.assign(L.pool_->threads(), 0);
    L.pool_->set_join_log(tr->join_ns.data(), tr->slept.data());
  }
  combine_in_run = tune.combine_in_run && T <= kCombineInRunTokens;
  ready_in_run = c.deferred > 0 && K_own > 0 && combine_in_run;
  if (c.deferred > 0 && K_own == 0) {
    std::memset(c.out, 0, size_t(T) * H * esize);
    out_ready();
  }
  col_left = {grow(ws.col_left, size_t(down.blocks) * stride), stride};
  col_own = {grow(ws.col_own, size_t(down.blocks) * stride), stride};
  own_blocks_left.store(down.blocks, std::memory_order_relaxed);
  if (combine_in_run)
    for (int b = 0; b < down.blocks; ++b) {
      col_left[b].store(A, std::memory_order_relaxed);
      col_own[b].store(A_own, std::memory_order_relaxed);
    }
}

// dst[t, c0:c1] = sum_k w[t, k] * y[row of (t, k), c0:c1], k0 <= k < k1 in order (deterministic):
// combine(t, c0, c1) for out (the own slots), combine_deferred for out2.
void MoeLayer::Forward::combine_slots(int t, int k0, int k1, void* dst, int c0, int c1) {
  thread_local std::vector<const float*> srcv;
  const float** src = grow(srcv, K);
  for (int k = k0; k < k1; ++k) src[k - k0] = y + size_t(pos[size_t(t) * K + k]) * ldy + c0;
  char* o = static_cast<char*>(dst) + (size_t(t) * H + c0) * esize;
  ops->combine(k1 - k0, src, c.weights + size_t(t) * K + k0, c1 - c0, o, c.x_bf16);
}

void MoeLayer::Forward::out_ready() {
  if (c.out_ready_ns || (tr && c.deferred > 0)) {
    const int64_t now = trace_now_ns();
    if (c.out_ready_ns) *c.out_ready_ns = now;
    if (tr && c.deferred > 0) tr->ready_ns = now;
  }
  if (c.out_ready) __atomic_store_n(c.out_ready, 1u, __ATOMIC_RELEASE);
}

// Expert j's h rows -> down activations (padding as in phase A).
void MoeLayer::Forward::down_acts(int j) {
  const ActKind kind = act_of(kernels_of(j), true, L.cfg_.format);
  act2.write_rows(*ops, *ops8, kind, act_begin[j], act_begin[j] + rows_read(j), false, [&](size_t r) {
    const int local = r - act_begin[j];
    const bool pad = local >= n_of(j);
    return std::make_pair(static_cast<const void*>(h + size_t(pad ? 0 : row_begin[j] + local) * ldh), pad ? 0 : I);
  });
}

// The head of each weight stream of an item (and of its scales): a kernel's own prefetches run
// a fixed distance ahead of its loads, so without this a new stream starts on demand misses.
void MoeLayer::Forward::prefetch_heads(const Matrix& mat, const Item& it) const {
  const size_t head = size_t(tune.item_prefetch);
  const PackedView v = L.view(mat, order[it.j], it.s);
  const size_t bb = block_bytes(L.cfg_.format, mat.Kp), sb = L.scale_bytes(mat, 1);
  prefetch_l2(v.w + size_t(it.b0) * bb, std::min(head, size_t(it.b1 - it.b0) * bb));
  const uint8_t* scale = v.e8m0 ? v.e8m0 : reinterpret_cast<const uint8_t*>(v.scale);
  if (scale) prefetch_l2(scale + size_t(it.b0) * sb, std::min(head, size_t(it.b1 - it.b0) * sb));
  if (v.zero) prefetch_l2(reinterpret_cast<const uint8_t*>(v.zero) + size_t(it.b0) * sb,
                          std::min(head, size_t(it.b1 - it.b0) * sb));
}

// Gate/up and down in one pool run, without a barrier between them. The gate/up item that finishes
// an expert last turns its h rows into down activations and marks it ready; a down item of an expert
// not ready yet waits for it. That never deadlocks: a worker reaches an expert's down items only after
// every gate/up item of that expert in its own group is claimed (and steals only from exhausted
// groups), and claimed gate/up items never wait (with early_start, only for x's rows, which the
// calling thread makes before it takes items or waits).
void MoeLayer::Forward::run_items() {
  if (tr) tr->items_ns = trace_now_ns();
  auto convert = [this] { convert_x(); };
  L.pool_->run(ws.offsets, [&](int i, int worker) {
    if (ws.gemm_items[i].down) down_item(i, worker);
    else gate_up_item(i, worker);
  }, early ? FnRef<void()>(convert) : FnRef<void()>());
  if (tr) {
    tr->gemm_end_ns = trace_now_ns();
    L.pool_->set_join_log(nullptr, nullptr);
  }
}

// h = silu(x Wg^T) * (x Wu^T) (or the layer's Glu, with its biases) for this item's rows of I.
void MoeLayer::Forward::gate_up_item(int i, int worker) {
  const Item it = ws.gemm_items[i];
  const int64_t t0 = titems ? trace_now_ns() : 0;
  const Kernels& kn = kernels_of(it.j);
  const Format fmt = L.cfg_.format;
  if (tune.item_prefetch) {
    prefetch_heads(gate, it);
    prefetch_heads(up, it);
  }
  int64_t waited_ns = 0;  // early_start: for x's activation rows (its weights' heads on their way)
  if (!acts_ready.load(std::memory_order_acquire)) {
    // x's rows take the calling thread a few microseconds: pause that long (~1000 pauses), then
    // yield, in case it waits for this core (more threads than cores).
    for (int spin = 0; !acts_ready.load(std::memory_order_acquire); ++spin)
      if (spin > 1024) std::this_thread::yield(); else cpu_relax();
    if (titems) waited_ns = trace_now_ns() - t0;
  }
  const ActView a = n_of(it.j) == 1 ? tok1.view(tok_kind, tok[row_begin[it.j]], 1)
                                    : act1.view(act_of(kn, false, fmt), act_begin[it.j], n_of(it.j));
  const int col0 = (gate.slice_begin[it.s] + it.b0) * kBlockRows;
  float* hrow = h + size_t(row_begin[it.j]) * ldh + col0;
  const PackedView g = L.view(gate, order[it.j], it.s), u = L.view(up, order[it.j], it.s);
  Glu expert_glu;
  const Glu* glu = L.glu_of(order[it.j], col0, expert_glu);
  if (kn.gate_up[int(fmt)]) kn.gate_up[int(fmt)](g, u, it.b0, it.b1, a, glu, hrow, int(ldh));
  else gate_up_two_gemms(gemm_of(kn, false, fmt), *ops, glu, g, u, it.b0, it.b1, a, hrow, int(ldh));
  // The last one of this expert (acq_rel: it sees every other item's h) converts h.
  // Traced: the item's end is stamped before it lets its expert's down items go.
  if (titems)
    titems[i] = {worker, 0, order[it.j], it.s, it.b0, it.b1, t0, trace_now_ns(), waited_ns, 0, !slot_own[it.j]};
  if (pending[it.j].fetch_sub(1, std::memory_order_acq_rel) == 1) {
    down_acts(it.j);
    pending[it.j].store(-1, std::memory_order_release);
    if (titems) titems[i].convert_ns = trace_now_ns() - titems[i].end_ns;
  }
}

// y = h Wd^T (+ the expert's down bias) for this item's rows of H, once expert j's down activations exist.
void MoeLayer::Forward::down_item(int i, int worker) {
  const Item it = ws.gemm_items[i];
  const int64_t t0 = titems ? trace_now_ns() : 0;
  const Kernels& kn = kernels_of(it.j);
  const Format fmt = L.cfg_.format;
  if (tune.item_prefetch) prefetch_heads(down, it);
  for (int spin = 0; pending[it.j].load(std::memory_order_acquire) != -1; ++spin)
    if (spin > 64) std::this_thread::yield(); else cpu_relax();
  const int64_t waited_ns = titems ? trace_now_ns() - t0 : 0;
  const ActView a = act2.view(act_of(kn, true, fmt), act_begin[it.j], n_of(it.j));
  const int col0 = (down.slice_begin[it.s] + it.b0) * kBlockRows;
  float* yrow = y + size_t(row_begin[it.j]) * ldy + col0;
  gemm_of(kn, true, fmt)(L.view(down, order[it.j], it.s), it.b0, it.b1, a, yrow, int(ldy));
  if (const float* bias = L.down_bias(order[it.j], col0))
    for (int t = 0; t < n_of(it.j); ++t) ops->add(yrow + size_t(t) * ldy, bias, (it.b1 - it.b0) * kBlockRows);
  if (titems)
    titems[i] = {worker, 1, order[it.j], it.s, it.b0, it.b1, t0, trace_now_ns(), waited_ns, 0, !slot_own[it.j]};
  if (!combine_in_run) return;
  combine_in_item(it);
  if (titems) titems[i].convert_ns = trace_now_ns() - titems[i].end_ns;
}

// The last expert to finish a block of output columns (acq_rel: it sees every other expert's y
// there) sums them; traced as the item's convert time. With deferral: the last own expert sums out's
// block (and the last block makes out ready), the last of all out2's.
void MoeLayer::Forward::combine_in_item(const Item& it) {
  for (int b = it.b0; b < it.b1; ++b) {
    const int gb = down.slice_begin[it.s] + b, c0 = gb * kBlockRows, c1 = std::min(H, c0 + kBlockRows);
    if (c.deferred == 0) {
      if (col_left[gb].fetch_sub(1, std::memory_order_acq_rel) == 1)
        for (int t = 0; t < T; ++t) combine(t, c0, c1);
      continue;
    }
    if (slot_own[it.j] && col_own[gb].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      for (int t = 0; t < T; ++t) combine(t, c0, c1);
      if (own_blocks_left.fetch_sub(1, std::memory_order_acq_rel) == 1) out_ready();
    }
    if (col_left[gb].fetch_sub(1, std::memory_order_acq_rel) == 1)
      for (int t = 0; t < T; ++t) combine_deferred(t, c0, c1);
  }
}

// Phase C (more tokens): the weighted sum in chunks of (token, 512 columns); then out is ready
// (unless the run or prepare_run said so already) and the trace record is handed over.
void MoeLayer::Forward::finish() {
  constexpr int kCols = 512;
  const int col_chunks = (H + kCols - 1) / kCols;
  if (!combine_in_run)
    parallel_or_inline(T * col_chunks, size_t(R) * H, [&](int i, int) {
      const int t = i / col_chunks, c0 = (i % col_chunks) * kCols;
      combine(t, c0, std::min(H, c0 + kCols));
      if (c.deferred) combine_deferred(t, c0, std::min(H, c0 + kCols));
    });
  if (!ready_in_run && !(c.deferred > 0 && K_own == 0)) out_ready();
  if (tr) {
    tr->end_ns = trace_now_ns();
    L.tracer_.finish(std::move(trace));
  }
}

void MoeLayer::forward(const MoeCall& c, int64_t call_ns) {
  if (c.T == 0) return;
  Forward(*this, c, call_ns).run();
}

void gate_up_two_gemms(GemmFn gemm, const RowOps& ops, const Glu* glu, const PackedView& gate, const PackedView& up,
                       int b0, int b1, const ActView& a, float* h, int ldh) {
  thread_local AlignedVec<float> ubuf;
  const int cols = (b1 - b0) * kBlockRows, ldu = cols + 16;  // u [n, ldu]: not a multiple of 4 KiB either
  float* u = grow(ubuf, size_t(a.n) * ldu);
  gemm(gate, b0, b1, a, h, ldh);
  gemm(up, b0, b1, a, u, ldu);
  for (int t = 0; t < a.n; ++t) apply_glu(ops, glu, h + size_t(t) * ldh, u + size_t(t) * ldu, cols, 0);
}

}  // namespace hmoe
