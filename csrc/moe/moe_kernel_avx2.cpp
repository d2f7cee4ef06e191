// AVX2 + FMA kernels (built with -mavx2 -mfma -mf16c -O3), for CPUs without AVX-512: the GEMMs
// written with 256-bit intrinsics over the packed layouts of packed.h, the row-wise work the
// portable code (row_ops_portable.inc) vectorized by the compiler. One core computes int4 at
// 6.6 GB/s of weights, int8 12.3, bf16 15.6 with the weights in cache: int4 is compute-bound on
// two cores, not on eight. fp8 and mxfp4 weights are widened through fp16 (F16C) to fp32.
//
// A pass covers 16 or 8 rows of a block for up to four tokens (see int4_vectors below). bf16
// pairs are widened to fp32 by shifts and summed by FMA; int8 and int4 weights are widened to
// int16 and multiplied with the int16 activations by vpmaddwd (pairs of products summed into
// int32 lanes, exact), as the AVX-512 kernels do with vpdpwssd.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "moe/packed.h"

namespace hmoe {
namespace portable_avx2 {
#include "moe/row_ops_portable.inc"
}  // namespace portable_avx2

namespace {

constexpr int kPassTokens = 4;

inline __m256i bcast32(const void* p) { return _mm256_set1_epi32(*static_cast<const int32_t*>(p)); }

// 16 bytes -> 16 words (one vector), in place order, zero- or sign-extended.
inline __m128i load16(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
inline __m256i widen_u8(const uint8_t* p) { return _mm256_cvtepu8_epi16(load16(p)); }
inline __m256i widen_s8(const int8_t* p) { return _mm256_cvtepi8_epi16(load16(p)); }

// The first pass over a block (row group 0) prefetches its K steps whole, step_bytes each, the view's
// distances ahead (PackedView::prefetch_l1 / prefetch_l2; 0: none); the later passes read their rows
// from the cache.
struct Prefetch {
  int l1, l2;
  void ahead(const void* step, int step_bytes) const {
    const char* s = static_cast<const char*>(step);
    for (int o = 0; o < step_bytes; o += 64) {
      if (l1) _mm_prefetch(s + o + l1, _MM_HINT_T0);
      if (l2) _mm_prefetch(s + o + l2, _MM_HINT_T1);
    }
  }
};

// A pass computes V vectors of 8 rows (rows 8 rg .. 8 (rg + V) - 1 of the block) for M tokens, V so
// that the accumulators (M x V), the K step's weights and the tokens' activations stay within the 16
// ymm registers: 16 rows for bf16 and int8; int4 (four weight vectors and four activation pairs per
// token at each K step) 16 rows for one token, 8 for more: with 16 rows at four tokens its
// accumulators went to the stack.
template <int M>
constexpr int int4_vectors() { return M == 1 ? 2 : 1; }

template <int M, int V>
void store_rows(const __m256 (&acc)[M][V], int rg, float* out, int ldo) {
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(out + size_t(i) * ldo + 8 * (rg + v), acc[i][v]);
}

// bf16 [Kp/2][32 rows][2]: 8 rows at one K pair are 32 bytes (lanes (row, pair)) at p * 128 + 32 g
// for row group g; the low 16 bits of a lane are k = 2p, the high ones 2p + 1: a shift and a mask
// make them fp32.
template <int M, int V>
void bf16_pass(const uint16_t* wb, int np, int rg, const uint16_t* x, int ld, float* out, int ldo, Prefetch pf) {
  const __m256i hi = _mm256_set1_epi32(int(0xFFFF0000u));
  __m256 acc[M][V];
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < V; ++v) acc[i][v] = _mm256_setzero_ps();
  for (int p = 0; p < np; ++p) {
    const uint16_t* step = wb + size_t(p) * 64;
    if (rg == 0) pf.ahead(step, 128);
    __m256 even[V], odd[V];
    for (int v = 0; v < V; ++v) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + 16 * (rg + v)));
      even[v] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      odd[v] = _mm256_castsi256_ps(_mm256_and_si256(raw, hi));
    }
    for (int i = 0; i < M; ++i) {
      const uint16_t* xi = x + size_t(i) * ld + 2 * p;
      const __m256 x0 = _mm256_set1_ps(bf16_to_f32(xi[0])), x1 = _mm256_set1_ps(bf16_to_f32(xi[1]));
      for (int v = 0; v < V; ++v) acc[i][v] = _mm256_fmadd_ps(odd[v], x1, _mm256_fmadd_ps(even[v], x0, acc[i][v]));
    }
  }
  store_rows<M, V>(acc, rg, out, ldo);
}

