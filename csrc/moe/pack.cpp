#include "moe/pack.h"

#include <emmintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace hmoe {
namespace {

// Byte offset and nibble shift of W[r, k] inside one int4 step of 8 K (128 bytes, 32 rows).
inline void int4_slot(int r, int k8, int* byte, int* shift) {
  const int half = r / 16, rr = r % 16;
  const int j = k8 & 1, quad = (k8 >> 1) & 1, hi = k8 >> 2;  // k8 = 4*hi + 2*quad + j
  *byte = half * 64 + quad * 32 + 2 * rr + j;
  *shift = hi * 4;
}

// std::nearbyint, inlined, exact for |x| < 2^22 (larger values end in the clamps below either way):
// adding and taking away 1.5 * 2^23 rounds to the nearest integer, ties to even, in the default
// rounding mode. This file is built for baseline x86-64, where nearbyintf is a library call per weight.
inline float round_even(float x) { return (x + 12582912.f) - 12582912.f; }

// std::clamp(v, lo, hi), by value: the reference it returns kept loops in memory.
inline float clampf(float v, float lo, float hi) { return v < lo ? lo : hi < v ? hi : v; }

void quant_int4_group(const float* x, int n, bool asym, uint8_t* q, float* scale, float* zero) {
  float mn = x[0], mx = x[0], amax = 0.f;
  for (int i = 0; i < n; ++i) {  // std::min / std::max, in registers
    const float v = x[i], a = std::fabs(v);
    mn = v < mn ? v : mn;
    mx = mx < v ? v : mx;
    amax = amax < a ? a : amax;
  }
  if (!asym) {
    const float s = amax / 7.f;
    const float inv = s > 0 ? 1.f / s : 0.f;
    for (int i = 0; i < n; ++i) q[i] = uint8_t(clampf(round_even(x[i] * inv), -8.f, 7.f) + 8);
    *scale = s;
    return;
  }
  float s = (mx - mn) / 15.f, z = 0.f;
  if (s > 0) {
    z = clampf(round_even(-mn / s), 0.f, 15.f);
  } else {  // a constant group: one level at 1 * s
    s = mn != 0.f ? mn : 1.f;
    for (int i = 0; i < n; ++i) q[i] = mn != 0.f ? 1 : 0;
    *scale = s;
    *zero = 0.f;
    return;
  }
  const float inv = 1.f / s;
  for (int i = 0; i < n; ++i) q[i] = uint8_t(clampf(round_even(x[i] * inv) + z, 0.f, 15.f));
  *scale = s;
  *zero = z;
}

// Where W[r, k] of a 32-row block sits in the pair layouts (bf16, int8 and fp8: [Kp/2][32 rows][2]).
inline size_t pair_index(int r, int k) { return (size_t(k / 2) * kBlockRows + r) * 2 + (k & 1); }

// v[i] holds row i's 8 code pairs (16-bit); afterwards v[j] holds pair j of the 8 rows.
inline void transpose8x8_epi16(__m128i v[8]) {
  __m128i a[8], b[8];
  for (int i = 0; i < 4; ++i) {  // a[2i]: pairs 0-3 of rows 2i, 2i+1 interleaved; a[2i+1]: pairs 4-7
    a[2 * i] = _mm_unpacklo_epi16(v[2 * i], v[2 * i + 1]);
    a[2 * i + 1] = _mm_unpackhi_epi16(v[2 * i], v[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h)  // b[4h + m]: pairs 2m, 2m + 1 of rows 4h..4h+3
    for (int q = 0; q < 2; ++q) {
      b[4 * h + 2 * q] = _mm_unpacklo_epi32(a[4 * h + q], a[4 * h + 2 + q]);
      b[4 * h + 2 * q + 1] = _mm_unpackhi_epi32(a[4 * h + q], a[4 * h + 2 + q]);
    }
  for (int q = 0; q < 4; ++q) {
    v[2 * q] = _mm_unpacklo_epi64(b[q], b[4 + q]);
    v[2 * q + 1] = _mm_unpackhi_epi64(b[q], b[4 + q]);
  }
}

// x (|x| <= 448 after the clamp) to the nearest e4m3 code, ties to even, as torch's float8_e4m3fn cast:
// below 2^-6 in subnormal steps of 2^-9 (the step to 2^-6 lands on code 8, the first normal); else the
// fp32 exponent rebiased (127 -> 7) over the mantissa rounded to 3 bits, a carry moving the exponent.
inline uint8_t f32_to_e4m3(float x) {
  union { float f; uint32_t u; } c{x};
  const uint8_t sign = uint8_t((c.u >> 24) & 0x80);
  c.u &= 0x7fffffff;
  const float a = c.f < kFp8Max ? c.f : kFp8Max;
  if (a < 0.015625f) return uint8_t(sign | uint8_t(round_even(a * 512.f)));
  union { float f; uint32_t u; } d{a};
  return uint8_t(sign | (((d.u + 0x7ffff + ((d.u >> 20) & 1)) >> 20) - (120u << 3)));
}

// Block b of W [N, K] in e4m3 with one scale per 128x128 block of W (amax / 448: DeepSeek-V3's scheme), that
// of the 128 rows block b lies in, per 128 K; rows past N and K past K are zero codes.
void pack_fp8_block(const float* W, int N, int K, int Kp, int b, uint8_t* wb, float* scale) {
  const int r0 = b * kBlockRows / kFp8GroupK * kFp8GroupK, r1 = std::min(N, r0 + kFp8GroupK);
  const int rows = std::min(kBlockRows, N - b * kBlockRows);
  std::memset(wb, 0, size_t(Kp) * kBlockRows);
  for (int g = 0; g < fp8_groups(Kp); ++g) {
    const int k0 = g * kFp8GroupK, k1 = std::min(K, k0 + kFp8GroupK);
    float amax = 0.f;
    for (int row = r0; row < r1; ++row)
      for (int k = k0; k < k1; ++k) {
        const float a = std::fabs(W[size_t(row) * K + k]);
        amax = amax < a ? a : amax;
      }
    const float s = amax / kFp8Max;
    scale[g] = s;
    if (!(s > 0.f)) continue;  // an all-zero block: zero codes
    for (int r = 0; r < rows; ++r) {
      const float* src = W + size_t(b * kBlockRows + r) * K;
      for (int k = k0; k < k1; ++k) wb[pair_index(r, k)] = f32_to_e4m3(src[k] / s);
    }
  }
}

}  // namespace

void pack_blocks(Format f, int group, const float* W, int N, int K, int Kp, int b0, int b1,
                 uint8_t* w, float* scale, float* zero) {
  const size_t bb = block_bytes(f, Kp);
  if (f == Format::fp8) {
    for (int b = b0; b < b1; ++b)
      pack_fp8_block(W, N, K, Kp, b, w + size_t(b - b0) * bb, scale + size_t(b - b0) * fp8_groups(Kp));
    return;
  }
  std::vector<float> x(Kp);  // one row, zeros past K (and all zeros past N): what every format packs
  for (int b = b0; b < b1; ++b) {
    uint8_t* wb = w + size_t(b - b0) * bb;
    for (int r = 0; r < kBlockRows; ++r) {
      const int row = b * kBlockRows + r;
      const float* src = row < N ? W + size_t(row) * K : nullptr;
      std::fill(std::copy(src, src ? src + K : src, x.begin()), x.end(), 0.f);
      if (f == Format::bf16) {
        auto* d = reinterpret_cast<uint16_t*>(wb);
        for (int k = 0; k < Kp; ++k) d[pair_index(r, k)] = f32_to_bf16(x[k]);
      } else if (f == Format::int8) {
        float amax = 0.f;
        for (int k = 0; k < Kp; ++k) {
          const float a = std::fabs(x[k]);
          amax = amax < a ? a : amax;
        }
        const float s = amax / 127.f, inv = s > 0 ? 1.f / s : 0.f;
        auto* d = reinterpret_cast<int8_t*>(wb);
        for (int k = 0; k < Kp; ++k) d[pair_index(r, k)] = int8_t(round_even(x[k] * inv));
        scale[size_t(b - b0) * kBlockRows + r] = s;
      } else {
        const int G = Kp / group;
        uint8_t q[128];
        for (int g = 0; g < G; ++g) {
          const size_t si = (size_t(b - b0) * G + g) * kBlockRows + r;
          float z = 8.f;
          quant_int4_group(x.data() + g * group, group, zero != nullptr, q, &scale[si], &z);
          if (zero) zero[si] = z;
          // Whole bytes, one K step (8 values, 128 bytes for the block) at a time: byte int4_slot gives
          // k8 = 2*quad + j its low nibble and k8 = 4 + 2*quad + j its high one (group % 8 == 0).
          for (int s = 0; s < group / 8; ++s) {
            const uint8_t* q8 = q + 8 * s;
            for (int k8 = 0; k8 < 4; ++k8) {
              int byte, shift;
              int4_slot(r, k8, &byte, &shift);
              wb[size_t(g * group / 8 + s) * 128 + byte] = uint8_t(q8[k8] | (q8[k8 + 4] << 4));
            }
          }
        }
      }
    }
  }
}

void unpack_blocks(Format f, const PackedView& v, int N, int K, int b0, int b1, float* W) {
  const size_t bb = block_bytes(f, v.Kp);
  for (int b = b0; b < b1; ++b) {
    const uint8_t* wb = v.w + size_t(b - b0) * bb;
    for (int r = 0; r < kBlockRows; ++r) {
      const int row = b * kBlockRows + r;
      if (row >= N) break;
      float* dst = W + size_t(row) * K;
      if (f == Format::fp8) {
        const float* sc = v.scale + size_t(b - b0) * fp8_groups(v.Kp);
        for (int k = 0; k < K; ++k) dst[k] = e4m3_to_f32(wb[pair_index(r, k)]) * sc[k / kFp8GroupK];
        continue;
      }
      if (f == Format::mxfp4) {
        const uint8_t* ex = v.e8m0 + size_t(b - b0) * (v.Kp / kMxfp4GroupK) * kBlockRows;
        for (int k = 0; k < K; ++k) {
          int byte, shift;
          mxfp4_slot(r, k % 8, &byte, &shift);
          const uint8_t code = (wb[size_t(k / 8) * 128 + byte] >> shift) & 0xF;
          dst[k] = e2m1_to_f32(code) * e8m0_to_f32(ex[(k / kMxfp4GroupK) * kBlockRows + r]);
        }
        continue;
      }
      for (int k = 0; k < K; ++k) {
        const size_t pair = pair_index(r, k);
        if (f == Format::bf16) {
          dst[k] = bf16_to_f32(reinterpret_cast<const uint16_t*>(wb)[pair]);
        } else if (f == Format::int8) {
          dst[k] = float(reinterpret_cast<const int8_t*>(wb)[pair]) * v.scale[size_t(b - b0) * kBlockRows + r];
        } else {
          const int G = v.Kp / v.group, g = k / v.group;
          const size_t si = (size_t(b - b0) * G + g) * kBlockRows + r;
          int byte, shift;
          int4_slot(r, k % 8, &byte, &shift);
          const int q = (wb[size_t(k / 8) * 128 + byte] >> shift) & 0xF;
          dst[k] = (float(q) - (v.zero ? v.zero[si] : 8.f)) * v.scale[si];
        }
      }
    }
  }
}

bool pack_blocks_fp8(const Fp8Codes& m, int N, int K, int Kp, int b0, int b1, uint8_t* w, float* scale) {
  const int G = fp8_groups(Kp);
  const __m128i low7 = _mm_set1_epi8(0x7f);
  __m128i nan = _mm_setzero_si128();  // bytes 0xff where a code's 7 low bits were all set
  bool nan_tail = false;
  for (int b = b0; b < b1; ++b) {
    uint8_t* wb = w + size_t(b - b0) * block_bytes(Format::fp8, Kp);
    const int row0 = b * kBlockRows, rows = std::min(kBlockRows, N - row0);
    if (rows < kBlockRows || K < Kp) std::memset(wb, 0, size_t(Kp) * kBlockRows);
    const uint8_t* src = m.codes + size_t(row0) * K;
    // Whole blocks 8 K pairs at a time: 8 rows x 8 pairs (16 bytes a row) transposed into each pair's
    // 8 rows; the rest (a partial block, K past the last 16, an odd K) code by code.
    int k = 0;
    for (; rows == kBlockRows && k + 16 <= K; k += 16)
      for (int r0 = 0; r0 < kBlockRows; r0 += 8) {
        __m128i v[8];
        for (int i = 0; i < 8; ++i) {
          v[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + size_t(r0 + i) * K + k));
          nan = _mm_or_si128(nan, _mm_cmpeq_epi8(_mm_and_si128(v[i], low7), low7));
        }
        transpose8x8_epi16(v);
        for (int j = 0; j < 8; ++j)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(wb + pair_index(r0, k + 2 * j)), v[j]);
      }
    for (; k < K; ++k)
      for (int r = 0; r < rows; ++r) {
        const uint8_t c = src[size_t(r) * K + k];
        nan_tail |= e4m3_is_nan(c);
        wb[pair_index(r, k)] = c;
      }
    const float* sc = m.scale + size_t(row0 / kFp8GroupK) * G;
    std::copy(sc, sc + G, scale + size_t(b - b0) * G);
  }
  return nan_tail || _mm_movemask_epi8(nan) != 0;
}

}  // namespace hmoe
