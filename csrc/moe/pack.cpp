#include "moe/pack.h"

#include <algorithm>
#include <cmath>
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

}  // namespace

void pack_blocks(Format f, int group, const float* W, int N, int K, int Kp, int b0, int b1,
                 uint8_t* w, float* scale, float* zero) {
  const size_t bb = block_bytes(f, Kp);
  std::vector<float> x(Kp);  // one row, zeros past K (and all zeros past N): what every format packs
  for (int b = b0; b < b1; ++b) {
    uint8_t* wb = w + size_t(b - b0) * bb;
    for (int r = 0; r < kBlockRows; ++r) {
      const int row = b * kBlockRows + r;
      const float* src = row < N ? W + size_t(row) * K : nullptr;
      std::fill(std::copy(src, src ? src + K : src, x.begin()), x.end(), 0.f);
      if (f == Format::bf16) {
        auto* d = reinterpret_cast<uint16_t*>(wb);
        for (int k = 0; k < Kp; ++k) d[(size_t(k / 2) * kBlockRows + r) * 2 + (k & 1)] = f32_to_bf16(x[k]);
      } else if (f == Format::int8) {
        float amax = 0.f;
        for (int k = 0; k < Kp; ++k) {
          const float a = std::fabs(x[k]);
          amax = amax < a ? a : amax;
        }
        const float s = amax / 127.f, inv = s > 0 ? 1.f / s : 0.f;
        auto* d = reinterpret_cast<int8_t*>(wb);
        for (int k = 0; k < Kp; ++k) d[(size_t(k / 2) * kBlockRows + r) * 2 + (k & 1)] = int8_t(round_even(x[k] * inv));
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
      for (int k = 0; k < K; ++k) {
        const size_t pair = (size_t(k / 2) * kBlockRows + r) * 2 + (k & 1);
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

}  // namespace hmoe