// int8 [Kp/2][32 rows][2]: 8 rows at one K pair are 16 bytes at p * 64 + 16 g; int32 sums go to
// fp32 every kInt8FlushK (as the other paths), then times row scale x token scale.
template <int M, int V>
void int8_pass(const int8_t* wb, int Kp, int rg, const int16_t* x, int ld, const float* xscale, const float* wscale,
               float* out, int ldo, Prefetch pf) {
  __m256 facc[M][V];
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < V; ++v) facc[i][v] = _mm256_setzero_ps();
  for (int k0 = 0; k0 < Kp; k0 += kInt8FlushK) {
    const int pend = std::min(Kp, k0 + kInt8FlushK) / 2;
    __m256i acc[M][V];
    for (int i = 0; i < M; ++i)
      for (int v = 0; v < V; ++v) acc[i][v] = _mm256_setzero_si256();
    for (int p = k0 / 2; p < pend; ++p) {
      const int8_t* step = wb + size_t(p) * 64;
      if (rg == 0) pf.ahead(step, 64);
      __m256i w[V];
      for (int v = 0; v < V; ++v) w[v] = widen_s8(step + 16 * (rg + v));
      for (int i = 0; i < M; ++i) {
        const __m256i xb = bcast32(x + size_t(i) * ld + 2 * p);
        for (int v = 0; v < V; ++v) acc[i][v] = _mm256_add_epi32(acc[i][v], _mm256_madd_epi16(w[v], xb));
      }
    }
    for (int i = 0; i < M; ++i)
      for (int v = 0; v < V; ++v) facc[i][v] = _mm256_add_ps(facc[i][v], _mm256_cvtepi32_ps(acc[i][v]));
  }
  for (int v = 0; v < V; ++v) {
    const __m256 s = _mm256_loadu_ps(wscale + 8 * (rg + v));
    for (int i = 0; i < M; ++i) facc[i][v] = _mm256_mul_ps(facc[i][v], _mm256_mul_ps(s, _mm256_set1_ps(xscale[i])));
  }
  store_rows<M, V>(facc, rg, out, ldo);
}

// int4 [Kp/8][2 halves][64 B]: half h of K step p is 64 bytes at p * 128 + 64 h; in it bytes 2r + j
// (r < 16, j < 2) hold k = j (low nibble) and 4 + j (high), bytes 32 + 2r + j hold 2 + j and 6 + j.
// Widened to words, row r's lane (words 2r, 2r + 1) is masked to the pair (k0, k1) or (k2, k3), or
// shifted to (k4, k5) or (k6, k7). Row group g is half g / 2, bytes 16 (g % 2) on. Per group: exact
// int32 sums, then scale * (sum - zero * sum(x)).
template <int M, int V>
void int4_pass(const uint8_t* wb, const float* sc, const float* zr, int G, int steps, int rg, const int16_t* x, int ld,
               const float* xscale, const int32_t* xsum, float* out, int ldo, Prefetch pf) {
  const __m256i nib = _mm256_set1_epi16(0x0F);
  __m256 facc[M][V];
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < V; ++v) facc[i][v] = _mm256_setzero_ps();
  for (int g = 0; g < G; ++g) {
    __m256i acc[M][V];
    for (int i = 0; i < M; ++i)
      for (int v = 0; v < V; ++v) acc[i][v] = _mm256_setzero_si256();
    for (int p = g * steps; p < (g + 1) * steps; ++p) {
      const uint8_t* step = wb + size_t(p) * 128;
      if (rg == 0) pf.ahead(step, 128);
      for (int v = 0; v < V; ++v) {
        const uint8_t* w = step + 64 * ((rg + v) / 2) + 16 * ((rg + v) % 2);
        const __m256i a = widen_u8(w), b = widen_u8(w + 32);
        const __m256i q01 = _mm256_and_si256(a, nib), q45 = _mm256_srli_epi16(a, 4);
        const __m256i q23 = _mm256_and_si256(b, nib), q67 = _mm256_srli_epi16(b, 4);
        for (int i = 0; i < M; ++i) {
          const int16_t* xi = x + size_t(i) * ld + 8 * p;
          auto dot = [&](__m256i q, int k) { return _mm256_madd_epi16(q, bcast32(xi + k)); };
          const __m256i s01 = _mm256_add_epi32(dot(q01, 0), dot(q23, 2));
          const __m256i s45 = _mm256_add_epi32(dot(q45, 4), dot(q67, 6));
          acc[i][v] = _mm256_add_epi32(acc[i][v], _mm256_add_epi32(s01, s45));
        }
      }
    }
    for (int v = 0; v < V; ++v) {
      const size_t si = size_t(g) * kBlockRows + 8 * (rg + v);
      const __m256 scale = _mm256_loadu_ps(sc + si);
      const __m256 z = zr ? _mm256_loadu_ps(zr + si) : _mm256_set1_ps(8.f);
      for (int i = 0; i < M; ++i) {
        const __m256 xs = _mm256_set1_ps(float(xsum[size_t(i) * G + g]));
        facc[i][v] = _mm256_fmadd_ps(_mm256_fnmadd_ps(z, xs, _mm256_cvtepi32_ps(acc[i][v])), scale, facc[i][v]);
      }
    }
  }
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < V; ++v) facc[i][v] = _mm256_mul_ps(facc[i][v], _mm256_set1_ps(xscale[i]));
  store_rows<M, V>(facc, rg, out, ldo);
}

