#pragma once
// Pack one expert of an int4 layer with zero points straight from int4 codes, as GPTQ and AWQ
// store them: the codes, scales and zero points are copied into the tiled layout, nothing goes
// through float, so the engine computes with exactly the checkpoint's weights.
#include <cstdint>

#include "moe/moe_layer.h"

namespace hmoe {

// W [N, K] as W[n, k] = (codes[n, k] - zero[n, g]) * scale[n, g], g = k / group (the layer's).
struct CodesMatrix {
  const uint8_t* codes = nullptr;  // [N, K], each in 0..15
  const float* scale = nullptr;    // [N, K / group]
  const float* zero = nullptr;     // [N, K / group]
};

// Expert e of `layer` (format int4 with zero points) from gate, up [I, H] and down [H, I];
// std::invalid_argument for another format or a code above 15.
void pack_expert_codes(MoeLayer& layer, int e, const CodesMatrix mats[3]);

}  // namespace hmoe
