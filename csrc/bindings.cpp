// The Python module hybridmoe._native. Arrays cross this boundary as checked nb::ndarray
// views; raw pointers exist only below the checks.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/map.h>

#include <map>
#include <string>

#include "runtime/cpu_features.h"

namespace nb = nanobind;

NB_MODULE(_native, m) {
  m.doc() = "hybridmoe native CPU expert engine";
  m.def("cpu_features", [] {
    const auto& f = hmoe::cpu_features();
    return std::map<std::string, bool>{
        {"avx2", f.avx2 && f.fma},     {"avx512f", f.avx512f},         {"avx512bw", f.avx512bw},
        {"avx512vl", f.avx512vl},      {"avx512_bf16", f.avx512_bf16}, {"avx512_vnni", f.avx512_vnni},
        {"avx512_fp16", f.avx512_fp16}, {"amx_tile", f.amx_tile},       {"amx_bf16", f.amx_bf16},
        {"amx_int8", f.amx_int8}};
  }, "What this CPU supports (cpuid, and for AMX whether the OS enables tile state).");
}
