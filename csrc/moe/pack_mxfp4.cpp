// mxfp4 experts packed once, at load: from an MXFP4 checkpoint's codes and e8m0 scales as they are, or from
// float weights quantized as OCP MX does. Built for baseline x86-64 (SSE2), like pack.cpp.
#include <emmintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "moe/pack.h"

namespace hmoe {
namespace {

constexpr uint8_t kUnitScale = 127;  // 2^0: the scale of a group of zero codes

// Each 32-bit lane: one step's 8 codes of one row as the checkpoint has them (nibble i: k = 8p + i) -> that
// row's word pair of packed.h's layout (the even k's nibbles in the low 16 bits, the odd k's in the high 16):
// nibbles 1 and 2 (and 5 and 6) swapped, then bytes 1 and 2.
inline __m128i unshuffle_nibbles(__m128i x) {
  __m128i t = _mm_and_si128(_mm_xor_si128(x, _mm_srli_epi32(x, 4)), _mm_set1_epi32(0x00F000F0));
  x = _mm_xor_si128(x, _mm_xor_si128(t, _mm_slli_epi32(t, 4)));
  t = _mm_and_si128(_mm_xor_si128(x, _mm_srli_epi32(x, 8)), _mm_set1_epi32(0x0000FF00));
  return _mm_xor_si128(x, _mm_xor_si128(t, _mm_slli_epi32(t, 8)));
}

// v[i]: row i's lanes (steps 0-3); afterwards v[p]: step p's lanes (rows 0-3).
inline void transpose4x4_epi32(__m128i v[4]) {
  const __m128i a0 = _mm_unpacklo_epi32(v[0], v[1]), a1 = _mm_unpacklo_epi32(v[2], v[3]);
  const __m128i a2 = _mm_unpackhi_epi32(v[0], v[1]), a3 = _mm_unpackhi_epi32(v[2], v[3]);
  v[0] = _mm_unpacklo_epi64(a0, a1);
  v[1] = _mm_unpackhi_epi64(a0, a1);
  v[2] = _mm_unpacklo_epi64(a2, a3);
  v[3] = _mm_unpackhi_epi64(a2, a3);
}

// x (a value over its group's scale) to the nearest e2m1 code, ties to even (the even codes' mantissa bit is 0),
// magnitudes past 6 to 6; a negative value keeps its sign, -0 included. The magnitude's code is the number of
// midpoints it passes (a tie passes the midpoint below an even code, not the one below an odd code).
inline uint8_t f32_to_e2m1(float x) {
  const float a = std::fabs(x);
  const int m = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.f);
  return uint8_t(m | (std::signbit(x) ? 8 : 0));
}

}  // namespace

int64_t pack_blocks_mxfp4(const Mxfp4Codes& m, int N, int K, int b0, int b1, uint8_t* w, uint8_t* e8m0) {
  const int G = K / kMxfp4GroupK;
  const __m128i magnitude = _mm_set1_epi8(0x77), zero = _mm_setzero_si128();
  int64_t bad = -1;
  for (int b = b0; b < b1; ++b) {
    uint8_t* wb = w + size_t(b - b0) * block_bytes(Format::mxfp4, K);
    uint8_t* eb = e8m0 + size_t(b - b0) * G * kBlockRows;
    for (int g = 0; g < G; ++g)
      for (int r0 = 0; r0 < kBlockRows; r0 += 4) {
        // Rows r0..r0+3, K [32g, 32g + 32): 16 bytes a row, four steps of 8 K.
        __m128i v[4];
        for (int i = 0; i < 4; ++i) {
          const int row = b * kBlockRows + r0 + i;
          v[i] = row < N ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(m.codes + size_t(row) * K / 2 + 16 * g))
                         : zero;
          const bool zeros = _mm_movemask_epi8(_mm_cmpeq_epi8(_mm_and_si128(v[i], magnitude), zero)) == 0xFFFF;
          const uint8_t e = row < N ? m.scales[size_t(row) * G + g] : kUnitScale;
          eb[g * kBlockRows + r0 + i] = zeros ? kUnitScale : e;
          const int64_t at = int64_t(row) * G + g;
          if (!zeros && (e < kE8m0Min || e > kE8m0Max) && (bad < 0 || at < bad)) bad = at;
          v[i] = unshuffle_nibbles(v[i]);
        }
        transpose4x4_epi32(v);
        for (int p = 0; p < 4; ++p)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(wb + size_t(4 * g + p) * 128 + (r0 / 16) * 64 + (r0 % 16) * 4),
                           v[p]);
      }
  }
  return bad;
}

void pack_blocks_mxfp4_float(const float* W, int N, int K, int b0, int b1, uint8_t* w, uint8_t* e8m0) {
  const int G = K / kMxfp4GroupK;
  for (int b = b0; b < b1; ++b) {
    uint8_t* wb = w + size_t(b - b0) * block_bytes(Format::mxfp4, K);
    uint8_t* eb = e8m0 + size_t(b - b0) * G * kBlockRows;
    for (int r = 0; r < kBlockRows; ++r) {
      const int row = b * kBlockRows + r;
      for (int g = 0; g < G; ++g) {
        uint8_t q[kMxfp4GroupK] = {};  // rows past N: zero codes
        int se = 0;                    // floor(log2(amax)) - 2 in the e8m0 range the kernels hold; 0 for zeros
        if (row < N) {
          const float* x = W + size_t(row) * K + g * kMxfp4GroupK;
          float amax = 0.f;
          for (int k = 0; k < kMxfp4GroupK; ++k) amax = std::max(amax, std::fabs(x[k]));
          if (amax > 0.f) se = std::clamp(std::ilogb(amax) - 2, kE8m0Min - 127, kE8m0Max - 127);
          const float inv = e8m0_to_f32(uint8_t(127 - se));  // 2^-se, exact
          for (int k = 0; k < kMxfp4GroupK; ++k) q[k] = f32_to_e2m1(x[k] * inv);
        }
        eb[g * kBlockRows + r] = uint8_t(se + 127);
        // Step p's word pair of row r (packed.h): the even k's codes in the low 16 bits, the odd k's in the high.
        for (int p = 0; p < kMxfp4GroupK / 8; ++p) {
          const uint8_t* c = q + 8 * p;
          const uint32_t pair = uint32_t(c[0] | c[2] << 4 | c[4] << 8 | c[6] << 12) |
                                uint32_t(c[1] | c[3] << 4 | c[5] << 8 | c[7] << 12) << 16;
          std::memcpy(wb + size_t(4 * g + p) * 128 + (r / 16) * 64 + (r % 16) * 4, &pair, 4);
        }
      }
    }
  }
}

}  // namespace hmoe
