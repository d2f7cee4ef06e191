// AVX-512 kernels (built with -mavx512f/bw/vl/bf16/vnni): bf16 pairs through vdpbf16ps,
// int8 and int4 weights against int16 activations through vpdpwssd, fp8 and mxfp4 weights widened to
// bf16 pairs for vdpbf16ps. Memory-bound in decode: each 32-row block of weights is read once per pass of
// up to M tokens.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "moe/fp8_avx512.h"
#include "moe/mxfp4_avx512.h"
#include "moe/packed.h"

namespace hmoe {
namespace {

// Loops over the M tokens and the two row tiles are fully unrolled (_Pragma below): otherwise
// the accumulator arrays are indexed at run time and live in memory, not registers.
inline __m512i bcast32(const void* p) { return _mm512_set1_epi32(*static_cast<const int32_t*>(p)); }

// Software prefetch of the weight line(s) of a K step, PackedView::prefetch_l1 / prefetch_l2 bytes
// ahead (0: none). The same distance in bytes for every format: a core's bytes in flight over DRAM
// latency bound its read rate, whatever the kernel does per byte.
struct Prefetch {
  int l1, l2;
};
inline Prefetch prefetch_of(const PackedView& w) { return {w.prefetch_l1, w.prefetch_l2}; }
// A macro, not a function: this file builds with -Os (nanobind's default), where GCC may keep
// such a helper out of line, find it free of side effects and drop every call to it.
#define HMOE_PREFETCH_AHEAD(pf, ptr, line)                                     \
  do {                                                                         \
    const char* line_ = reinterpret_cast<const char*>(ptr) + 64 * (line);      \
    if ((pf).l1) _mm_prefetch(line_ + (pf).l1, _MM_HINT_T0);                   \
    if ((pf).l2) _mm_prefetch(line_ + (pf).l2, _MM_HINT_T1);                   \
  } while (0)

// Few tokens: each (row tile, token) sums into C accumulators, one per step of C consecutive
// K steps; with one chain per tile a 1-token pass waits on the dot product's latency each step.
template <int M>
constexpr int chains() { return M == 1 ? 4 : M == 2 ? 2 : 1; }

// np is a multiple of 16 (Kp of 32), so of every C.
template <int M>
void bf16_pass(const uint16_t* wb, int np, const uint16_t* x, int ld, float* out, int ldo, Prefetch pf) {
  constexpr int C = chains<M>();
  __m512 acc[2][M][C];
  _Pragma("GCC unroll 8")
  for (int i = 0; i < M; ++i)
    _Pragma("GCC unroll 4")
    for (int c = 0; c < C; ++c) acc[0][i][c] = acc[1][i][c] = _mm512_setzero_ps();
  for (int p0 = 0; p0 < np; p0 += C) {
    _Pragma("GCC unroll 4")
    for (int c = 0; c < C; ++c) {
      const int p = p0 + c;
      HMOE_PREFETCH_AHEAD(pf, wb + p * 64, 0);  // both lines of the step
      HMOE_PREFETCH_AHEAD(pf, wb + p * 64, 1);
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb + p * 64);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wb + p * 64 + 32);
      _Pragma("GCC unroll 8")
      for (int i = 0; i < M; ++i) {
        const __m512bh xb = (__m512bh)bcast32(x + size_t(i) * ld + 2 * p);
        acc[0][i][c] = _mm512_dpbf16_ps(acc[0][i][c], w0, xb);
        acc[1][i][c] = _mm512_dpbf16_ps(acc[1][i][c], w1, xb);
      }
    }
  }
  _Pragma("GCC unroll 8")
  for (int i = 0; i < M; ++i)
    _Pragma("GCC unroll 2")
    for (int h = 0; h < 2; ++h) {
      __m512 v = acc[h][i][0];
      _Pragma("GCC unroll 4")
      for (int c = 1; c < C; ++c) v = _mm512_add_ps(v, acc[h][i][c]);
      _mm512_storeu_ps(out + size_t(i) * ldo + 16 * h, v);
    }
}

