// AVX2 + FMA: the portable kernels built with -mavx2 -mfma (see CMakeLists.txt); the
// compiler vectorizes their 32-row inner loops. For CPUs without AVX-512.
#include <algorithm>
#include <cmath>

#include "moe/packed.h"

namespace hmoe {
namespace portable_avx2 {
#include "moe/kernels_portable.inc"
}  // namespace portable_avx2

const Kernels& kernels_avx2() {
  using namespace portable_avx2;
  static const Kernels k{{gemm_bf16, gemm_int8, gemm_int4}, {ActKind::bf16, ActKind::i16, ActKind::i16}, kRowOps};
  return k;
}

}  // namespace hmoe
