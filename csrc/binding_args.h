#pragma once
// What both binding files (bindings.cpp, cuda_host_bindings.cpp) take from Python the same way:
// ISA and format names, a checked MoeConfig and a checked MoeTuning. Bad values throw std::invalid_argument
// (nanobind turns it into ValueError) with a message that says what to pass instead.
#include <nanobind/ndarray.h>

#include <string>
#include <vector>

#include "moe/moe_layer.h"

namespace hmoe::args {

inline const char* const kIsaNames[] = {"generic", "avx2", "avx512", "amx", "amx_emulated"};
inline const char* const kFormatNames[] = {"bf16", "int8", "int4"};
inline const nanobind::dlpack::dtype kBf16{uint8_t(nanobind::dlpack::dtype_code::Bfloat), 16, 1};

[[noreturn]] void fail(const std::string& msg);

bool isa_available(Isa isa);
std::vector<std::string> available_isas();  // slowest first
Isa parse_isa(const std::string& name);     // "" picks the fastest this CPU has
Format parse_format(const std::string& name);

// t itself if every field is in range (counts and bytes >= 0, prefetch_touch 0 to 3).
const MoeTuning& checked_tuning(const MoeTuning& t);

// Shapes, format, group size, zero points, threads and NUMA groups checked together.
MoeConfig moe_config(int E, int H, int I, const std::string& format, int group_size, bool zero_points,
                     int threads, const std::string& isa, int numa_nodes);

}  // namespace hmoe::args
