#pragma once
// What both binding files (bindings.cpp, cuda_host_bindings.cpp) take from Python the same way:
// ISA and format names, integers in range, a checked MoeConfig and a checked MoeTuning. Bad values
// throw std::invalid_argument (nanobind turns it into ValueError) with a one-line message that names
// the argument and says what to pass instead. Integers cross as int64_t and are narrowed here, so a
// value past int's range gets that message too, not nanobind's list of signatures.
#include <nanobind/ndarray.h>

#include <cstdint>
#include <string>
#include <vector>

#include "moe/moe_layer.h"

namespace hmoe::args {

inline const char* const kIsaNames[] = {"generic", "avx2", "avx512", "amx", "amx_emulated"};
inline const char* const kFormatNames[] = {"bf16", "int8", "int4", "fp8", "mxfp4"};
inline const nanobind::dlpack::dtype kBf16{uint8_t(nanobind::dlpack::dtype_code::Bfloat), 16, 1};

// The most threads one pool may have (hybridmoe.experts.cpu_experts.MAX_THREADS).
constexpr int kMaxThreads = 1024;

[[noreturn]] void fail(const std::string& msg);

// v as an int if lo <= v <= hi; else fails with "<name> must be between lo and hi, got v".
int int_arg(int64_t v, const char* name, int64_t lo, int64_t hi);

bool isa_available(Isa isa);
std::vector<std::string> available_isas();  // slowest first
Isa parse_isa(const std::string& name);     // "" picks the fastest this CPU has
Format parse_format(const std::string& name);

// t itself if every field is in range (counts and bytes >= 0, prefetch_touch 0 to 3).
const MoeTuning& checked_tuning(const MoeTuning& t);

// Shapes, format, group size, zero points, threads (1 to kMaxThreads) and NUMA groups checked together.
MoeConfig moe_config(int64_t E, int64_t H, int64_t I, const std::string& format, int64_t group_size,
                     bool zero_points, int64_t threads, const std::string& isa, int64_t numa_nodes);

}  // namespace hmoe::args
