#pragma once

namespace hmoe {

// What the CPU we run on can execute, read once by cpuid (and, for AMX, whether the
// kernel lets this process use the tile state).
struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512_bf16 = false;
  bool avx512_vnni = false;
  bool avx512_fp16 = false;
  bool amx_tile = false;
  bool amx_bf16 = false;
  bool amx_int8 = false;
};

const CpuFeatures& cpu_features();

}  // namespace hmoe