void gemm_bf16(const PackedView& w, int b0, int b1, const ActView& a, float* out, int ldo) {
  const Prefetch pf = prefetch_of(w);
  const int np = w.Kp / 2;
  for (int b = b0; b < b1; ++b) {
    const uint16_t* wb = reinterpret_cast<const uint16_t*>(w.w) + size_t(b) * np * 64;
    float* o = out + size_t(b - b0) * kBlockRows;
    for (int t0 = 0; t0 < a.n; t0 += 6) {
      const uint16_t* x = a.bf16 + size_t(t0) * a.ld;
      float* ot = o + size_t(t0) * ldo;
      switch (std::min(6, a.n - t0)) {
        case 1: bf16_pass<1>(wb, np, x, a.ld, ot, ldo, pf); break;
        case 2: bf16_pass<2>(wb, np, x, a.ld, ot, ldo, pf); break;
        case 3: bf16_pass<3>(wb, np, x, a.ld, ot, ldo, pf); break;
        case 4: bf16_pass<4>(wb, np, x, a.ld, ot, ldo, pf); break;
        case 5: bf16_pass<5>(wb, np, x, a.ld, ot, ldo, pf); break;
        default: bf16_pass<6>(wb, np, x, a.ld, ot, ldo, pf); break;
      }
    }
  }
}

// A flush span is 64 K steps, or what is left of Kp (a multiple of 16): a multiple of every C.
template <int M>
void int8_pass(const int8_t* wb, int Kp, const int16_t* x, int ld, const float* xscale, const float* wscale,
               float* out, int ldo, Prefetch pf) {
  constexpr int C = chains<M>();
  __m512 facc[2][M];
  _Pragma("GCC unroll 8")
  for (int i = 0; i < M; ++i) facc[0][i] = facc[1][i] = _mm512_setzero_ps();
  for (int k0 = 0; k0 < Kp; k0 += kInt8FlushK) {
    const int pend = std::min(Kp, k0 + kInt8FlushK) / 2;
    __m512i acc[2][M][C];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < M; ++i)
      _Pragma("GCC unroll 4")
      for (int c = 0; c < C; ++c) acc[0][i][c] = acc[1][i][c] = _mm512_setzero_si512();
    for (int p0 = k0 / 2; p0 < pend; p0 += C) {
      _Pragma("GCC unroll 4")
      for (int c = 0; c < C; ++c) {
        const int p = p0 + c;
        HMOE_PREFETCH_AHEAD(pf, wb + p * 64, 0);
        const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + p * 64)));
        const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + p * 64 + 32)));
        _Pragma("GCC unroll 8")
        for (int i = 0; i < M; ++i) {
          const __m512i xb = bcast32(x + size_t(i) * ld + 2 * p);
          acc[0][i][c] = _mm512_dpwssd_epi32(acc[0][i][c], w0, xb);
          acc[1][i][c] = _mm512_dpwssd_epi32(acc[1][i][c], w1, xb);
        }
      }
    }
    _Pragma("GCC unroll 8")
    for (int i = 0; i < M; ++i)
      _Pragma("GCC unroll 2")
      for (int h = 0; h < 2; ++h) {
        __m512i v = acc[h][i][0];
        _Pragma("GCC unroll 4")
        for (int c = 1; c < C; ++c) v = _mm512_add_epi32(v, acc[h][i][c]);
        facc[h][i] = _mm512_add_ps(facc[h][i], _mm512_cvtepi32_ps(v));
      }
  }
  const __m512 s0 = _mm512_loadu_ps(wscale), s1 = _mm512_loadu_ps(wscale + 16);
  _Pragma("GCC unroll 8")
  for (int i = 0; i < M; ++i) {
    const __m512 xs = _mm512_set1_ps(xscale[i]);
    _mm512_storeu_ps(out + size_t(i) * ldo, _mm512_mul_ps(facc[0][i], _mm512_mul_ps(s0, xs)));
    _mm512_storeu_ps(out + size_t(i) * ldo + 16, _mm512_mul_ps(facc[1][i], _mm512_mul_ps(s1, xs)));
  }
}

