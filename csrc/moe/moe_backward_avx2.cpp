// AVX2 + FMA transposed products (backward_kernels.h; built with -mavx2 -mfma -O3), for CPUs without AVX-512:
// each 32 x kChunkK piece of a block decoded to fp32 once (transposed_portable.inc, which -O3 vectorizes), then
// summed into every vector's outputs, three vectors at a time: 12 accumulators (kChunkK columns each) and a
// broadcast entry per vector fit the 16 ymm registers. fp32 vectors, every format.
#include <immintrin.h>

#include <algorithm>

#include "moe/backward_kernels.h"

namespace hmoe {
namespace transposed_avx2 {
#include "moe/transposed_portable.inc"
}  // namespace transposed_avx2

namespace {
using namespace transposed_avx2;

constexpr int kPassVectors = 3;

// out[i][0:32] += sum_r v[i][r] * piece[r][0:32], i < M.
template <int M>
void piece_pass(const float* piece, const float* const* v, float* const* out) {
  __m256 acc[M][4];
  for (int i = 0; i < M; ++i)
    for (int q = 0; q < 4; ++q) acc[i][q] = _mm256_loadu_ps(out[i] + 8 * q);
  for (int r = 0; r < kBlockRows; ++r) {
    __m256 a[M];
    for (int i = 0; i < M; ++i) a[i] = _mm256_broadcast_ss(v[i] + r);
    for (int q = 0; q < 4; ++q) {
      const __m256 wq = _mm256_loadu_ps(piece + r * kChunkK + 8 * q);
      for (int i = 0; i < M; ++i) acc[i][q] = _mm256_fmadd_ps(wq, a[i], acc[i][q]);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int q = 0; q < 4; ++q) _mm256_storeu_ps(out[i] + 8 * q, acc[i][q]);
}

template <Format F>
void gemm_t(const PackedView& w, int nblocks, int k0, const TRows& v, const TOut& out, bool accumulate) {
  static_assert(kChunkK == 32, "piece_pass covers 32 columns");
  start_rows(out, v.n, accumulate);
  alignas(32) float piece[kBlockRows * kChunkK];
  for (int b = 0; b < nblocks; ++b) {
    decode_chunk<F>(w, b, k0, piece);
    for (int t0 = 0; t0 < v.n; t0 += kPassVectors) {
      const int m = std::min(kPassVectors, v.n - t0);
      const float* vr[kPassVectors];
      float* o[kPassVectors];
      pass_rows(v, out, t0, m, b * kBlockRows, vr, o);
      switch (m) {
        case 1: piece_pass<1>(piece, vr, o); break;
        case 2: piece_pass<2>(piece, vr, o); break;
        default: piece_pass<3>(piece, vr, o); break;
      }
    }
  }
}

}  // namespace

const BackwardKernels& backward_kernels_avx2() {
  static const BackwardKernels k{{gemm_t<Format::bf16>, gemm_t<Format::int8>, gemm_t<Format::int4>,
                                  gemm_t<Format::fp8>, gemm_t<Format::mxfp4>},
                                 false};
  return k;
}

}  // namespace hmoe
