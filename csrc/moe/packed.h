#pragma once
// Packed expert weights and the activations the kernels read.
//
// Every weight matrix W [N, K] (N output rows) is stored in blocks of 32 output rows; a block
// holds all of K, laid out so that one 64-byte vector covers 16 rows at one K step:
//   bf16: [Kp/2][32 rows][2]      bf16 pairs: what vdpbf16ps and AMX BF16 B tiles read
//   int8: [Kp/2][32 rows][2]      int8 pairs; sign-extended to int16 for vpdpwssd
//   int4: [Kp/8][2 halves][64 B]  per half (16 rows): byte 2r+j holds k=j (low nibble) and
//                                 k=4+j (high), byte 32+2r+j holds k=2+j and k=6+j; so
//                                 masking/shifting then zero-extending gives int16 pairs
//   fp8:  [Kp/2][32 rows][2]     e4m3 code (float8_e4m3fn) pairs, int8's layout: widened to bf16
//                                 in registers they are bf16's pairs
//   mxfp4: [Kp/8][2 halves][16 rows][2] 16-bit words: word (r, j) of step p holds the e2m1 codes of
//                                 k = 8p + 2s + j in its bits 4s..4s+3 (s = 0..3); so one 64-byte load
//                                 shifted right by 4s has K pair 4p + s in every word's low nibble,
//                                 which a 32-entry table (vpermw reads 5 index bits: the 16 values
//                                 twice) turns into bf16's pairs
// Scales: int8 one fp32 per row [Np]; int4 one per (row, group) [nblocks][G][32], zero points
// likewise (absent: symmetric, zero point 8); fp8 one per (block, kFp8GroupK of K) [nblocks][ceil(Kp /
// 128)], the scale of the 128x128 block (DeepSeek-V3's weight_scale_inv) its 32 rows lie in; mxfp4 one
// e8m0 byte e per (row, kMxfp4GroupK of K) [nblocks][Kp / 32][32], the scale 2^(e - 127), as the
// checkpoint stores it (a quarter of fp32 scales' bytes: 4.25 bits a weight, not 5). Np = N rounded up
// to 32; Kp = K rounded up to 32 (bf16, int8, fp8) or K itself (int4, which needs K % group == 0;
// mxfp4, which needs K % 32 == 0).
#include <cstddef>
#include <cstdint>

// Helpers here are static: kernel files built with different -m flags must not share
// (and the linker must not pick) one ISA's copy of them.