void gemm_int8(const PackedView& w, int b0, int b1, const ActView& a, float* out, int ldo) {
  const Prefetch pf = prefetch_of(w);
  const int np = w.Kp / 2;
  for (int b = b0; b < b1; ++b) {
    const int8_t* wb = reinterpret_cast<const int8_t*>(w.w) + size_t(b) * np * 64;
    const float* sc = w.scale + size_t(b) * kBlockRows;
    float* o = out + size_t(b - b0) * kBlockRows;
    for (int t0 = 0; t0 < a.n; t0 += 4) {
      const int16_t* x = a.q + size_t(t0) * a.ld;
      float* ot = o + size_t(t0) * ldo;
      const float* xs = a.qscale + t0;
      switch (std::min(4, a.n - t0)) {
        case 1: int8_pass<1>(wb, w.Kp, x, a.ld, xs, sc, ot, ldo, pf); break;
        case 2: int8_pass<2>(wb, w.Kp, x, a.ld, xs, sc, ot, ldo, pf); break;
        case 3: int8_pass<3>(wb, w.Kp, x, a.ld, xs, sc, ot, ldo, pf); break;
        default: int8_pass<4>(wb, w.Kp, x, a.ld, xs, sc, ot, ldo, pf); break;
      }
    }
  }
}

// 32 packed bytes -> 32 words; word w's low nibble is one K value, its high nibble the one 4 later.
inline __m512i widen(const uint8_t* p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// Each K step is four vpdpwssd per (row tile, token): with C chains they alternate over C / 2
// consecutive steps (U); steps per group (group / 8) is even. Group scales from sc ([G][32]), zero
// points from zr (null: symmetric, 8).
template <int M>
void int4_pass(const uint8_t* wb, const float* sc, const float* zr, int G, int steps, const int16_t* x, int ld,
               const float* xscale, const int32_t* xsum, float* out, int ldo, Prefetch pf) {
  constexpr int C = chains<M>(), U = C == 4 ? 2 : 1;
  const __m512i nib = _mm512_set1_epi16(0x0F);
  __m512 facc[2][M];
  _Pragma("GCC unroll 8")
  for (int i = 0; i < M; ++i) facc[0][i] = facc[1][i] = _mm512_setzero_ps();
  for (int g = 0; g < G; ++g) {
    __m512i acc[2][M][C];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < M; ++i)
      _Pragma("GCC unroll 4")
      for (int c = 0; c < C; ++c) acc[0][i][c] = acc[1][i][c] = _mm512_setzero_si512();
    for (int p0 = g * steps; p0 < (g + 1) * steps; p0 += U) {
      _Pragma("GCC unroll 2")
      for (int u = 0; u < U; ++u) {
        const int p = p0 + u;
        HMOE_PREFETCH_AHEAD(pf, wb + size_t(p) * 128, 0);
        HMOE_PREFETCH_AHEAD(pf, wb + size_t(p) * 128, 1);
        _Pragma("GCC unroll 2")
        for (int h = 0; h < 2; ++h) {
          const __m512i w0 = widen(wb + size_t(p) * 128 + h * 64), w1 = widen(wb + size_t(p) * 128 + h * 64 + 32);
          const __m512i q01 = _mm512_and_si512(w0, nib), q45 = _mm512_srli_epi16(w0, 4);
          const __m512i q23 = _mm512_and_si512(w1, nib), q67 = _mm512_srli_epi16(w1, 4);
          _Pragma("GCC unroll 8")
          for (int i = 0; i < M; ++i) {
            const int16_t* xi = x + size_t(i) * ld + 8 * p;
            __m512i& a0 = acc[h][i][(2 * u) % C];
            __m512i& a1 = acc[h][i][(2 * u + 1) % C];
            a0 = _mm512_dpwssd_epi32(a0, q01, bcast32(xi));
            a1 = _mm512_dpwssd_epi32(a1, q23, bcast32(xi + 2));
            a0 = _mm512_dpwssd_epi32(a0, q45, bcast32(xi + 4));
            a1 = _mm512_dpwssd_epi32(a1, q67, bcast32(xi + 6));
          }
        }
      }
    }
    _Pragma("GCC unroll 2")
    for (int h = 0; h < 2; ++h) {
      const __m512 scale = _mm512_loadu_ps(sc + size_t(g) * kBlockRows + 16 * h);
      const __m512 z = zr ? _mm512_loadu_ps(zr + size_t(g) * kBlockRows + 16 * h) : _mm512_set1_ps(8.f);
      _Pragma("GCC unroll 8")
      for (int i = 0; i < M; ++i) {
        __m512i sum = acc[h][i][0];
        _Pragma("GCC unroll 4")
        for (int c = 1; c < C; ++c) sum = _mm512_add_epi32(sum, acc[h][i][c]);
        const __m512 xs = _mm512_set1_ps(float(xsum[size_t(i) * G + g]));
        const __m512 v = _mm512_fnmadd_ps(z, xs, _mm512_cvtepi32_ps(sum));
        facc[h][i] = _mm512_fmadd_ps(v, scale, facc[h][i]);
      }
    }
  }
  _Pragma("GCC unroll 8")
  for (int i = 0; i < M; ++i) {
    const __m512 xs = _mm512_set1_ps(xscale[i]);
    _mm512_storeu_ps(out + size_t(i) * ldo, _mm512_mul_ps(facc[0][i], xs));
    _mm512_storeu_ps(out + size_t(i) * ldo + 16, _mm512_mul_ps(facc[1][i], xs));
  }
}

