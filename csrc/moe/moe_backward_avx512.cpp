// AVX-512 transposed products (backward_kernels.h; built with -mavx512f/bw/vl/dq/bf16 -O3), also the AMX
// layers' (the backward has no AMX kernels): bf16 dot products (vdpbf16ps) whose pairs run along W's rows.
//
// The packed layouts pair two K of one row ([Kp/2][32 rows][2], or their int4/mxfp4 equivalents); here a lane is
// one column k and its pair two consecutive rows n, n+1. A segment of up to kSegBlocks blocks is rearranged so once
// per call, for the call's kChunkK columns: each format's K pairs widened to bf16 pairs (the quantized formats
// dequantized, their scales and zero points applied, then rounded to bf16; bf16 weights as they are), then an
// 8 x 8 transpose of 64-bit row pairs and a word shuffle give, per row pair, kChunkK lanes of (W[n, k], W[n+1, k]).
// Every vector's outputs then take one vdpbf16ps per 16 columns per row pair, the pair (v[n], v[n+1]) broadcast:
// its bf16 row as it is. The rearranged segment (16 KiB) stays in L1 across the vectors.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "moe/backward_kernels.h"
#include "moe/fp8_avx512.h"
#include "moe/mxfp4_avx512.h"

namespace hmoe {
namespace {

constexpr int kSegBlocks = 8;
constexpr int kPassVectors = 8;  // 16 accumulators
constexpr int kPairWords = 2 * kChunkK;  // a row pair's words in a rearranged segment

inline __m512i bcast32(const void* p) { return _mm512_set1_epi32(*static_cast<const int32_t*>(p)); }

// 16 lanes' (even, odd) fp32 values -> their bf16 pairs (round to nearest even), lane r = (even[r], odd[r]).
inline __m512i bf16_pairs(__m512 even, __m512 odd) {
  const __m512i e = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(even));
  const __m512i o = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(odd));
  return _mm512_or_si512(e, _mm512_slli_epi32(o, 16));
}

// (v[r] low word, high word) of 16 lanes of int32 holding two values each, as fp32 of the low and high halves.
inline __m512 low_i16(__m512i v) { return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 16)); }
inline __m512 high_i16(__m512i v) { return _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 16)); }
inline __m512 low_bf16(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline __m512 high_bf16(__m512i v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xFFFF0000u))));
}

// HalfPairs<F>(w, b, k0, h)(q): the bf16 pairs of K pair q (k = 2q, 2q + 1; q within k0's chunk) of rows
// 16h..16h+15 of block b: lane r = (W[16h + r, 2q], W[16h + r, 2q + 1]), the values unpack_blocks gives rounded
// to bf16 (pack.cpp: the same fp32 operations before the rounding).
template <Format F>
struct HalfPairs;

template <>
struct HalfPairs<Format::bf16> {
  const uint16_t* wb;
  HalfPairs(const PackedView& w, int b, int, int h)
      : wb(reinterpret_cast<const uint16_t*>(w.w) + size_t(b) * w.Kp * kBlockRows + 32 * h) {}
  __m512i operator()(int q) const { return _mm512_loadu_si512(wb + size_t(q) * 64); }
};

template <>
struct HalfPairs<Format::int8> {
  const int8_t* wb;
  __m512 scale;  // the rows' scales
  HalfPairs(const PackedView& w, int b, int, int h)
      : wb(reinterpret_cast<const int8_t*>(w.w) + size_t(b) * w.Kp * kBlockRows + 32 * h),
        scale(_mm512_loadu_ps(w.scale + size_t(b) * kBlockRows + 16 * h)) {}
  __m512i operator()(int q) const {
    const __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + size_t(q) * 64)));
    return bf16_pairs(_mm512_mul_ps(low_i16(v), scale), _mm512_mul_ps(high_i16(v), scale));
  }
};

template <>
struct HalfPairs<Format::fp8> {
  const uint8_t* wb;
  __m512 scale;  // the 128 x 128 block's
  HalfPairs(const PackedView& w, int b, int k0, int h)
      : wb(w.w + size_t(b) * w.Kp * kBlockRows + 32 * h),
        scale(_mm512_set1_ps(w.scale[size_t(b) * fp8_groups(w.Kp) + k0 / kFp8GroupK])) {}
  __m512i operator()(int q) const {
    const __m512i v = fp8_bf16(wb + size_t(q) * 64);
    return bf16_pairs(_mm512_mul_ps(low_bf16(v), scale), _mm512_mul_ps(high_bf16(v), scale));
  }
};

