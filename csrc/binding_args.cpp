#include "binding_args.h"

#include <climits>
#include <stdexcept>
#include <utility>

#include "runtime/cpu_features.h"

namespace hmoe::args {
namespace {

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

}  // namespace

void fail(const std::string& msg) { throw std::invalid_argument(msg); }

int int_arg(int64_t v, const char* name, int64_t lo, int64_t hi) {
  if (v < lo || v > hi)
    fail(std::string(name) + " must be between " + std::to_string(lo) + " and " + std::to_string(hi) + ", got " +
         std::to_string(v));
  return int(v);
}

bool isa_available(Isa isa) {
  const auto& f = cpu_features();
  const bool avx512 = f.avx512f && f.avx512bw && f.avx512vl && f.avx512_bf16 && f.avx512_vnni;
  switch (isa) {
    case Isa::generic: return true;
    case Isa::avx2: return f.avx2 && f.fma;
    case Isa::avx512: return avx512;
    case Isa::amx: return avx512 && f.amx_tile && f.amx_bf16 && amx_request_permission();
    case Isa::amx_emulated: return avx512;  // tests only: never listed, never picked by default
  }
  return false;
}

std::vector<std::string> available_isas() {
  std::vector<std::string> out;
  for (int i = 0; i < 4; ++i)
    if (isa_available(Isa(i))) out.push_back(kIsaNames[i]);
  return out;
}

Isa parse_isa(const std::string& name) {
  if (name.empty()) {
    for (int i = 3; i >= 0; --i)
      if (isa_available(Isa(i))) return Isa(i);
  }
  for (int i = 0; i < 5; ++i)
    if (name == kIsaNames[i]) {
      if (!isa_available(Isa(i)))
        fail("isa '" + name + "' is not supported by this CPU; available: " + join(available_isas()));
      return Isa(i);
    }
  fail("unknown isa '" + name + "'; choose one of: generic, avx2, avx512, amx (available here: " +
       join(available_isas()) + ")");
}

Format parse_format(const std::string& name) {
  for (int i = 0; i < kFormats; ++i)
    if (name == kFormatNames[i]) return Format(i);
  fail("unknown expert format '" + name + "'; choose bf16, int8, int4, fp8 or mxfp4");
}

const MoeTuning& checked_tuning(const MoeTuning& t) {
  for (const auto& [name, value] :
       {std::pair{"item_blocks", t.item_blocks}, std::pair{"item_prefetch", t.item_prefetch},
        std::pair{"kernel_prefetch_l1", t.kernel_prefetch_l1}, std::pair{"kernel_prefetch_l2", t.kernel_prefetch_l2}})
    if (value < 0) fail(std::string(name) + " must be >= 0, got " + std::to_string(value));
  if (t.prefetch_touch < 0 || t.prefetch_touch > 3)
    fail("prefetch_touch must be 0 (prefetcht1), 1 (prefetcht0), 2 (loads) or 3 (loads + cldemote), got " +
         std::to_string(t.prefetch_touch));
  return t;
}

MoeConfig moe_config(int64_t E, int64_t H, int64_t I, const std::string& format, int64_t group_size,
                     bool zero_points, int64_t threads, const std::string& isa, int64_t numa_nodes) {
  if (E < 1 || H < 1 || I < 1)
    fail("expert shapes must be positive, got E=" + std::to_string(E) + " H=" + std::to_string(H) +
         " I=" + std::to_string(I));
  MoeConfig cfg;
  cfg.E = int_arg(E, "E (experts)", 1, INT32_MAX);
  cfg.H = int_arg(H, "H (hidden size)", 1, INT32_MAX);
  cfg.I = int_arg(I, "I (intermediate size)", 1, INT32_MAX);
  cfg.format = parse_format(format);
  cfg.group = int_arg(group_size, "group_size", 1, INT32_MAX);
  cfg.zero_points = zero_points;
  if (cfg.format == Format::int4) {
    if (group_size != 32 && group_size != 64 && group_size != 128)
      fail("int4 group_size must be 32, 64 or 128, got " + std::to_string(group_size));
    if (H % group_size || I % group_size)
      fail("int4 with group_size " + std::to_string(group_size) + " needs hidden size and intermediate size " +
           "divisible by it (got H=" + std::to_string(H) + ", I=" + std::to_string(I) +
           "); pick a group size that divides both, or format='int8'");
  } else if (zero_points) {
    fail("zero points exist only for format='int4'");
  }
  if (cfg.format == Format::mxfp4 && (H % kMxfp4GroupK || I % kMxfp4GroupK))
    fail("mxfp4 needs hidden size and intermediate size divisible by 32, its blocks of one scale (got H=" +
         std::to_string(H) + ", I=" + std::to_string(I) + "); use format='int8' or 'bf16'");
  cfg.threads = int_arg(threads, "threads", 1, kMaxThreads);
  if (numa_nodes < 1 || numa_nodes > threads)
    fail("numa_nodes must be between 1 and threads (" + std::to_string(threads) + "), got " +
         std::to_string(numa_nodes));
  cfg.isa = parse_isa(isa);
  cfg.numa_nodes = int(numa_nodes);
  return cfg;
}

}  // namespace hmoe::args