void gemm_int4(const PackedView& w, int b0, int b1, const ActView& a, float* out, int ldo) {
  const Prefetch pf = prefetch_of(w);
  const int G = w.Kp / w.group, steps = w.group / 8;
  for (int b = b0; b < b1; ++b) {
    const size_t sbase = size_t(b) * G * kBlockRows;
    const uint8_t* wb = w.w + size_t(b) * (w.Kp / 8) * 128;
    const float* sc = w.scale + sbase;
    const float* zr = w.zero ? w.zero + sbase : nullptr;
    float* o = out + size_t(b - b0) * kBlockRows;
    for (int t0 = 0; t0 < a.n; t0 += 4) {
      const int16_t* x = a.q + size_t(t0) * a.ld;
      const int32_t* xsum = a.qsum + size_t(t0) * G;
      float* ot = o + size_t(t0) * ldo;
      const float* xs = a.qscale + t0;
      switch (std::min(4, a.n - t0)) {
        case 1: int4_pass<1>(wb, sc, zr, G, steps, x, a.ld, xs, xsum, ot, ldo, pf); break;
        case 2: int4_pass<2>(wb, sc, zr, G, steps, x, a.ld, xs, xsum, ot, ldo, pf); break;
        case 3: int4_pass<3>(wb, sc, zr, G, steps, x, a.ld, xs, xsum, ot, ldo, pf); break;
        default: int4_pass<4>(wb, sc, zr, G, steps, x, a.ld, xs, xsum, ot, ldo, pf); break;
      }
    }
  }
}

// fp8 [Kp/2][32 rows][2]: a K pair's 64 codes (one line) widened to bf16 (fp8_bf16: exact) are bf16's
// pairs, multiplied by the tokens' bf16 x pairs through vdpbf16ps as in bf16_pass; per kFp8GroupK of K
// the sums go to fp32 times the block's scale. Pairs per group (64, or what is left of Kp: a multiple of
// 16) divide by every C.
template <int M>
void fp8_pass(const uint8_t* wb, int Kp, const float* sc, const uint16_t* x, int ld, float* out, int ldo,
              Prefetch pf) {
  constexpr int C = chains<M>();
  __m512 facc[2][M];
  _Pragma("GCC unroll 8")
  for (int i = 0; i < M; ++i) facc[0][i] = facc[1][i] = _mm512_setzero_ps();
  for (int k0 = 0; k0 < Kp; k0 += kFp8GroupK) {
    const int pend = std::min(Kp, k0 + kFp8GroupK) / 2;
    __m512 acc[2][M][C];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < M; ++i)
      _Pragma("GCC unroll 4")
      for (int c = 0; c < C; ++c) acc[0][i][c] = acc[1][i][c] = _mm512_setzero_ps();
    for (int p0 = k0 / 2; p0 < pend; p0 += C) {
      _Pragma("GCC unroll 4")
      for (int c = 0; c < C; ++c) {
        const int p = p0 + c;
        HMOE_PREFETCH_AHEAD(pf, wb + size_t(p) * 64, 0);
        const __m512bh w0 = (__m512bh)fp8_bf16(wb + size_t(p) * 64);
        const __m512bh w1 = (__m512bh)fp8_bf16(wb + size_t(p) * 64 + 32);
        _Pragma("GCC unroll 8")
        for (int i = 0; i < M; ++i) {
          const __m512bh xb = (__m512bh)bcast32(x + size_t(i) * ld + 2 * p);
          acc[0][i][c] = _mm512_dpbf16_ps(acc[0][i][c], w0, xb);
          acc[1][i][c] = _mm512_dpbf16_ps(acc[1][i][c], w1, xb);
        }
      }
    }
    const __m512 s = _mm512_set1_ps(sc[k0 / kFp8GroupK]);
    _Pragma("GCC unroll 8")
    for (int i = 0; i < M; ++i)
      _Pragma("GCC unroll 2")
      for (int h = 0; h < 2; ++h) {
        __m512 v = acc[h][i][0];
        _Pragma("GCC unroll 4")
        for (int c = 1; c < C; ++c) v = _mm512_add_ps(v, acc[h][i][c]);
        facc[h][i] = _mm512_fmadd_ps(v, s, facc[h][i]);
      }
  }
  _Pragma("GCC unroll 8")
  for (int i = 0; i < M; ++i) {
    _mm512_storeu_ps(out + size_t(i) * ldo, facc[0][i]);
    _mm512_storeu_ps(out + size_t(i) * ldo + 16, facc[1][i]);
  }
}

