#pragma once
// One backward call through a layer's frozen routed experts (MoeLayer::backward, moe_backward.cpp): the gradients
// of the layer's input and routing weights, given the forward call's inputs and the gradient of its output. Weights
// and biases are frozen: no gradient of theirs is formed.
#include <cstddef>

namespace hmoe {

// Raw views, checked at the Python boundary (bindings.cpp) as a forward call's, and grad_out and the two outputs.
struct MoeBackwardCall {
  const void* x = nullptr;  // [T, H] fp32 or bf16: the forward's input
  bool x_bf16 = false;
  int T = 0, K = 0;
  const void* ids = nullptr;  // [T, K] int32 or int64, each in [0, E), distinct per token (but slots of weight 0)
  bool ids64 = false;
  const float* weights = nullptr;  // [T, K]
  const void* grad_out = nullptr;  // [T, H] fp32 or bf16: d loss / d out
  bool grad_out_bf16 = false;
  void* grad_x = nullptr;         // [T, H], x's dtype: d loss / d x
  float* grad_weights = nullptr;  // [T, K]: d loss / d weights
  int chunk_tokens = 0;           // tokens per pass (0: as many as kBackwardBytes of workspace hold)
};

// The most workspace one backward pass holds; a call of more tokens runs in several passes.
constexpr size_t kBackwardBytes = size_t(256) << 20;

}  // namespace hmoe
