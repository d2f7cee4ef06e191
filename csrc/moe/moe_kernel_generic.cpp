// The reference path: portable C++, built with the compiler's baseline flags, always present.
#include <algorithm>
#include <cmath>

#include "moe/packed.h"

namespace hmoe {
namespace portable_generic {
#include "moe/kernels_portable.inc"
}  // namespace portable_generic

const Kernels& kernels_generic() {
  using namespace portable_generic;
  static const Kernels k{{gemm_bf16, gemm_int8, gemm_int4, gemm_fp8, gemm_mxfp4},
                         {ActKind::bf16, ActKind::i16, ActKind::i16, ActKind::bf16, ActKind::bf16}, kRowOps};
  return k;
}

}  // namespace hmoe
