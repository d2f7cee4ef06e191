#pragma once
// Transposed products over the packed layouts (packed.h), the backward pass's GEMMs through frozen experts:
//   out[i, k] = sum_n v_i[n] * W[n, k]   (v_i^T W, the rows of W [N, K] scaled by v_i's entries and summed)
// for the n vectors v_i of one expert's tokens and the kChunkK columns k of one chunk. A call reads the chunk's
// columns of every block of one slice view once, for all the vectors: split over chunks, an expert's weights
// are read once per backward pass whatever its token count. Each ISA's kernels live in moe_backward_<isa>.cpp.
#include <cstddef>

#include "moe/packed.h"

namespace hmoe {

constexpr int kChunkK = 32;  // columns of W per call: one int4 group at least (32, 64, 128), a quarter of fp8's

// The vectors: v_i's entry n at element col0 + n of row i, row i at base + (index ? index[i] : i) * ld elements,
// fp32 or bf16 as the kernel set reads them (BackwardKernels::v_bf16); entries past the matrix's N, up to its
// blocks * 32, are zeros (the padding rows' weights are zeros, but 0 * NaN is not).
struct TRows {
  const void* base = nullptr;
  size_t ld = 0;
  const int* index = nullptr;
  int n = 0;
  int col0 = 0;
};

// The outputs: row i of kChunkK fp32 values at base + (index ? index[i] : i) * ld; distinct rows (a kernel may load
// each row once, sum, then store it).
struct TOut {
  float* base = nullptr;
  size_t ld = 0;
  const int* index = nullptr;
};

// out[i][kk] = (accumulate ? out[i][kk] : 0) + sum of v_i[n] * W[n, k0 + kk] over the rows n of the view's blocks
// [0, nblocks), kk < kChunkK; k0 a multiple of kChunkK below Kp. With nblocks 0 it only zeroes (or keeps) out.
using GemmTFn = void (*)(const PackedView& w, int nblocks, int k0, const TRows& v, const TOut& out, bool accumulate);

struct BackwardKernels {
  GemmTFn gemm_t[kFormats];  // by Format; null: the backward cannot read that format
  bool v_bf16;               // the vectors in bf16 (AVX-512 BF16 dot products), else fp32
};

const BackwardKernels& backward_kernels_generic();
const BackwardKernels& backward_kernels_avx2();
const BackwardKernels& backward_kernels_avx512();

template <class T>
static inline const T* trow(const TRows& v, int i) {
  return static_cast<const T*>(v.base) + size_t(v.index ? v.index[i] : i) * v.ld + v.col0;
}
static inline float* trow(const TOut& o, int i) { return o.base + size_t(o.index ? o.index[i] : i) * o.ld; }

// A kernel's pass over vectors [t0, t0 + m): their rows from entry `first` on into vr, their outputs into out_rows.
template <class T, int N>
static inline void pass_rows(const TRows& v, const TOut& out, int t0, int m, int first, const T* (&vr)[N],
                             float* (&out_rows)[N]) {
  for (int i = 0; i < m; ++i) {
    vr[i] = trow<T>(v, t0 + i) + first;
    out_rows[i] = trow(out, t0 + i);
  }
}

}  // namespace hmoe
