#include "moe/pack_codes.h"

#include <stdexcept>
#include <string>

namespace hmoe {
namespace {

const char* kMats[3] = {"gate", "up", "down"};

// Block b (32 rows from row0) of one matrix into its int4 tiles (packed.h) and its
// [G][32] scales and zero points; rows past N are zero weights.
void pack_block(const CodesMatrix& m, int N, int K, int group, int row0, uint8_t* w, float* scale, float* zero) {
  const int G = K / group;
  for (int r = 0; r < kBlockRows; ++r) {
    const int row = row0 + r;
    const uint8_t* q = row < N ? m.codes + size_t(row) * K : nullptr;
    // One step of 8 K holds, per half of 16 rows, byte 2r+j = k j | k 4+j << 4 and byte
    // 32+2r+j = k 2+j | k 6+j << 4.
    uint8_t* dst = w + (r / 16) * 64 + 2 * (r % 16);
    for (int k = 0; k < K; k += 8, dst += 128) {
      if (!q) {
        dst[0] = dst[1] = dst[32] = dst[33] = 0;
        continue;
      }
      const uint8_t* c = q + k;
      dst[0] = uint8_t(c[0] | c[4] << 4);
      dst[1] = uint8_t(c[1] | c[5] << 4);
      dst[32] = uint8_t(c[2] | c[6] << 4);
      dst[33] = uint8_t(c[3] | c[7] << 4);
    }
    for (int g = 0; g < G; ++g) {
      scale[g * kBlockRows + r] = q ? m.scale[size_t(row) * G + g] : 0.f;
      if (zero) zero[g * kBlockRows + r] = q ? m.zero[size_t(row) * G + g] : 0.f;
    }
  }
}

}  // namespace

void pack_expert_codes(MoeLayer& layer, int e, const CodesMatrix mats[3]) {
  const MoeConfig& cfg = layer.config();
  if (cfg.format != Format::int4)
    throw std::invalid_argument("packing from int4 codes needs format='int4'");
  for (int m = 0; m < 3; ++m)
    if ((mats[m].zero != nullptr) != cfg.zero_points)
      throw std::invalid_argument(cfg.zero_points ? "this int4 layer has zero points: give each matrix's"
                                                  : "this int4 layer has no zero points: give no matrix's");
  const auto bufs = layer.buffers();
  auto find = [&](const std::string& name) {
    for (const auto& b : bufs)
      if (b.name == name) return b;
    throw std::logic_error("no packed buffer " + name);
  };
  for (int m = 0; m < 3; ++m) {
    const int N = m < 2 ? cfg.I : cfg.H, K = m < 2 ? cfg.H : cfg.I;
    for (size_t i = 0; i < size_t(N) * K; ++i)
      if (mats[m].codes[i] > 15)
        throw std::invalid_argument(std::string(kMats[m]) + " code " + std::to_string(mats[m].codes[i]) +
                                    " at " + std::to_string(i) + " is not an int4 code (0..15)");
  }
  for (int m = 0; m < 3; ++m) {
    const int N = m < 2 ? cfg.I : cfg.H, K = m < 2 ? cfg.H : cfg.I;
    const size_t bb = block_bytes(Format::int4, K), sf = size_t(K / cfg.group) * kBlockRows;
    int b0 = 0;  // first global block of slice s
    for (int s = 0; s < cfg.numa_nodes; ++s) {
      const std::string base = std::string(kMats[m]) + "." + std::to_string(s) + ".";
      const PackedBuffer w = find(base + "w"), scale = find(base + "scale");
      float* zero = cfg.zero_points ? static_cast<float*>(find(base + "zero").data) : nullptr;
      const int nb = int(w.bytes / (size_t(cfg.E) * bb));  // blocks of this slice, per expert
      for (int lb = 0; lb < nb; ++lb) {
        const size_t at = size_t(e) * nb + lb;  // this expert's block lb within the slice
        pack_block(mats[m], N, K, cfg.group, (b0 + lb) * kBlockRows, static_cast<uint8_t*>(w.data) + at * bb,
                   static_cast<float*>(scale.data) + at * sf, zero ? zero + at * sf : nullptr);
      }
      b0 += nb;
    }
  }
}

}  // namespace hmoe
