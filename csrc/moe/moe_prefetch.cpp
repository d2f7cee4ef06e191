// MoeLayer::prefetch: a layer's likely experts read into the caches ahead of the call that needs
// them. In a hybrid decode step the CPU waits for the GPU's attention and router (tens of
// microseconds per layer) and then reads a few MB of experts from DRAM; what it fetched while it
// waited, it reads from its caches instead. Lines another core's L2 holds are slow to read, so
// MoeTuning::prefetch_touch can push them on to the L3 (load + cldemote); the engine does not call
// prefetch yet: fetching a layer's experts takes longer than the gap it would fit in
// (docs/decisions.md).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "moe/moe_layer.h"

namespace hmoe {
namespace {

struct Range {
  const uint8_t* begin;
  size_t bytes;
};

// Every line of [p, p + bytes) touched as `mode` says (MoeTuning::prefetch_touch).
void touch(const uint8_t* p, size_t bytes, int mode) {
  for (size_t off = 0; off < bytes; off += 64) {
    if (mode == 0) __builtin_prefetch(p + off, 0, 2);
    else if (mode == 1) __builtin_prefetch(p + off, 0, 3);
    else (void)*reinterpret_cast<const volatile uint8_t*>(p + off);
#if defined(__x86_64__)
    // A no-op hint where the CPU lacks it (its encoding is a NOP there).
    if (mode == 3) asm volatile("cldemote %0" : : "m"(*reinterpret_cast<const volatile uint8_t*>(p + off)));
#endif
  }
}

}  // namespace

size_t MoeLayer::prefetch(const int* experts, int n) {
  const int S = cfg_.numa_nodes;
  // Items: chunks of each (slice, expert, matrix)'s weight bytes, and its scales (and zeros) as one
  // more; slice s's items first in group s's range, so that each node's workers read their node.
  std::vector<Range> items;
  std::vector<int> offsets{0};
  size_t total = 0;
  for (int s = 0; s < S; ++s) {
    for (int i = 0; i < n; ++i) {
      const int e = experts[i];
      for (const Matrix& m : mats_) {
        const int nb = m.slice_begin[s + 1] - m.slice_begin[s];
        const size_t wbytes = size_t(nb) * block_bytes(cfg_.format, m.Kp);
        const uint8_t* w = m.w[s] + size_t(e) * wbytes;
        for (size_t off = 0; off < wbytes; off += kPrefetchChunk)
          items.push_back({w + off, std::min(kPrefetchChunk, wbytes - off)});
        total += wbytes;
        const size_t sb = scale_bytes(m, nb);
        for (uint8_t* const* side : {&m.scale[s], &m.zero[s]})
          if (*side && sb) {
            items.push_back({*side + size_t(e) * sb, sb});
            total += sb;
          }
      }
    }
    offsets.push_back(int(items.size()));
  }
  if (items.empty()) return 0;
  const int mode = tuning_.prefetch_touch;
  pool_->prewake();
  pool_->run_here([&] {
    pool_->run(offsets, [&](int i, int) { touch(items[i].begin, items[i].bytes, mode); });
  });
  return total;
}

}  // namespace hmoe