void gemm_fp8(const PackedView& w, int b0, int b1, const ActView& a, float* out, int ldo) {
  const Prefetch pf = prefetch_of(w);
  const int G = fp8_groups(w.Kp);
  for (int b = b0; b < b1; ++b) {
    const uint8_t* wb = w.w + size_t(b) * w.Kp * kBlockRows;
    const float* sc = w.scale + size_t(b) * G;
    float* o = out + size_t(b - b0) * kBlockRows;
    for (int t0 = 0; t0 < a.n; t0 += 4) {
      const uint16_t* x = a.bf16 + size_t(t0) * a.ld;
      float* ot = o + size_t(t0) * ldo;
      switch (std::min(4, a.n - t0)) {
        case 1: fp8_pass<1>(wb, w.Kp, sc, x, a.ld, ot, ldo, pf); break;
        case 2: fp8_pass<2>(wb, w.Kp, sc, x, a.ld, ot, ldo, pf); break;
        case 3: fp8_pass<3>(wb, w.Kp, sc, x, a.ld, ot, ldo, pf); break;
        default: fp8_pass<4>(wb, w.Kp, sc, x, a.ld, ot, ldo, pf); break;
      }
    }
  }
}

// mxfp4 [Kp/8][2 halves][16 rows][2] words: each half step's 64 bytes give, shifted by 4s and looked up
// (mxfp4_pair_bf16: exact), the bf16 pairs of K pair 4p + s, multiplied by the tokens' bf16 x pairs through
// vdpbf16ps; per 32 K (four steps) the sums go to fp32 times each row's scale 2^(e - 127), exact (a power of
// two), so the weights are the checkpoint's whatever the scale. Pair s of a step feeds chain s % C.
template <int M>
void mxfp4_pass(const uint8_t* wb, const uint8_t* ex, int G, const uint16_t* x, int ld, float* out, int ldo,
                Prefetch pf) {
  constexpr int C = chains<M>();
  const __m512i table = e2m1_bf16_table();
  __m512 facc[2][M];
  _Pragma("GCC unroll 8")
  for (int i = 0; i < M; ++i) facc[0][i] = facc[1][i] = _mm512_setzero_ps();
  for (int g = 0; g < G; ++g) {
    __m512 acc[2][M][C];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < M; ++i)
      _Pragma("GCC unroll 4")
      for (int c = 0; c < C; ++c) acc[0][i][c] = acc[1][i][c] = _mm512_setzero_ps();
    _Pragma("GCC unroll 4")
    for (int p = 4 * g; p < 4 * g + 4; ++p) {
      HMOE_PREFETCH_AHEAD(pf, wb + size_t(p) * 128, 0);
      HMOE_PREFETCH_AHEAD(pf, wb + size_t(p) * 128, 1);
      _Pragma("GCC unroll 2")
      for (int h = 0; h < 2; ++h) {
        const __m512i v = _mm512_loadu_si512(wb + size_t(p) * 128 + h * 64);
        const __m512bh w[4] = {(__m512bh)mxfp4_pair_bf16<0>(v, table), (__m512bh)mxfp4_pair_bf16<1>(v, table),
                               (__m512bh)mxfp4_pair_bf16<2>(v, table), (__m512bh)mxfp4_pair_bf16<3>(v, table)};
        _Pragma("GCC unroll 8")
        for (int i = 0; i < M; ++i)
          _Pragma("GCC unroll 4")
          for (int s = 0; s < 4; ++s) {
            __m512& a = acc[h][i][s % C];
            a = _mm512_dpbf16_ps(a, w[s], (__m512bh)bcast32(x + size_t(i) * ld + 8 * p + 2 * s));
          }
      }
    }
    _Pragma("GCC unroll 2")
    for (int h = 0; h < 2; ++h) {
      const __m512 scale = e8m0_ps(ex + size_t(g) * kBlockRows + 16 * h);
      _Pragma("GCC unroll 8")
      for (int i = 0; i < M; ++i) {
        __m512 v = acc[h][i][0];
        _Pragma("GCC unroll 4")
        for (int c = 1; c < C; ++c) v = _mm512_add_ps(v, acc[h][i][c]);
        facc[h][i] = _mm512_fmadd_ps(v, scale, facc[h][i]);
      }
    }
  }
  _Pragma("GCC unroll 8")
  for (int i = 0; i < M; ++i) {
    _mm512_storeu_ps(out + size_t(i) * ldo, facc[0][i]);
    _mm512_storeu_ps(out + size_t(i) * ldo + 16, facc[1][i]);
  }
}

