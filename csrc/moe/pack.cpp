#include "moe/pack.h"

#include <algorithm>
#include <cmath>

namespace hmoe {
namespace {

// Byte offset and nibble shift of W[r, k] inside one int4 step of 8 K (128 bytes, 32 rows).
inline void int4_slot(int r, int k8, int* byte, int* shift) {
  const int half = r / 16, rr = r % 16;
  const int j = k8 & 1, quad = (k8 >> 1) & 1, hi = k8 >> 2;  // k8 = 4*hi + 2*quad + j
  *byte = half * 64 + quad * 32 + 2 * rr + j;
  *shift = hi * 4;
}

void quant_int4_group(const float* x, int n, bool asym, uint8_t* q, float* scale, float* zero) {
  float mn = x[0], mx = x[0], amax = 0.f;
  for (int i = 0; i < n; ++i) {
    mn = std::min(mn, x[i]);
    mx = std::max(mx, x[i]);
    amax = std::max(amax, std::fabs(x[i]));
  }
  if (!asym) {
    const float s = amax / 7.f;
    const float inv = s > 0 ? 1.f / s : 0.f;
    for (int i = 0; i < n; ++i) q[i] = uint8_t(std::clamp(std::nearbyint(x[i] * inv), -8.f, 7.f) + 8);
    *scale = s;
    return;
  }
  float s = (mx - mn) / 15.f, z = 0.f;
  if (s > 0) {
    z = std::clamp(std::nearbyint(-mn / s), 0.f, 15.f);
  } else {  // a constant group: one level at 1 * s
    s = mn != 0.f ? mn : 1.f;
    for (int i = 0; i < n; ++i) q[i] = mn != 0.f ? 1 : 0;
    *scale = s;
    *zero = 0.f;
    return;
  }
  const float inv = 1.f / s;
  for (int i = 0; i < n; ++i) q[i] = uint8_t(std::clamp(std::nearbyint(x[i] * inv) + z, 0.f, 15.f));
  *scale = s;
  *zero = z;
}

}  // namespace

void pack_blocks(Format f, int group, const float* W, int N, int K, int Kp, int b0, int b1,
                 uint8_t* w, float* scale, float* zero) {
  const size_t bb = block_bytes(f, Kp);
  for (int b = b0; b < b1; ++b) {
    uint8_t* wb = w + size_t(b - b0) * bb;
    for (int r = 0; r < kBlockRows; ++r) {
      const int row = b * kBlockRows + r;
      const float* src = row < N ? W + size_t(row) * K : nullptr;
      auto at = [&](int k) { return src && k < K ? src[k] : 0.f; };
      if (f == Format::bf16) {
        auto* d = reinterpret_cast<uint16_t*>(wb);
        for (int k = 0; k < Kp; ++k) d[(size_t(k / 2) * kBlockRows + r) * 2 + (k & 1)] = f32_to_bf16(at(k));
      } else if (f == Format::int8) {
        float amax = 0.f;
        for (int k = 0; k < K && src; ++k) amax = std::max(amax, std::fabs(src[k]));
        const float s = amax / 127.f, inv = s > 0 ? 1.f / s : 0.f;
        auto* d = reinterpret_cast<int8_t*>(wb);
        for (int k = 0; k < Kp; ++k)
          d[(size_t(k / 2) * kBlockRows + r) * 2 + (k & 1)] = int8_t(std::nearbyint(at(k) * inv));
        scale[size_t(b - b0) * kBlockRows + r] = s;
      } else {
        const int G = Kp / group;
        uint8_t q[128];
        for (int g = 0; g < G; ++g) {
          float xs[128];
          for (int i = 0; i < group; ++i) xs[i] = at(g * group + i);
          const size_t si = (size_t(b - b0) * G + g) * kBlockRows + r;
          float z = 8.f;
          quant_int4_group(xs, group, zero != nullptr, q, &scale[si], &z);
          if (zero) zero[si] = z;
          for (int i = 0; i < group; ++i) {
            const int k = g * group + i;
            int byte, shift;
            int4_slot(r, k % 8, &byte, &shift);
            uint8_t& dst = wb[size_t(k / 8) * 128 + byte];
            dst = uint8_t((dst & ~(0xF << shift)) | (q[i] << shift));
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
