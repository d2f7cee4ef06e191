// AVX2 + FMA kernels (built with -mavx2 -mfma -mf16c -O3), for CPUs without AVX-512: the GEMMs
// written with 256-bit intrinsics over the packed layouts of packed.h, the row-wise work the
// portable code (row_ops_portable.inc) vectorized by the compiler. Before these GEMMs the AVX2 path
// was the portable code built with -mavx2 at the module's -Os: on the 2-core AVX2 dev box (AMD
// EPYC, session 8; `benchmarks/moe_layer.py --shape qwen3-30b-a3b --experts 32 --tokens 1,4
// --threads 2 --isa avx2 --gap-us 100 --layers 4`), a one-token call took int4 41.97 -> 1.95 ms,
// int8 53.70 -> 2.98, bf16 42.17 -> 5.65 (2-8% -> 46-59% of the probe's 22.3 GB/s). One core
// computes int4 at 6.6 GB/s of weights, int8 12.3, bf16 15.6 with the weights in cache
// (decode_kernel_rate --isa avx2): int4 is compute-bound on two cores, not on eight.
//
// A pass covers one half block (16 rows: two 8-lane vectors) for up to M tokens, so that its
// accumulators (2 per token) and the weights of a K step fit the 16 ymm registers; the other half
// is a second pass over the block. bf16 pairs are widened to fp32 by shifts and summed by FMA;
// int8 and int4 weights are widened to int16 and multiplied with the int16 activations by vpmaddwd
// (pairs of products summed into int32 lanes, exact), as the AVX-512 kernels do with vpdpwssd.
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
inline __m256i widen_u8(const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256i widen_s8(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// The first pass over a block (h = 0) prefetches both halves of its K steps, step_bytes apart, the view's
// distances ahead (PackedView::prefetch_l1 / prefetch_l2; 0: none); the second pass then reads its half
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

inline void store_half(const __m256 (&acc)[2], float* out) {
  _mm256_storeu_ps(out, acc[0]);
  _mm256_storeu_ps(out + 8, acc[1]);
}

// bf16 [Kp/2][32 rows][2]: half h's 16 rows at one K pair are 64 bytes at p * 128 + h * 64, two
// vectors of 8 (row, pair) lanes; the low 16 bits of a lane are k = 2p, the high ones 2p + 1.
template <int M>
void bf16_half(const uint16_t* wb, int np, int h, const uint16_t* x, int ld, float* out, int ldo, Prefetch pf) {
  const __m256i hi = _mm256_set1_epi32(int(0xFFFF0000u));
  __m256 acc[M][2];
  for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const uint16_t* w = wb + h * 32;
  for (int p = 0; p < np; ++p, w += 64) {
    if (h == 0) pf.ahead(w, 128);
    __m256 even[2], odd[2];
    for (int v = 0; v < 2; ++v) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * v));
      even[v] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      odd[v] = _mm256_castsi256_ps(_mm256_and_si256(raw, hi));
    }
    for (int i = 0; i < M; ++i) {
      const uint16_t* xi = x + size_t(i) * ld + 2 * p;
      const __m256 x0 = _mm256_set1_ps(bf16_to_f32(xi[0])), x1 = _mm256_set1_ps(bf16_to_f32(xi[1]));
      for (int v = 0; v < 2; ++v) acc[i][v] = _mm256_fmadd_ps(odd[v], x1, _mm256_fmadd_ps(even[v], x0, acc[i][v]));
    }
  }
  for (int i = 0; i < M; ++i) store_half(acc[i], out + size_t(i) * ldo + h * 16);
}

// int8 [Kp/2][32 rows][2]: half h's 16 rows at one K pair are 32 bytes at p * 64 + h * 32; int32
// sums go to fp32 every kInt8FlushK (as the other paths), then times row scale x token scale.
template <int M>
void int8_half(const int8_t* wb, int Kp, int h, const int16_t* x, int ld, const float* xscale, const float* wscale,
               float* out, int ldo, Prefetch pf) {
  __m256 facc[M][2];
  for (int i = 0; i < M; ++i) facc[i][0] = facc[i][1] = _mm256_setzero_ps();
  for (int k0 = 0; k0 < Kp; k0 += kInt8FlushK) {
    const int pend = std::min(Kp, k0 + kInt8FlushK) / 2;
    __m256i acc[M][2];
    for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
    for (int p = k0 / 2; p < pend; ++p) {
      const int8_t* w = wb + size_t(p) * 64 + h * 32;
      if (h == 0) pf.ahead(w, 64);
      const __m256i w0 = widen_s8(w), w1 = widen_s8(w + 16);
      for (int i = 0; i < M; ++i) {
        const __m256i xb = bcast32(x + size_t(i) * ld + 2 * p);
        acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(w0, xb));
        acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(w1, xb));
      }
    }
    for (int i = 0; i < M; ++i)
      for (int v = 0; v < 2; ++v) facc[i][v] = _mm256_add_ps(facc[i][v], _mm256_cvtepi32_ps(acc[i][v]));
  }
  const __m256 s0 = _mm256_loadu_ps(wscale + h * 16), s1 = _mm256_loadu_ps(wscale + h * 16 + 8);
  for (int i = 0; i < M; ++i) {
    const __m256 xs = _mm256_set1_ps(xscale[i]);
    facc[i][0] = _mm256_mul_ps(facc[i][0], _mm256_mul_ps(s0, xs));
    facc[i][1] = _mm256_mul_ps(facc[i][1], _mm256_mul_ps(s1, xs));
    store_half(facc[i], out + size_t(i) * ldo + h * 16);
  }
}

