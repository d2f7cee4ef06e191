#pragma once
// The backward of an expert's h = glu(g, u) (packed.h Glu) for one (token, expert) row, in fp32: the step of the
// backward pass (moe_backward.cpp) between the down projection's transposed product and the gate and up ones'.
#include "moe/packed.h"

namespace hmoe {

// g, u: the row's gate and up sums (x Wg^T, x Wu^T, without biases); d = Wd^T dout; w: its routing weight;
// n = I values each. With dh = w d, writes dg = dh * dh/dg and du = dh * dh/du through glu's biases and clamps
// (glu null: h = silu(g) * u without biases; a clamp passes the gradient where its input lies within the limit,
// bounds included, as torch's clamp does). Returns <d, h>: the routing weight's gradient <dout, y> less the down
// bias's part <dout, b_down>.
float glu_backward(const Glu* glu, const float* g, const float* u, const float* d, float w, int n, float* dg,
                   float* du);

}  // namespace hmoe
