// The AMX kernels of amx_kernels.inc over tile registers emulated in memory (built with the
// AVX-512 flags only): isa="amx_emulated" runs their tiling, repacking and quantization on CPUs
// without AMX, so tests here check that logic against the reference. Slow; tests only.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "moe/fp8_avx512.h"
#include "moe/mxfp4_avx512.h"
#include "moe/packed.h"

namespace hmoe {
namespace {

struct alignas(64) Tile {
  uint8_t row[16][64];
};
thread_local Tile tmm[8];

void tiles_begin() {}
void tiles_end() {}
template <int t> void tile_zero() { std::memset(&tmm[t], 0, sizeof(Tile)); }
template <int t> void tile_load(const void* src, size_t stride) {
  for (int r = 0; r < 16; ++r) std::memcpy(tmm[t].row[r], static_cast<const uint8_t*>(src) + r * stride, 64);
}
template <int t> void tile_store(void* dst, size_t stride) {
  for (int r = 0; r < 16; ++r) std::memcpy(static_cast<uint8_t*>(dst) + r * stride, tmm[t].row[r], 64);
}

// C tile c (0..3) with A tile a = 4 + c / 2 and B tile b = 6 + c % 2:
// C[m][n] += sum_k A[m][2k] * B[k][2n] + A[m][2k+1] * B[k][2n+1] (bf16 in, fp32 out).
template <int c> void tile_dp_bf16() {
  constexpr int a = 4 + c / 2, b = 6 + c % 2;
  float C[16][16];
  uint16_t A[16][32], B[16][32];
  std::memcpy(C, tmm[c].row, sizeof(C));
  std::memcpy(A, tmm[a].row, sizeof(A));
  std::memcpy(B, tmm[b].row, sizeof(B));
  for (int m = 0; m < 16; ++m)
    for (int k = 0; k < 16; ++k)
      for (int n = 0; n < 16; ++n)
        C[m][n] += bf16_to_f32(A[m][2 * k]) * bf16_to_f32(B[k][2 * n]) +
                   bf16_to_f32(A[m][2 * k + 1]) * bf16_to_f32(B[k][2 * n + 1]);
  std::memcpy(tmm[c].row, C, sizeof(C));
}

// C[m][n] += sum_k sum_i A[m][4k+i] * B[k][4n+i] (int8 in, int32 out; tiles as above).
template <int c> void tile_dp_i8() {
  constexpr int a = 4 + c / 2, b = 6 + c % 2;
  int32_t C[16][16];
  int8_t A[16][64], B[16][64];
  std::memcpy(C, tmm[c].row, sizeof(C));
  std::memcpy(A, tmm[a].row, sizeof(A));
  std::memcpy(B, tmm[b].row, sizeof(B));
  for (int m = 0; m < 16; ++m)
    for (int k = 0; k < 16; ++k)
      for (int n = 0; n < 16; ++n)
        for (int i = 0; i < 4; ++i) C[m][n] += int32_t(A[m][4 * k + i]) * int32_t(B[k][4 * n + i]);
  std::memcpy(tmm[c].row, C, sizeof(C));
}

#include "moe/amx_kernels.inc"

}  // namespace

const Kernels& kernels_amx_emulated() {
  static const Kernels k = make_kernels();
  return k;
}

}  // namespace hmoe
