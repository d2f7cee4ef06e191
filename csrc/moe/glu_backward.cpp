#include "moe/glu_backward.h"

#include <algorithm>
#include <cmath>

namespace hmoe {
namespace {

// gpt-oss's h = (clamp(u, -L, L) + 1) * gc * sigmoid(alpha gc), gc = min(g, L): the derivative of gc sigmoid(alpha gc)
// is s (1 + alpha gc (1 - s)), s = sigmoid(alpha gc).
float clamped_swiglu_backward(const Glu& p, const float* g, const float* u, const float* d, float w, int n, float* dg,
                              float* du) {
  const float L = p.limit, alpha = p.alpha;
  float dot = 0.f;
  for (int i = 0; i < n; ++i) {
    const float gi = g[i] + (p.gate_bias ? p.gate_bias[i] : 0.f), ui = u[i] + (p.up_bias ? p.up_bias[i] : 0.f);
    const float gc = std::min(gi, L), up1 = std::min(std::max(ui, -L), L) + 1.f;
    const float s = 1.f / (1.f + std::exp(-alpha * gc)), act = gc * s;
    dot += d[i] * up1 * act;
    const float dh = w * d[i];
    du[i] = ui >= -L && ui <= L ? dh * act : 0.f;
    dg[i] = gi <= L ? dh * up1 * s * (1.f + alpha * gc * (1.f - s)) : 0.f;
  }
  return dot;
}

// h = silu(g) * u: silu'(g) = s (1 + g (1 - s)), s = sigmoid(g).
float silu_backward(const float* gate_bias, const float* up_bias, const float* g, const float* u, const float* d,
                    float w, int n, float* dg, float* du) {
  float dot = 0.f;
  for (int i = 0; i < n; ++i) {
    const float gi = g[i] + (gate_bias ? gate_bias[i] : 0.f), ui = u[i] + (up_bias ? up_bias[i] : 0.f);
    const float s = 1.f / (1.f + std::exp(-gi)), act = gi * s;
    dot += d[i] * act * ui;
    const float dh = w * d[i];
    du[i] = dh * act;
    dg[i] = dh * ui * s * (1.f + gi * (1.f - s));
  }
  return dot;
}

}  // namespace

float glu_backward(const Glu* glu, const float* g, const float* u, const float* d, float w, int n, float* dg,
                   float* du) {
  if (glu && glu->kind == GluKind::clamped_swiglu) return clamped_swiglu_backward(*glu, g, u, d, w, n, dg, du);
  return silu_backward(glu ? glu->gate_bias : nullptr, glu ? glu->up_bias : nullptr, g, u, d, w, n, dg, du);
}

}  // namespace hmoe
