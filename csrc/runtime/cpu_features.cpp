#include "runtime/cpu_features.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

namespace hmoe {
namespace {

CpuFeatures detect() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(_M_X64)
  unsigned a, b, c, d;
  if (!__get_cpuid_count(1, 0, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27);
  f.fma = c & (1u << 12);
  if (!osxsave) return f;
  unsigned xcr0_lo, xcr0_hi;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  const bool ymm_os = (xcr0_lo & 0x6) == 0x6;
  const bool zmm_os = (xcr0_lo & 0xe6) == 0xe6;
  const bool amx_os = (xcr0_lo & (3u << 17)) == (3u << 17);
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  f.avx2 = ymm_os && (b & (1u << 5));
  f.avx512f = zmm_os && (b & (1u << 16));
  f.avx512bw = zmm_os && (b & (1u << 30));
  f.avx512vl = zmm_os && (b & (1u << 31));
  f.avx512_vnni = zmm_os && (c & (1u << 11));
  f.avx512_fp16 = zmm_os && (d & (1u << 23));
  f.amx_bf16 = amx_os && (d & (1u << 22));
  f.amx_tile = amx_os && (d & (1u << 24));
  f.amx_int8 = amx_os && (d & (1u << 25));
  unsigned a1, b1, c1, d1;
  if (__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)) f.avx512_bf16 = zmm_os && (a1 & (1u << 5));
#endif
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

}  // namespace hmoe