void gemm_mxfp4(const PackedView& w, int b0, int b1, const ActView& a, float* out, int ldo) {
  const Prefetch pf = prefetch_of(w);
  const int G = w.Kp / kMxfp4GroupK;
  for (int b = b0; b < b1; ++b) {
    const uint8_t* wb = w.w + size_t(b) * block_bytes(Format::mxfp4, w.Kp);
    const uint8_t* ex = w.e8m0 + size_t(b) * G * kBlockRows;
    float* o = out + size_t(b - b0) * kBlockRows;
    for (int t0 = 0; t0 < a.n; t0 += 4) {
      const uint16_t* x = a.bf16 + size_t(t0) * a.ld;
      float* ot = o + size_t(t0) * ldo;
      switch (std::min(4, a.n - t0)) {
        case 1: mxfp4_pass<1>(wb, ex, G, x, a.ld, ot, ldo, pf); break;
        case 2: mxfp4_pass<2>(wb, ex, G, x, a.ld, ot, ldo, pf); break;
        case 3: mxfp4_pass<3>(wb, ex, G, x, a.ld, ot, ldo, pf); break;
        default: mxfp4_pass<4>(wb, ex, G, x, a.ld, ot, ldo, pf); break;
      }
    }
  }
}

// ---- Row-wise ops (RowOps) ----

inline __mmask16 first(int n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// 16 values from fp32 or bf16 (lanes past the mask read as 0).
inline __m512 load16(const void* src, bool bf16, int k, __mmask16 m) {
  if (bf16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(src) + k)), 16));
  return _mm512_maskz_loadu_ps(m, static_cast<const float*>(src) + k);
}

void to_bf16(const void* src, bool src_bf16, int n, int Kp, uint16_t* dst) {
  if (src_bf16) {
    std::memcpy(dst, src, size_t(n) * 2);
  } else {
    const float* s = static_cast<const float*>(src);
    int k = 0;
    for (; k + 32 <= n; k += 32)
      _mm512_storeu_si512(dst + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + k + 16), _mm512_loadu_ps(s + k)));
    for (; k < n; k += 16) {
      const __mmask16 m = first(n - k);
      _mm256_mask_storeu_epi16(dst + k, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, s + k)));
    }
  }
  std::memset(dst + n, 0, size_t(Kp - n) * 2);
}

