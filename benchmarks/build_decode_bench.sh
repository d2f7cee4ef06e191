#!/usr/bin/env bash
# Builds benchmarks/decode_kernel_rate and decode_engine_loop into OUT against the repo's engine
# sources, each kernel file with the flags the extension gives it (CMakeLists.txt, and nanobind's
# -Os), so the timed code is the shipped code. Each VARIANT (NAME=KERNEL_FILE[@EXTRA_FLAGS], e.g. a
# patched copy of moe_kernel_avx512.cpp, or the same file with other flags) is built beside the
# shipped kernels ("base") into the same binaries, which run every build side by side
# (kernel_variants.h), without building the extension again:
#
#   bash benchmarks/build_decode_bench.sh OUT [NAME=KERNEL_FILE[@EXTRA_FLAGS] ...]
set -euo pipefail
out=$1
shift
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
rm -f "$out"/*.o
F="-std=c++17 -O3 -DNDEBUG -fno-stack-protector -Os -I$root/csrc -I$root/benchmarks"
X="-mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx512vnni -mfma"
cd "$root"
pids=()
names=(base)
g++ $F $X -Dkernels_avx512=kernels_avx512_base -c csrc/moe/moe_kernel_avx512.cpp -o "$out/k512_base.o" & pids+=($!)
for spec in "$@"; do
  name=${spec%%=*}; rest=${spec#*=}; file=${rest%%@*}; flags=""
  [ "$rest" != "$file" ] && flags=${rest#*@}
  names+=("$name")
  g++ $F $X $flags -Dkernels_avx512=kernels_avx512_$name -c "$file" -o "$out/k512_$name.o" & pids+=($!)
done
g++ $F $X -c csrc/moe/moe_kernel_amx_emulated.cpp -o "$out/kemu.o" & pids+=($!)
g++ $F -mamx-tile -mamx-bf16 -mamx-int8 $X -c csrc/moe/moe_kernel_amx.cpp -o "$out/kamx.o" & pids+=($!)
g++ $F -mavx2 -mfma -mf16c -c csrc/moe/moe_kernel_avx2.cpp -o "$out/k2.o" & pids+=($!)
for f in csrc/moe/moe_kernel_generic.cpp csrc/moe/moe_layer.cpp csrc/moe/pack.cpp csrc/runtime/thread_pool.cpp \
         csrc/runtime/cpu_features.cpp csrc/runtime/read_bandwidth.cpp benchmarks/kernel_variants.cpp; do
  g++ $F -c "$f" -o "$out/$(basename "$f" .cpp).o" & pids+=($!)
done
{
  echo '#include "kernel_variants.h"'
  echo 'namespace hmoe {'
  for n in "${names[@]}"; do echo "const Kernels& kernels_avx512_$n();"; done
  echo 'const std::vector<KernelVariant>& kernel_variants() {'
  echo '  static const std::vector<KernelVariant> v{'
  for n in "${names[@]}"; do echo "    {\"$n\", kernels_avx512_$n},"; done
  echo '  };'
  echo '  return v;'
  echo '}'
  echo '}  // namespace hmoe'
} > "$out/kernel_variant_list.cpp"
g++ $F -c "$out/kernel_variant_list.cpp" -o "$out/kernel_variant_list.o" & pids+=($!)
for p in "${pids[@]}"; do wait "$p"; done
pids=()
for b in decode_kernel_rate decode_engine_loop; do
  g++ $F -o "$out/$b" "benchmarks/$b.cpp" "$out"/*.o -lpthread & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