// int4 [Kp/8][2 halves][64 B]: half h of K step p is 64 bytes at p * 128 + h * 64. Bytes 2r + j
// (r < 16, j < 2) hold k = j (low nibble) and 4 + j (high), bytes 32 + 2r + j hold 2 + j and 6 + j:
// widened to words, row r's lane (words 2r, 2r + 1) is masked to the pair (k0, k1) or (k2, k3), or
// shifted to (k4, k5) or (k6, k7). Per group: exact int32 sums, then scale * (sum - zero * sum(x)).
template <int M>
void int4_half(const uint8_t* wb, const float* sc, const float* zr, int G, int steps, int h, const int16_t* x, int ld,
               const float* xscale, const int32_t* xsum, float* out, int ldo, Prefetch pf) {
  const __m256i nib = _mm256_set1_epi16(0x0F);
  __m256 facc[M][2];
  for (int i = 0; i < M; ++i) facc[i][0] = facc[i][1] = _mm256_setzero_ps();
  for (int g = 0; g < G; ++g) {
    __m256i acc[M][2];
    for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
    for (int p = g * steps; p < (g + 1) * steps; ++p) {
      const uint8_t* w = wb + size_t(p) * 128 + h * 64;
      if (h == 0) pf.ahead(w, 128);
      for (int v = 0; v < 2; ++v) {  // rows 8v .. 8v + 7 of the half
        const __m256i a = widen_u8(w + 16 * v), b = widen_u8(w + 32 + 16 * v);
        const __m256i q01 = _mm256_and_si256(a, nib), q45 = _mm256_srli_epi16(a, 4);
        const __m256i q23 = _mm256_and_si256(b, nib), q67 = _mm256_srli_epi16(b, 4);
        for (int i = 0; i < M; ++i) {
          const int16_t* xi = x + size_t(i) * ld + 8 * p;
          const __m256i s01 = _mm256_add_epi32(_mm256_madd_epi16(q01, bcast32(xi)), _mm256_madd_epi16(q23, bcast32(xi + 2)));
          const __m256i s45 = _mm256_add_epi32(_mm256_madd_epi16(q45, bcast32(xi + 4)), _mm256_madd_epi16(q67, bcast32(xi + 6)));
          acc[i][v] = _mm256_add_epi32(acc[i][v], _mm256_add_epi32(s01, s45));
        }
      }
    }
    const size_t si = size_t(g) * kBlockRows + h * 16;
    for (int v = 0; v < 2; ++v) {
      const __m256 scale = _mm256_loadu_ps(sc + si + 8 * v);
      const __m256 z = zr ? _mm256_loadu_ps(zr + si + 8 * v) : _mm256_set1_ps(8.f);
      for (int i = 0; i < M; ++i) {
        const __m256 xs = _mm256_set1_ps(float(xsum[size_t(i) * G + g]));
        facc[i][v] = _mm256_fmadd_ps(_mm256_fnmadd_ps(z, xs, _mm256_cvtepi32_ps(acc[i][v])), scale, facc[i][v]);
      }
    }
  }
  for (int i = 0; i < M; ++i) {
    const __m256 xs = _mm256_set1_ps(xscale[i]);
    facc[i][0] = _mm256_mul_ps(facc[i][0], xs);
    facc[i][1] = _mm256_mul_ps(facc[i][1], xs);
    store_half(facc[i], out + size_t(i) * ldo + h * 16);
  }
}

// Each GEMM: per block, per group of up to kPassTokens tokens, both halves; the pass functions are
// instantiated per token count so that their accumulator arrays live in registers.
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
      for (int h = 0; h < 2; ++h)
        bf16_half<decltype(m)::value>(wb, np, h, a.bf16 + size_t(t0) * a.ld, a.ld, o + size_t(t0) * ldo, ldo, pf);
    });
  }
}

void gemm_int8(const PackedView& w, int b0, int b1, const ActView& a, float* out, int ldo) {
  const Prefetch pf{w.prefetch_l1, w.prefetch_l2};
  for (int b = b0; b < b1; ++b) {
    const int8_t* wb = reinterpret_cast<const int8_t*>(w.w) + size_t(b) * (w.Kp / 2) * 64;
    float* o = out + size_t(b - b0) * kBlockRows;
    each_pass(a.n, [&](int t0, auto m) {
      for (int h = 0; h < 2; ++h)
        int8_half<decltype(m)::value>(wb, w.Kp, h, a.q + size_t(t0) * a.ld, a.ld, a.qscale + t0,
                                      w.scale + size_t(b) * kBlockRows, o + size_t(t0) * ldo, ldo, pf);
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
      for (int h = 0; h < 2; ++h)
        int4_half<decltype(m)::value>(wb, w.scale + sbase, w.zero ? w.zero + sbase : nullptr, G, steps, h,
                                      a.q + size_t(t0) * a.ld, a.ld, a.qscale + t0, a.qsum + size_t(t0) * G,
                                      o + size_t(t0) * ldo, ldo, pf);
    });
  }
}

}  // namespace

const Kernels& kernels_avx2() {
  static const Kernels k{{gemm_bf16, gemm_int8, gemm_int4}, {ActKind::bf16, ActKind::i16, ActKind::i16},
                         portable_avx2::kRowOps};
  return k;
}

}  // namespace hmoe