namespace hmoe {

enum class Format : int { bf16 = 0, int8 = 1, int4 = 2, fp8 = 3, mxfp4 = 4 };
constexpr int kFormats = 5;
// amx_emulated: the AMX kernels over a portable emulation of the tile registers (AVX-512 CPUs
// without AMX), so that their tiling logic is tested where CI runs; never picked by default.
enum class Isa : int { generic = 0, avx2 = 1, avx512 = 2, amx = 3, amx_emulated = 4 };

constexpr int kBlockRows = 32;
constexpr int kInt8FlushK = 128;  // int32 partial sums go to fp32 every 128 K (no overflow)
// K per activation scale of kind i8_groups rows (two AMX-INT8 steps). A heavy-tailed row (h =
// silu(g) * u) quantized per token loses its small values; per group of 128 it keeps them.
constexpr int kActGroupK = 128;
// K per fp8 scale: a block-FP8 checkpoint's blocks are 128 x 128, and 128 rows are four 32-row blocks.
constexpr int kFp8GroupK = 128;
static inline int fp8_groups(int Kp) { return (Kp + kFp8GroupK - 1) / kFp8GroupK; }
// K per mxfp4 scale (OCP MX's block of 32 values).
constexpr int kMxfp4GroupK = 32;

static inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

static inline size_t block_bytes(Format f, int Kp) {
  switch (f) {
    case Format::bf16: return size_t(kBlockRows) * Kp * 2;
    case Format::int8: return size_t(kBlockRows) * Kp;
    case Format::int4: return size_t(kBlockRows) * Kp / 2;
    case Format::fp8: return size_t(kBlockRows) * Kp;
    case Format::mxfp4: return size_t(kBlockRows) * Kp / 2;
  }
  return 0;
}

// One expert's rows of one matrix, blocks [0, nblocks) of some slice.
struct PackedView {
  const uint8_t* w = nullptr;
  const float* scale = nullptr;  // int8: [nblocks*32]; int4: [nblocks][G][32]; fp8: [nblocks][ceil(Kp/128)]
  const float* zero = nullptr;   // int4 asymmetric: [nblocks][G][32]; else null
  const uint8_t* e8m0 = nullptr; // mxfp4: [nblocks][Kp/32][32] scale exponents
  int Kp = 0;
  int group = 0;                 // int4 group size
  // Software prefetch distances (bytes ahead of the loads) of the memory-bound kernels (AVX-512):
  // into L1 (prefetcht0) and into L2 (prefetcht1); 0: none. Timing only, never results.
  int prefetch_l1 = 4096;
  int prefetch_l2 = 16384;
};

// Activations of n tokens (one expert), n rounded up to 16 rows of zeros. Row-major kinds at
// stride ld; tile kinds (the AMX kernels') in A-tile order, written once per expert so that no
// GEMM item copies them again: 16-token tiles back to back, each [Kt / step][16 rows][64 B]
// (step: 32 K of bf16 or 64 K of int8; Kt: Kp, or kind i8's Kp rounded up to 64), so that
// tokens 16t..16t+15 at K step s are one 1 KiB tile at byte (t * Kt / step + s) * 1024.
struct ActView {
  int n = 0;
  int ld = 0;                    // row-major kinds: elements between rows (>= Kp; i8: >= Kp rounded up to 64)
  const uint16_t* bf16 = nullptr;  // kind bf16: [n][ld]; bf16_tiles: tiles
  const int16_t* q = nullptr;      // kind i16: [n][ld], x ~= q * qscale[t]
  const int8_t* q8 = nullptr;      // kinds i8, i8_groups: [n][ld], x ~= q8 * scale, zeros past K; *_tiles: tiles
  const float* qscale = nullptr;   // [n]; kind i8_groups: [n][qgroups], K group k / kActGroupK
  int qgroups = 0;                 // kind i8_groups: scales per row
  const int32_t* qsum = nullptr;   // int4: [n][Kp/group] sums of q over each group
};

// *_tiles: the same values and scales as the kind without the suffix, in A-tile order (ActView).
enum class ActKind : int {
  bf16 = 0, i16 = 1, i8 = 2, i8_groups = 3, bf16_tiles = 4, i8_tiles = 5, i8_groups_tiles = 6
};
constexpr int kActKinds = 7;
static inline bool act_tiles(ActKind k) { return k >= ActKind::bf16_tiles; }
static inline bool act_int8(ActKind k) {
  return k == ActKind::i8 || k == ActKind::i8_groups || k == ActKind::i8_tiles || k == ActKind::i8_groups_tiles;
}
static inline bool act_groups(ActKind k) { return k == ActKind::i8_groups || k == ActKind::i8_groups_tiles; }

// out[t * ldo + (b - b0) * 32 + r] = sum_k W[b*32 + r, k] * x[t, k] for blocks [b0, b1).
using GemmFn = void (*)(const PackedView& w, int b0, int b1, const ActView& a, float* out, int ldo);

// What turns an expert's gate and up sums (g, u) into h, one choice per layer (MoeLayer::set_glu,
// set_biases): each sum first gets its bias (null: none), then
//   silu:           h = silu(g) * u
//   clamped_swiglu: g = min(g, limit), u = clamp(u, -limit, limit), h = (u + 1) * g * sigmoid(alpha * g)
// (gpt-oss's experts). Layers of plain silu without biases pass no Glu at all (null): their kernels
// call RowOps::silu_mul as they would without this.
enum class GluKind : int { silu = 0, clamped_swiglu = 1 };
struct Glu {
  GluKind kind = GluKind::silu;
  float alpha = 1.f, limit = 0.f;
  const float* gate_bias = nullptr;  // from the h row's first column on (the caller offsets it)
  const float* up_bias = nullptr;
};

// The row-wise work around the GEMMs, vectorized per ISA like the GEMMs themselves (scalar
// code between AVX-512/AMX kernels is slow on Intel cores, and libm's expf far slower still).
struct RowOps {
  // dst[0:Kp] = bf16(src[0:n]), zeros in [n, Kp); src is fp32, or bf16 if src_bf16.
  void (*to_bf16)(const void* src, bool src_bf16, int n, int Kp, uint16_t* dst);
  // Per-row symmetric int16: dst[0:Kp] = round(src / s) (zeros past n), *scale = s = amax /
  // 32767; if group > 0, sums[g] = sum of dst over group g (Kp / group of them).
  void (*to_i16)(const void* src, bool src_bf16, int n, int Kp, int group, int16_t* dst, float* scale,
                 int32_t* sums);
  // g[i] = silu(g[i]) * u[i], i < n.
  void (*silu_mul)(float* g, const float* u, int n);
  // g[i] = glu(g[i] + gate_bias[col + i], u[i] + up_bias[col + i]), i < n (Glu: which one, which biases).
  void (*glu)(float* g, const float* u, int n, const Glu& glu, int col);
  // dst[0:n] = sum_k w[k] * src[k][0:n] (k in order), stored as fp32, or bf16 if dst_bf16.
  void (*combine)(int K, const float* const* src, const float* w, int n, void* dst, bool dst_bf16);
  // y[i] += b[i], i < n (an expert's down bias).
  void (*add)(float* y, const float* b, int n);
  // Symmetric int8 (kinds i8, i8_groups; only kernel sets that read them have one): dst[0:n] =
  // round(src / s) in [-127, 127], zeros in [n, Kp); one s = amax / 127 per row (group 0) or per
  // group of `group` K (scale[0:ceil(Kp / group)], the last group maybe partial).
  void (*to_i8)(const void* src, bool src_bf16, int n, int Kp, int group, int8_t* dst, float* scale) = nullptr;
  // Kernel sets that read tile kinds (ActView) only: 16 rows of `steps` x 64 bytes (row i at
  // rows + i * lds, both 64-byte aligned) -> one A tile, tile[s][i][0:64] = row i's piece s.
  void (*to_tiles)(const uint8_t* rows, size_t lds, int steps, uint8_t* tile) = nullptr;
  // Likewise: 16 rows (row i: src[i][0:n[i]], fp32 or bf16; zeros in [n[i], Kp)) -> one tile of
  // kind bf16_tiles, [Kp / 32][16 rows][32] (Kp a multiple of 32).
  void (*to_bf16_tile)(const void* const* src, bool src_bf16, const int* n, int Kp, uint16_t* tile) = nullptr;
};

struct Kernels {
  GemmFn gemm[kFormats];     // by Format
  ActKind act[kFormats];     // the activations each one reads
  RowOps ops;
  // The down projection's kernels where they differ from gate/up's (null: the same). AMX int8
  // reads x as int8 with one scale per token, but h = silu(g) * u with one per 128 K: per token,
  // h's heavy tail put the layer at 0.0297 vs fp32 (the limit is 0.03).
  GemmFn down_gemm[kFormats] = {};
  ActKind down_act[kFormats] = {};
  // h = silu(x Wg^T) * (x Wu^T) (or glu's, apply_glu) in one pass over x, where a kernel set has it
  // (null: two GEMMs and RowOps). Blocks [b0, b1) of both; h like GemmFn's out; glu's biases from
  // block b0's first column on.
  void (*gate_up[kFormats])(const PackedView& gate, const PackedView& up, int b0, int b1, const ActView& a,
                            const Glu* glu, float* h, int ldh) = {};
};

// h row [0, n) from its gate sums (in g) and up sums: silu(g) * u where glu is null (a plain layer),
// else glu's activation and biases from column col of them on.
static inline void apply_glu(const RowOps& ops, const Glu* glu, float* g, const float* u, int n, int col) {
  if (glu) ops.glu(g, u, n, *glu, col);
  else ops.silu_mul(g, u, n);
}

// h = silu(x Wg^T) * (x Wu^T) (or glu's) with two GEMMs: gate's blocks [b0, b1) into h, up's into a
// scratch row per token, then apply_glu: what Kernels::gate_up stands for where a kernel set has none,
// or where its own does not apply (moe_layer.cpp; built for baseline x86-64).
void gate_up_two_gemms(GemmFn gemm, const RowOps& ops, const Glu* glu, const PackedView& gate, const PackedView& up,
                       int b0, int b1, const ActView& a, float* h, int ldh);

static inline GemmFn gemm_of(const Kernels& k, bool down, Format f) {
  return down && k.down_gemm[int(f)] ? k.down_gemm[int(f)] : k.gemm[int(f)];
}
static inline ActKind act_of(const Kernels& k, bool down, Format f) {
  return down && k.down_gemm[int(f)] ? k.down_act[int(f)] : k.act[int(f)];
}

const Kernels& kernels_generic();
const Kernels& kernels_avx2();
const Kernels& kernels_avx512();
const Kernels& kernels_amx();
const Kernels& kernels_amx_emulated();
bool amx_request_permission();

static inline float bf16_to_f32(uint16_t v) {
  union { uint32_t u; float f; } c{uint32_t(v) << 16};
  return c.f;
}
static inline uint16_t f32_to_bf16(float f) {  // round to nearest even
  union { float f; uint32_t u; } c{f};
  if ((c.u & 0x7fffffff) > 0x7f800000) return uint16_t((c.u >> 16) | 0x40);
  return uint16_t((c.u + 0x7fff + ((c.u >> 16) & 1)) >> 16);
}

// e4m3 (float8_e4m3fn): sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities, and codes
// 0x7f / 0xff are NaN, which packing refuses. Normals are 2^(e-7) (1 + m/8), subnormals m 2^-9.
constexpr float kFp8Max = 448.f;
static inline bool e4m3_is_nan(uint8_t c) { return (c & 0x7f) == 0x7f; }
static inline float e4m3_to_f32(uint8_t c) {
  const uint32_t e = (c >> 3) & 15, m = c & 7;
  union { uint32_t u; float f; } v{(e + 120) << 23 | m << 20};
  const float a = e ? v.f : float(m) * 0.001953125f;
  return c & 0x80 ? -a : a;
}

// e2m1 (OCP MX FP4): a sign bit over 3 magnitude bits, 0, 0.5, 1, 1.5, 2, 3, 4, 6.
static inline float e2m1_to_f32(uint8_t c) {
  static const float kMagnitude[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  return c & 8 ? -kMagnitude[c & 7] : kMagnitude[c & 7];
}
// The e8m0 scales an mxfp4 layer holds where a code is nonzero: 2^-125 to 2^125, under which every e2m1 value
// is a normal bf16 (and fp32), so a kernel may fold the scale into the bf16 weight's exponent exactly. Packing
// refuses others (groups of zero codes get 127: their scale multiplies nothing).
constexpr int kE8m0Min = 2, kE8m0Max = 252;
static inline float e8m0_to_f32(uint8_t e) {  // 2^(e - 127), exact for e in 1..254
  union { uint32_t u; float f; } c{uint32_t(e) << 23};
  return c.f;
}
// Byte and bit shift of code (r, k) of an mxfp4 step (k: 0..7 within the step; r: 0..31).
static inline void mxfp4_slot(int r, int k, int* byte, int* shift) {
  const int s = k >> 1, j = k & 1;
  *byte = (r / 16) * 64 + (r % 16) * 4 + j * 2 + (s >> 1);
  *shift = (s & 1) * 4;
}

}  // namespace hmoe
