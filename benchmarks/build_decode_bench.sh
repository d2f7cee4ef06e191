#!/usr/bin/env bash
# Builds benchmarks/decode_kernel_rate and decode_engine_loop into OUT against the repo's engine
# sources, each kernel file with the flags the extension gives it (CMakeLists.txt, and nanobind's
# -Os). A variant build takes another AVX-512 kernel file (a patched copy) and/or extra flags for
# it, so two builds of the kernels run side by side without building the extension twice:
#
#   bash benchmarks/build_decode_bench.sh OUT [AVX512_KERNEL_FILE] [EXTRA_KERNEL_FLAGS]
set -euo pipefail
out=$1
kernel=${2:-csrc/moe/moe_kernel_avx512.cpp}
extra=${3:-}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
F="-std=c++17 -O3 -DNDEBUG -fno-stack-protector -Os -I$root/csrc"
X="-mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx512vnni -mfma"
cd "$root"
g++ $F $X $extra -c "$kernel" -o "$out/k512.o" &
g++ $F $X -c csrc/moe/moe_kernel_amx_emulated.cpp -o "$out/kemu.o" &
g++ $F -mamx-tile -mamx-bf16 -mamx-int8 $X -c csrc/moe/moe_kernel_amx.cpp -o "$out/kamx.o" &
g++ $F -mavx2 -mfma -mf16c -c csrc/moe/moe_kernel_avx2.cpp -o "$out/k2.o" &
for f in csrc/moe/moe_kernel_generic.cpp csrc/moe/moe_layer.cpp csrc/moe/pack.cpp csrc/runtime/thread_pool.cpp \
         csrc/runtime/cpu_features.cpp csrc/runtime/read_bandwidth.cpp; do
  g++ $F -c "$f" -o "$out/$(basename "$f" .cpp).o" &
done
wait
for b in decode_kernel_rate decode_engine_loop; do
  g++ $F -o "$out/$b" "benchmarks/$b.cpp" "$out"/*.o -lpthread &
done
wait