// int4 [Kp/8][2 halves][64 B] (packed.h): K pair s of a step (k = 2s, 2s + 1) is the low (s < 2) or high nibbles
// of the half's first (s even) or second 32 bytes, byte 2r + j holding row r's k = 2s + j.
template <>
struct HalfPairs<Format::int4> {
  const uint8_t* wb;
  __m512 scale, zero;  // the rows' of the chunk's group
  HalfPairs(const PackedView& w, int b, int k0, int h) : wb(w.w + size_t(b) * (w.Kp / 8) * 128 + 64 * h) {
    const size_t at = (size_t(b) * (w.Kp / w.group) + k0 / w.group) * kBlockRows + 16 * h;
    scale = _mm512_loadu_ps(w.scale + at);
    zero = w.zero ? _mm512_loadu_ps(w.zero + at) : _mm512_set1_ps(8.f);
  }
  __m512i operator()(int q) const {
    const int s = q % 4;
    __m512i v = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + size_t(q / 4) * 128 + (s & 1) * 32)));
    if (s >= 2) v = _mm512_srli_epi16(v, 4);
    v = _mm512_and_si512(v, _mm512_set1_epi32(0x000F000F));
    const __m512 even = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF)));
    const __m512 odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 16));
    return bf16_pairs(_mm512_mul_ps(_mm512_sub_ps(even, zero), scale), _mm512_mul_ps(_mm512_sub_ps(odd, zero), scale));
  }
};

template <>
struct HalfPairs<Format::mxfp4> {
  const uint8_t* wb;
  __m512i table;
  __m512 scale;  // the rows' of the chunk's 32 K
  HalfPairs(const PackedView& w, int b, int k0, int h)
      : wb(w.w + size_t(b) * block_bytes(Format::mxfp4, w.Kp) + 64 * h), table(e2m1_bf16_table()),
        scale(e8m0_ps(w.e8m0 + (size_t(b) * (w.Kp / kMxfp4GroupK) + k0 / kMxfp4GroupK) * kBlockRows + 16 * h)) {}
  __m512i operator()(int q) const {
    const __m512i words = _mm512_loadu_si512(wb + size_t(q / 4) * 128);
    __m512i v;
    switch (q % 4) {
      case 0: v = mxfp4_pair_bf16<0>(words, table); break;
      case 1: v = mxfp4_pair_bf16<1>(words, table); break;
      case 2: v = mxfp4_pair_bf16<2>(words, table); break;
      default: v = mxfp4_pair_bf16<3>(words, table); break;
    }
    return bf16_pairs(_mm512_mul_ps(low_bf16(v), scale), _mm512_mul_ps(high_bf16(v), scale));
  }
};

// p[q] (8 K pairs of 16 rows, lane r = (W[r, 2q], W[r, 2q + 1])) -> p[c] for the row pairs c (rows 2c, 2c + 1):
// lane 2q + j = (W[2c, 2q + j], W[2c + 1, 2q + j]). A 64-bit element (c) of p[q] holds rows 2c, 2c + 1 at pair q,
// so an 8 x 8 transpose of them, then the words of each reordered (0, 2, 1, 3).
inline void rows_to_columns(__m512i p[8]) {
  __m512i a[8], b[8];
  for (int i = 0; i < 4; ++i) {  // a[2i]: even elements of p[2i], p[2i+1] interleaved; a[2i+1]: odd ones
    a[2 * i] = _mm512_unpacklo_epi64(p[2 * i], p[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi64(p[2 * i], p[2 * i + 1]);
  }
  const __m512i lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
  for (int g = 0; g < 2; ++g)  // b[4g + 2m + e]: elements (2m + e, 2m + e + 4) of p[4g..4g+3]
    for (int e = 0; e < 2; ++e) {
      b[4 * g + e] = _mm512_permutex2var_epi64(a[4 * g + e], lo, a[4 * g + 2 + e]);
      b[4 * g + 2 + e] = _mm512_permutex2var_epi64(a[4 * g + e], hi, a[4 * g + 2 + e]);
    }
  // So b[c] holds elements c and c + 4 of p[0..3] in its 128-bit halves 0-1 and 2-3, b[4 + c] those of p[4..7].
  const __m512i words = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15));
  for (int c = 0; c < 4; ++c) {
    p[c] = _mm512_shuffle_epi8(_mm512_shuffle_i64x2(b[c], b[4 + c], 0x44), words);
    p[c + 4] = _mm512_shuffle_epi8(_mm512_shuffle_i64x2(b[c], b[4 + c], 0xEE), words);
  }
}

// seg[rp * kPairWords + 2 kk + e] = W[row 2 rp + e of blocks [b0, b0 + nb), k0 + kk], kk < kChunkK.
template <Format F>
void rearrange(const PackedView& w, int b0, int nb, int k0, uint16_t* seg) {
  for (int b = b0; b < b0 + nb; ++b)
    for (int h = 0; h < 2; ++h) {
      const HalfPairs<F> pairs(w, b, k0, h);
      for (int kh = 0; kh < kChunkK / 16; ++kh) {
        __m512i p[8];
        for (int i = 0; i < 8; ++i) p[i] = pairs(k0 / 2 + 8 * kh + i);
        rows_to_columns(p);
        for (int c = 0; c < 8; ++c)
          _mm512_store_si512(seg + size_t((b - b0) * 16 + 8 * h + c) * kPairWords + 32 * kh, p[c]);
      }
    }
}