void to_i16(const void* src, bool src_bf16, int n, int Kp, int group, int16_t* dst, float* scale, int32_t* sums) {
  __m512 vmax = _mm512_setzero_ps();
  for (int k = 0; k < n; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(src, src_bf16, k, first(n - k))));
  const float amax = _mm512_reduce_max_ps(vmax);
  const float s = amax / 32767.f, inv = s > 0 ? 1.f / s : 0.f;
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int k = 0; k < n; k += 16) {
    const __mmask16 m = first(n - k);
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(src, src_bf16, k, m), vinv));  // rounds to even
    _mm256_mask_storeu_epi16(dst + k, m, _mm512_cvtepi32_epi16(q));
  }
  std::memset(dst + n, 0, size_t(Kp - n) * 2);
  *scale = s;
  if (group) {
    const __m512i ones = _mm512_set1_epi16(1);
    for (int g = 0; g < Kp / group; ++g) {
      __m512i acc = _mm512_setzero_si512();
      for (int k = g * group; k < (g + 1) * group; k += 32)
        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_loadu_si512(dst + k), ones));
      sums[g] = _mm512_reduce_add_epi32(acc);
    }
  }
}

// e^x, |error| ~1 ulp (Cephes expf: x = n ln2 + r, polynomial in r, times 2^n).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.37626f)), _mm512_set1_ps(-87.33654f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

void silu_mul(float* g, const float* u, int n) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = first(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(m, g + i);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), v));
    _mm512_mask_storeu_ps(g + i, m, _mm512_mul_ps(_mm512_div_ps(v, _mm512_add_ps(one, e)), _mm512_maskz_loadu_ps(m, u + i)));
  }
}

// silu_mul's vectors with the biases added first; the clamps and the gain are the layer's (p.kind), set once
// per call, not per value.
void glu(float* g, const float* u, int n, const Glu& p, int col) {
  const bool clamped = p.kind == GluKind::clamped_swiglu;
  const __m512 one = _mm512_set1_ps(1.f), hi = _mm512_set1_ps(p.limit), lo = _mm512_set1_ps(-p.limit);
  const __m512 neg_gain = _mm512_set1_ps(clamped ? -p.alpha : -1.f);
  const float* gb = p.gate_bias ? p.gate_bias + col : nullptr;
  const float* ub = p.up_bias ? p.up_bias + col : nullptr;
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = first(n - i);
    __m512 gv = _mm512_maskz_loadu_ps(m, g + i), uv = _mm512_maskz_loadu_ps(m, u + i);
    if (gb) gv = _mm512_add_ps(gv, _mm512_maskz_loadu_ps(m, gb + i));
    if (ub) uv = _mm512_add_ps(uv, _mm512_maskz_loadu_ps(m, ub + i));
    if (clamped) {
      gv = _mm512_min_ps(gv, hi);
      uv = _mm512_add_ps(_mm512_max_ps(_mm512_min_ps(uv, hi), lo), one);
    }
    const __m512 e = exp_ps(_mm512_mul_ps(gv, neg_gain));
    _mm512_mask_storeu_ps(g + i, m, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), uv));
  }
}

void combine(int K, const float* const* src, const float* w, int n, void* dst, bool dst_bf16) {
  for (int c = 0; c < n; c += 16) {
    const __mmask16 m = first(n - c);
    __m512 acc = _mm512_setzero_ps();
    for (int k = 0; k < K; ++k) acc = _mm512_fmadd_ps(_mm512_set1_ps(w[k]), _mm512_maskz_loadu_ps(m, src[k] + c), acc);
    if (dst_bf16)
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(dst) + c, m, (__m256i)_mm512_cvtneps_pbh(acc));
    else
      _mm512_mask_storeu_ps(static_cast<float*>(dst) + c, m, acc);
  }
}

void add(float* y, const float* b, int n) {
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = first(n - i);
    _mm512_mask_storeu_ps(y + i, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, y + i), _mm512_maskz_loadu_ps(m, b + i)));
  }
}

}  // namespace

const Kernels& kernels_avx512() {
  static const Kernels k{{gemm_bf16, gemm_int8, gemm_int4, gemm_fp8, gemm_mxfp4},
                         {ActKind::bf16, ActKind::i16, ActKind::i16, ActKind::bf16, ActKind::bf16},
                         {to_bf16, to_i16, silu_mul, glu, combine, add}};
  return k;
}

}  // namespace hmoe
