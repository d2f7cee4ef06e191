// The reference transposed products (backward_kernels.h): portable C++, built with the compiler's baseline flags,
// always present; fp32 vectors, every format.
#include <algorithm>

#include "moe/backward_kernels.h"

namespace hmoe {
namespace transposed_generic {
#include "moe/transposed_portable.inc"
}  // namespace transposed_generic

const BackwardKernels& backward_kernels_generic() {
  using namespace transposed_generic;
  static const BackwardKernels k{{gemm_t_reference<Format::bf16>, gemm_t_reference<Format::int8>,
                                  gemm_t_reference<Format::int4>, gemm_t_reference<Format::fp8>,
                                  gemm_t_reference<Format::mxfp4>},
                                 false};
  return k;
}

}  // namespace hmoe
