// AMX kernels (built with -mamx-tile -mamx-bf16 plus AVX-512) for experts with many tokens.
// All formats run BF16 tiles: bf16 weights are read in place (a 32-row block at K chunk kc is
// two 16x32 B tiles at stride 128 B); int8 blocks are widened to bf16 exactly (the row scale is
// applied to the result) and int4 blocks dequantized to bf16 ((q - z) * s), once per block into a
// thread-local buffer, then reused for every token. Activations are bf16 rows, n padded to 16.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "moe/packed.h"

namespace hmoe {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0..3: C (2 token tiles x 2 row tiles, fp32), tmm4/5: A (tokens), tmm6/7: B (weights).
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// out[t, 0:32] for all n tokens from one bf16 block [Kp/2][32][2].
void block_tiles(const uint16_t* wb, int Kp, const ActView& a, float* out, int ldo, const float* colscale) {
  alignas(64) float c[32][32];
  const int ld = a.ld * 2;
  for (int m0 = 0; m0 < a.n; m0 += 32) {
    const bool two = m0 + 16 < a.n;
    const uint16_t* x = a.bf16 + size_t(m0) * a.ld;
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
      _tile_zero(2);
      _tile_zero(3);
      for (int kc = 0; kc < Kp / 32; ++kc) {
        _tile_loadd(4, x + kc * 32, ld);
        _tile_loadd(5, x + size_t(16) * a.ld + kc * 32, ld);
        _tile_loadd(6, wb + size_t(kc) * 16 * 64, 128);
        _tile_loadd(7, wb + size_t(kc) * 16 * 64 + 32, 128);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(2, &c[16][0], 128);
      _tile_stored(3, &c[16][16], 128);
    } else {
      for (int kc = 0; kc < Kp / 32; ++kc) {
        _tile_loadd(4, x + kc * 32, ld);
        _tile_loadd(6, wb + size_t(kc) * 16 * 64, 128);
        _tile_loadd(7, wb + size_t(kc) * 16 * 64 + 32, 128);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
      }
    }
    _tile_stored(0, &c[0][0], 128);
    _tile_stored(1, &c[0][16], 128);
    const int rows = std::min(32, a.n - m0);
    for (int i = 0; i < rows; ++i) {
      float* o = out + size_t(m0 + i) * ldo;
      for (int h = 0; h < 2; ++h) {
        __m512 v = _mm512_load_ps(&c[i][16 * h]);
        if (colscale) v = _mm512_mul_ps(v, _mm512_loadu_ps(colscale + 16 * h));
        _mm512_storeu_ps(o + 16 * h, v);
      }
    }
  }
}

uint16_t* scratch(size_t elems) {
  thread_local std::vector<uint16_t> buf;
  if (buf.size() < elems) buf.resize(elems);
  return buf.data();
}

void gemm_bf16(const PackedView& w, int b0, int b1, const ActView& a, float* out, int ldo) {
  configure_tiles();
  for (int b = b0; b < b1; ++b)
    block_tiles(reinterpret_cast<const uint16_t*>(w.w) + size_t(b) * w.Kp * 32, w.Kp, a,
                out + size_t(b - b0) * kBlockRows, ldo, nullptr);
  _tile_release();
}

void gemm_int8(const PackedView& w, int b0, int b1, const ActView& a, float* out, int ldo) {
  configure_tiles();
  uint16_t* buf = scratch(size_t(w.Kp) * 32);
  for (int b = b0; b < b1; ++b) {
    const int8_t* wb = reinterpret_cast<const int8_t*>(w.w) + size_t(b) * w.Kp * 32;
    for (int i = 0; i < w.Kp * 32; i += 32) {  // int8 -> fp32 -> bf16, exact (|q| <= 128)
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + i))));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + i + 16))));
      _mm512_storeu_si512(buf + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    block_tiles(buf, w.Kp, a, out + size_t(b - b0) * kBlockRows, ldo, w.scale + size_t(b) * kBlockRows);
  }
  _tile_release();
}

void gemm_int4(const PackedView& w, int b0, int b1, const ActView& a, float* out, int ldo) {
  configure_tiles();
  uint16_t* buf = scratch(size_t(w.Kp) * 32);
  const int G = w.Kp / w.group, steps = w.group / 8;
  const __m512i nib = _mm512_set1_epi32(0x0F);
  // 16 bytes widened to dwords hold rows 8c..8c+7 of one half, two K each: dword 2r+j is row
  // 8c+r. Lane i therefore takes the scale of row 8c + i/2.
  const __m512i dup[2] = {_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
                          _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8)};
  for (int b = b0; b < b1; ++b) {
    const uint8_t* wb = w.w + size_t(b) * (w.Kp / 8) * 128;
    for (int g = 0; g < G; ++g) {
      const size_t si = (size_t(b) * G + g) * kBlockRows;
      for (int h = 0; h < 2; ++h) {
        const __m512 s = _mm512_loadu_ps(w.scale + si + 16 * h);
        const __m512 zs = _mm512_mul_ps(w.zero ? _mm512_loadu_ps(w.zero + si + 16 * h) : _mm512_set1_ps(8.f), s);
        const __m512 sc[2] = {_mm512_permutexvar_ps(dup[0], s), _mm512_permutexvar_ps(dup[1], s)};
        const __m512 zc[2] = {_mm512_permutexvar_ps(dup[0], zs), _mm512_permutexvar_ps(dup[1], zs)};
        for (int p = g * steps; p < (g + 1) * steps; ++p) {
          const uint8_t* raw = wb + size_t(p) * 128 + h * 64;
          // Bytes [0, 32): K 8p+j (low nibble) and 8p+4+j (high); bytes [32, 64): 8p+2+j, 8p+6+j.
          for (int quad = 0; quad < 2; ++quad) {
            __m512 f[2][2];  // [low/high nibble][rows 0-7 / 8-15]
            for (int c = 0; c < 2; ++c) {
              const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(raw + 32 * quad + 16 * c)));
              f[0][c] = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(d, nib)), sc[c], zc[c]);
              f[1][c] = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(d, 4)), sc[c], zc[c]);
            }
            // K pair (8p + 2j, 8p + 2j + 1) is pair row 4p + j: j = quad (low), 2 + quad (high).
            for (int hi = 0; hi < 2; ++hi)
              _mm512_storeu_si512(buf + size_t(4 * p + 2 * hi + quad) * 64 + 32 * h,
                                  (__m512i)_mm512_cvtne2ps_pbh(f[hi][1], f[hi][0]));
          }
        }
      }
    }
    block_tiles(buf, w.Kp, a, out + size_t(b - b0) * kBlockRows, ldo, nullptr);
  }
  _tile_release();
}

}  // namespace

// Linux hands out AMX tile state only to processes that ask for it (XFEATURE_XTILEDATA).
bool amx_request_permission() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
  return granted;
}

const Kernels& kernels_amx() {
  static const Kernels k{{gemm_bf16, gemm_int8, gemm_int4}, {ActKind::bf16, ActKind::bf16, ActKind::bf16},
                         kernels_avx512().ops};
  return k;
}

}  // namespace hmoe
