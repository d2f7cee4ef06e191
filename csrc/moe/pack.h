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

}  // namespace hmoe
