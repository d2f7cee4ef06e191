// kernels_avx512() of the decode benchmarks: the selected kernel build (kernel_variants.h).
#include "kernel_variants.h"

namespace hmoe {
namespace {
int selected = 0;
}  // namespace

void select_kernel_variant(int i) { selected = i; }

const Kernels& kernels_avx512() { return kernel_variants()[selected].kernels(); }

}  // namespace hmoe
