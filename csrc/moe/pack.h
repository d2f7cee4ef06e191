#pragma once
// Quantize and tile one expert matrix, once, at load; and the inverse, for tests.
#include "moe/packed.h"

namespace hmoe {

// Packs rows [32*b0, 32*b1) of W [N, K] (fp32, row-major) into slice-local w / scale / zero
// (zero only for int4 with zero points, else null).
void pack_blocks(Format f, int group, const float* W, int N, int K, int Kp, int b0, int b1,
                 uint8_t* w, float* scale, float* zero);

// The weights the kernels compute with (dequantized), rows [32*b0, 32*b1) into W [N, K].
void unpack_blocks(Format f, const PackedView& v, int N, int K, int b0, int b1, float* W);

// One matrix as a block-FP8 checkpoint stores it (DeepSeek-V3): W[n, k] = e4m3(codes[n, k]) *
// scale[n / 128][k / 128].
struct Fp8Codes {
  const uint8_t* codes = nullptr;  // [N, K], no NaN code
  const float* scale = nullptr;    // [ceil(N / 128)][ceil(K / 128)]
};

// Rows [32*b0, 32*b1) of m into slice-local fp8 w / scale as they are: codes copied into the tiled
// layout (zeros past N and K), each block's scales copied from the 128x128 block its rows lie in.
// Returns whether one of those rows' codes is NaN (0x7f, 0xff): the caller refuses the matrix.
bool pack_blocks_fp8(const Fp8Codes& m, int N, int K, int Kp, int b0, int b1, uint8_t* w, float* scale);

}  // namespace hmoe
