#pragma once
// Pack one expert of an int4 layer with zero points straight from int4 codes, as GPTQ and AWQ
// store them: the codes, scales and zero points are copied into the tiled layout, nothing goes
// through float, so the engine computes with exactly the checkpoint's weights.
#include <cstdint>

#include "moe/moe_layer.h"

namespace hmoe {

// W [N, K] as W[n, k] = (codes[n, k] - zero[n, g]) * scale[n, g], g = k / group (the layer's); without zero
// points (zero null) W[n, k] = (codes[n, k] - 8) * scale[n, g], the symmetric int4 the engine quantizes to.
struct CodesMatrix {
  const uint8_t* codes = nullptr;  // [N, K], each in 0..15
  const float* scale = nullptr;    // [N, K / group]
  const float* zero = nullptr;     // [N, K / group], or null
};

// Expert e of `layer` (format int4, with zero points exactly when the matrices give them) from gate, up [I, H]
// and down [H, I]; std::invalid_argument for another format, a code above 15 or zero points that do not match.
void pack_expert_codes(MoeLayer& layer, int e, const CodesMatrix mats[3]);

}  // namespace hmoe