// fp8 [Kp/2][32 rows][2]: 8 rows at one K pair are 16 bytes at p * 64 + 16 g for row group g, widened
// to words and made fp16 (the code's 7 low bits at fp16 bits 7..13 and its sign at bit 15 are 2^-8 x its
// e4m3 value, exactly, subnormals too) and fp32 by vcvtph2ps (F16C): lanes (row, k of the pair) of rows
// 0-3 and rows 4-7, multiplied by the token's (x0, x1) repeated; each row's two lanes are summed at the
// end. Each weight vector is multiplied by 2^8 x its block's scale before the FMAs: per-block sums would
// need a second set of accumulators, which the 16 ymm registers do not hold beside the tokens'.
template <int M>
void fp8_pass(const uint8_t* wb, int Kp, const float* sc, int rg, const uint16_t* x, int ld, float* out, int ldo,
              Prefetch pf) {
  const __m256i fp16_bits = _mm256_set1_epi16(int16_t(0xBF80)), odd = _mm256_set1_epi32(int(0xFFFF0000u));
  __m256 acc[M][2];
  for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int k0 = 0; k0 < Kp; k0 += kFp8GroupK) {
    const __m256 s = _mm256_set1_ps(sc[k0 / kFp8GroupK] * 256.f);
    for (int p = k0 / 2; p < std::min(Kp, k0 + kFp8GroupK) / 2; ++p) {
      const uint8_t* step = wb + size_t(p) * 64;
      if (rg == 0) pf.ahead(step, 64);
      const __m256i c = _mm256_cvtepi8_epi16(load16(step + 16 * rg));
      const __m256i h = _mm256_and_si256(_mm256_slli_epi16(c, 7), fp16_bits);
      const __m256 w0 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), s);
      const __m256 w1 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), s);
      for (int i = 0; i < M; ++i) {
        const __m256i xp = bcast32(x + size_t(i) * ld + 2 * p);  // bf16 x0 low, x1 high
        const __m256i pair = _mm256_blend_epi32(_mm256_slli_epi32(xp, 16), _mm256_and_si256(xp, odd), 0xAA);
        const __m256 xk = _mm256_castsi256_ps(pair);
        acc[i][0] = _mm256_fmadd_ps(w0, xk, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(w1, xk, acc[i][1]);
      }
    }
  }
  // hadd: rows 0 1 4 5 | 2 3 6 7; the 64-bit permute puts them in order.
  for (int i = 0; i < M; ++i) {
    const __m256d rows = _mm256_castps_pd(_mm256_hadd_ps(acc[i][0], acc[i][1]));
    _mm256_storeu_ps(out + size_t(i) * ldo + 8 * rg, _mm256_castpd_ps(_mm256_permute4x64_pd(rows, 0xD8)));
  }
}

