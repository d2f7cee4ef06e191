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

// One matrix as an MXFP4 checkpoint stores it (gpt-oss; OCP MX FP4): W[n, k] = e2m1(the code of k in byte
// codes[n, k / 2], k even in the low nibble) * 2^(scales[n, k / 32] - 127).
struct Mxfp4Codes {
  const uint8_t* codes = nullptr;   // [N, K / 2]
  const uint8_t* scales = nullptr;  // [N, K / 32], e8m0
};

// Rows [32*b0, 32*b1) of m (K % 32 == 0) into slice-local mxfp4 w / e8m0 as they are: the codes moved into the
// tiled layout, the scales transposed to [K / 32][32]; rows past N are zero codes; a group whose codes are all
// zero gets scale 127 (it multiplies nothing). Returns the index n * (K / 32) + g of the first group of those rows
// with a nonzero code under a scale outside [kE8m0Min, kE8m0Max], or -1: the caller refuses the matrix.
int64_t pack_blocks_mxfp4(const Mxfp4Codes& m, int N, int K, int b0, int b1, uint8_t* w, uint8_t* e8m0);

// Rows [32*b0, 32*b1) of W [N, K] (fp32, K % 32 == 0) quantized to mxfp4 as OCP MX v1.0 does, per 32 K of a row:
// scale 2^(floor(log2(amax)) - 2) (2: the exponent of e2m1's largest value, 6), each value over the scale
// rounded to the nearest e2m1 value, ties to even, magnitudes past 6 to 6; the exponent clamped to
// [kE8m0Min, kE8m0Max] - 127, and an all-zero group at scale 127 (zero codes).
void pack_blocks_mxfp4_float(const float* W, int N, int K, int b0, int b1, uint8_t* w, uint8_t* e8m0);

}  // namespace hmoe