// Few vectors: each output vector sums into C accumulators, one per row pair of C in a row; with one chain a
// 1-vector pass waits on the dot product's latency each row pair.
template <int M>
constexpr int chains() { return M == 1 ? 4 : M == 2 ? 2 : 1; }

// out[i][0:32] += sum over the segment's row pairs rp of v[i][2 rp], v[i][2 rp + 1] times their rows; pairs a
// multiple of 16 (whole blocks), so of every C.
template <int M>
void segment_pass(const uint16_t* seg, int pairs, const uint16_t* const* v, float* const* out) {
  constexpr int C = chains<M>();
  __m512 acc[M][2][C];
  _Pragma("GCC unroll 8")
  for (int i = 0; i < M; ++i)
    _Pragma("GCC unroll 2")
    for (int h = 0; h < 2; ++h) {
      acc[i][h][0] = _mm512_loadu_ps(out[i] + 16 * h);
      _Pragma("GCC unroll 4")
      for (int c = 1; c < C; ++c) acc[i][h][c] = _mm512_setzero_ps();
    }
  for (int rp0 = 0; rp0 < pairs; rp0 += C) {
    _Pragma("GCC unroll 4")
    for (int c = 0; c < C; ++c) {
      const int rp = rp0 + c;
      const __m512bh w0 = (__m512bh)_mm512_load_si512(seg + size_t(rp) * kPairWords);
      const __m512bh w1 = (__m512bh)_mm512_load_si512(seg + size_t(rp) * kPairWords + 32);
      _Pragma("GCC unroll 8")
      for (int i = 0; i < M; ++i) {
        const __m512bh vb = (__m512bh)bcast32(v[i] + 2 * rp);
        acc[i][0][c] = _mm512_dpbf16_ps(acc[i][0][c], w0, vb);
        acc[i][1][c] = _mm512_dpbf16_ps(acc[i][1][c], w1, vb);
      }
    }
  }
  _Pragma("GCC unroll 8")
  for (int i = 0; i < M; ++i)
    _Pragma("GCC unroll 2")
    for (int h = 0; h < 2; ++h) {
      __m512 s = acc[i][h][0];
      _Pragma("GCC unroll 4")
      for (int c = 1; c < C; ++c) s = _mm512_add_ps(s, acc[i][h][c]);
      _mm512_storeu_ps(out[i] + 16 * h, s);
    }
}

template <Format F>
void gemm_t(const PackedView& w, int nblocks, int k0, const TRows& v, const TOut& out, bool accumulate) {
  static_assert(kChunkK == 32, "segment_pass covers 32 columns");
  if (!accumulate)
    for (int i = 0; i < v.n; ++i) std::memset(trow(out, i), 0, kChunkK * sizeof(float));
  if (v.n == 0) return;
  alignas(64) uint16_t seg[kSegBlocks * 16 * kPairWords];
  for (int b0 = 0; b0 < nblocks; b0 += kSegBlocks) {
    const int nb = std::min(kSegBlocks, nblocks - b0);
    rearrange<F>(w, b0, nb, k0, seg);
    for (int t0 = 0; t0 < v.n; t0 += kPassVectors) {
      const int m = std::min(kPassVectors, v.n - t0);
      const uint16_t* vr[kPassVectors];
      float* o[kPassVectors];
      pass_rows(v, out, t0, m, b0 * kBlockRows, vr, o);
      const int pairs = nb * 16;
      switch (m) {
        case 1: segment_pass<1>(seg, pairs, vr, o); break;
        case 2: segment_pass<2>(seg, pairs, vr, o); break;
        case 3: segment_pass<3>(seg, pairs, vr, o); break;
        case 4: segment_pass<4>(seg, pairs, vr, o); break;
        case 5: segment_pass<5>(seg, pairs, vr, o); break;
        case 6: segment_pass<6>(seg, pairs, vr, o); break;
        case 7: segment_pass<7>(seg, pairs, vr, o); break;
        default: segment_pass<8>(seg, pairs, vr, o); break;
      }
    }
  }
}

}  // namespace

const BackwardKernels& backward_kernels_avx512() {
  static const BackwardKernels k{{gemm_t<Format::bf16>, gemm_t<Format::int8>, gemm_t<Format::int4>,
                                  gemm_t<Format::fp8>, gemm_t<Format::mxfp4>},
                                 true};
  return k;
}

}  // namespace hmoe