// mxfp4 [Kp/8][2 halves][16 rows][2] words: row group g's words (its 8 rows, j = 0 and 1) are 32 bytes at
// p * 128 + 32 g of step p. Each code becomes an fp16 whose high byte comes from a 16-byte table (vpshufb: the
// 16 e2m1 values are fp16 values with a zero low byte) and its low byte is 0; vcvtph2ps makes it fp32, lanes
// (row, j) of rows 0-3 and rows 4-7, times the row's scale 2^(e - 127) (exact: packing keeps the scales of
// nonzero codes within 2^-125..2^125, where every product is a normal fp32), then FMAs with the token's
// (x0, x1) repeated; each row's two lanes are summed at the end (as fp8_pass).
template <int M>
void mxfp4_pass(const uint8_t* wb, const uint8_t* ex, int G, int rg, const uint16_t* x, int ld, float* out, int ldo,
                Prefetch pf) {
  const __m256i fp16_high = _mm256_setr_epi8(
      0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46, int8_t(0x80), int8_t(0xB8), int8_t(0xBC), int8_t(0xBE),
      int8_t(0xC0), int8_t(0xC2), int8_t(0xC4), int8_t(0xC6), 0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46,
      int8_t(0x80), int8_t(0xB8), int8_t(0xBC), int8_t(0xBE), int8_t(0xC0), int8_t(0xC2), int8_t(0xC4), int8_t(0xC6));
  const __m256i low_nibbles = _mm256_set1_epi16(0x0F0F), high_byte = _mm256_set1_epi16(int16_t(0xFF00));
  const __m256i odd = _mm256_set1_epi32(int(0xFFFF0000u));
  const __m256i rows_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  const __m256i rows_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
  __m256 acc[M][2];
  for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int g = 0; g < G; ++g) {
    // The 8 rows' scales, each in its two lanes (rows 0-3, rows 4-7).
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(ex + g * kBlockRows + 8 * rg));
    const __m256i e = _mm256_cvtepu8_epi32(bytes);
    const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
    const __m256 s0 = _mm256_permutevar8x32_ps(scale, rows_lo), s1 = _mm256_permutevar8x32_ps(scale, rows_hi);
    for (int p = 4 * g; p < 4 * g + 4; ++p) {
      const uint8_t* step = wb + size_t(p) * 128;
      if (rg == 0) pf.ahead(step, 128);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + 32 * rg));
      // t02: each word's nibbles 0 and 2 as fp16 high bytes (low byte, high byte); t13: nibbles 1 and 3.
      const __m256i t02 = _mm256_shuffle_epi8(fp16_high, _mm256_and_si256(v, low_nibbles));
      const __m256i t13 = _mm256_shuffle_epi8(fp16_high, _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles));
      const __m256i h[4] = {_mm256_slli_epi16(t02, 8), _mm256_slli_epi16(t13, 8), _mm256_and_si256(t02, high_byte),
                            _mm256_and_si256(t13, high_byte)};
      for (int s = 0; s < 4; ++s) {  // K pair 4p + s
        const __m256 w0 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h[s])), s0);
        const __m256 w1 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h[s], 1)), s1);
        for (int i = 0; i < M; ++i) {
          const __m256i xp = bcast32(x + size_t(i) * ld + 8 * p + 2 * s);  // bf16 x0 low, x1 high
          const __m256 xk = _mm256_castsi256_ps(_mm256_blend_epi32(_mm256_slli_epi32(xp, 16), _mm256_and_si256(xp, odd),
                                                                   0xAA));
          acc[i][0] = _mm256_fmadd_ps(w0, xk, acc[i][0]);
          acc[i][1] = _mm256_fmadd_ps(w1, xk, acc[i][1]);
        }
      }
    }
  }
  for (int i = 0; i < M; ++i) {
    const __m256d rows = _mm256_castps_pd(_mm256_hadd_ps(acc[i][0], acc[i][1]));
    _mm256_storeu_ps(out + size_t(i) * ldo + 8 * rg, _mm256_castpd_ps(_mm256_permute4x64_pd(rows, 0xD8)));
  }
}

// Each GEMM: per block, per group of up to kPassTokens tokens, the passes over its row groups; the
// pass functions are instantiated per token count so that their accumulator arrays live in registers.
template <class Pass>
void each_pass(int n, Pass pass) {
  for (int t0 = 0; t0 < n; t0 += kPassTokens) {
    switch (std::min(kPassTokens, n - t0)) {
      case 1: pass(t0, std::integral_constant<int, 1>{}); break;
      case 2: pass(t0, std::integral_constant<int, 2>{}); break;
      case 3: pass(t0, std::integral_constant<int, 3>{}); break;
      default: pass(t0, std::integral_constant<int, 4>{}); break;
    }
  }
}

void gemm_bf16(const PackedView& w, int b0, int b1, const ActView& a, float* out, int ldo) {
  const Prefetch pf{w.prefetch_l1, w.prefetch_l2};
  const int np = w.Kp / 2;
  for (int b = b0; b < b1; ++b) {
    const uint16_t* wb = reinterpret_cast<const uint16_t*>(w.w) + size_t(b) * np * 64;
    float* o = out + size_t(b - b0) * kBlockRows;
    each_pass(a.n, [&](int t0, auto m) {
      constexpr int M = decltype(m)::value;
      for (int rg = 0; rg < 4; rg += 2)
        bf16_pass<M, 2>(wb, np, rg, a.bf16 + size_t(t0) * a.ld, a.ld, o + size_t(t0) * ldo, ldo, pf);
    });
  }
}

void gemm_int8(const PackedView& w, int b0, int b1, const ActView& a, float* out, int ldo) {
  const Prefetch pf{w.prefetch_l1, w.prefetch_l2};
  for (int b = b0; b < b1; ++b) {
    const int8_t* wb = reinterpret_cast<const int8_t*>(w.w) + size_t(b) * (w.Kp / 2) * 64;
    float* o = out + size_t(b - b0) * kBlockRows;
    each_pass(a.n, [&](int t0, auto m) {
      constexpr int M = decltype(m)::value;
      for (int rg = 0; rg < 4; rg += 2)
        int8_pass<M, 2>(wb, w.Kp, rg, a.q + size_t(t0) * a.ld, a.ld, a.qscale + t0, w.scale + size_t(b) * kBlockRows,
                        o + size_t(t0) * ldo, ldo, pf);
    });
  }
}

void gemm_int4(const PackedView& w, int b0, int b1, const ActView& a, float* out, int ldo) {
  const Prefetch pf{w.prefetch_l1, w.prefetch_l2};
  const int G = w.Kp / w.group, steps = w.group / 8;
  for (int b = b0; b < b1; ++b) {
    const uint8_t* wb = w.w + size_t(b) * (w.Kp / 8) * 128;
    const size_t sbase = size_t(b) * G * kBlockRows;
    float* o = out + size_t(b - b0) * kBlockRows;
    each_pass(a.n, [&](int t0, auto m) {
      constexpr int M = decltype(m)::value, V = int4_vectors<M>();
      for (int rg = 0; rg < 4; rg += V)
        int4_pass<M, V>(wb, w.scale + sbase, w.zero ? w.zero + sbase : nullptr, G, steps, rg, a.q + size_t(t0) * a.ld,
                        a.ld, a.qscale + t0, a.qsum + size_t(t0) * G, o + size_t(t0) * ldo, ldo, pf);
    });
  }
}

void gemm_fp8(const PackedView& w, int b0, int b1, const ActView& a, float* out, int ldo) {
  const Prefetch pf{w.prefetch_l1, w.prefetch_l2};
  const int G = fp8_groups(w.Kp);
  for (int b = b0; b < b1; ++b) {
    const uint8_t* wb = w.w + size_t(b) * w.Kp * kBlockRows;
    float* o = out + size_t(b - b0) * kBlockRows;
    each_pass(a.n, [&](int t0, auto m) {
      constexpr int M = decltype(m)::value;
      for (int rg = 0; rg < 4; ++rg)
        fp8_pass<M>(wb, w.Kp, w.scale + size_t(b) * G, rg, a.bf16 + size_t(t0) * a.ld, a.ld, o + size_t(t0) * ldo, ldo,
                    pf);
    });
  }
}

void gemm_mxfp4(const PackedView& w, int b0, int b1, const ActView& a, float* out, int ldo) {
  const Prefetch pf{w.prefetch_l1, w.prefetch_l2};
  const int G = w.Kp / kMxfp4GroupK;
  for (int b = b0; b < b1; ++b) {
    const uint8_t* wb = w.w + size_t(b) * block_bytes(Format::mxfp4, w.Kp);
    const uint8_t* ex = w.e8m0 + size_t(b) * G * kBlockRows;
    float* o = out + size_t(b - b0) * kBlockRows;
    each_pass(a.n, [&](int t0, auto m) {
      constexpr int M = decltype(m)::value;
      for (int rg = 0; rg < 4; ++rg)
        mxfp4_pass<M>(wb, ex, G, rg, a.bf16 + size_t(t0) * a.ld, a.ld, o + size_t(t0) * ldo, ldo, pf);
    });
  }
}

}  // namespace

const Kernels& kernels_avx2() {
  static const Kernels k{{gemm_bf16, gemm_int8, gemm_int4, gemm_fp8, gemm_mxfp4},
                         {ActKind::bf16, ActKind::i16, ActKind::i16, ActKind::bf16, ActKind::bf16},
                         portable_avx2::kRowOps};
  return k;
}

}  // namespace hmoe
