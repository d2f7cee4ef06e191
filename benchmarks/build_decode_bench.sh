#!/usr/bin/env bash
# Builds benchmarks/decode_kernel_rate and decode_engine_loop into OUT against the repo's engine
# sources, each file with the compile command the extension's build gives it, so the timed code is
# the shipped code. The commands come from CMake itself (a configure-only run of CMakeLists.txt,
# Release as pyproject.toml's cmake.build-type, exporting compile_commands.json: nanobind's -Os,
# -fPIC, each kernel file's ISA flags and the AMX file's -O3 included), never a copy kept here.
# The benchmarks' own files take moe_layer.cpp's command (the module's baseline flags). Each
# VARIANT (NAME=KERNEL_FILE[@EXTRA_FLAGS], e.g. a patched copy of moe_kernel_avx512.cpp, or the
# same file with other flags appended) is built with moe_kernel_avx512.cpp's command beside the
# shipped kernels ("base") into the same binaries, which run every build side by side
# (kernel_variants.h), without building the extension again:
#
#   bash benchmarks/build_decode_bench.sh OUT [NAME=KERNEL_FILE[@EXTRA_FLAGS] ...]
set -euo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd)
shift
root=$(cd "$(dirname "$0")/.." && pwd)
rm -f "$out"/*.o
cmake -S "$root" -B "$out/cmake" -DCMAKE_BUILD_TYPE=Release -DCMAKE_EXPORT_COMPILE_COMMANDS=ON \
  -DPython_EXECUTABLE="$(command -v python3)" >/dev/null
# compile[SOURCE]: its command from compile_commands.json, without the output, the source and the
# dependency-file options (the calls below add their own); words without blanks, so $cmd splits right.
python3 - "$out/cmake/compile_commands.json" > "$out/compile_commands.tsv" <<'EOF'
import json, os, shlex, sys

for entry in json.load(open(sys.argv[1])):
    args = entry.get("arguments") or shlex.split(entry["command"])
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("-o", "-c", "-MT", "-MF"):
            skip = True
        elif a not in ("-MD", "-MMD"):
            kept.append(a)
    if any(c.isspace() for a in kept for c in a):
        sys.exit(f"build_decode_bench.sh: a blank inside an option of {entry['file']}'s command: {kept}")
    print(f"{os.path.realpath(entry['file'])}\t{' '.join(kept)}")
EOF
declare -A compile
while IFS=$'\t' read -r src cmd; do compile[$src]=$cmd; done < "$out/compile_commands.tsv"
cmd_of() {
  local c=${compile[$root/$1]:-}
  [ -n "$c" ] || { echo "build_decode_bench.sh: CMakeLists.txt does not build $1" >&2; exit 1; }
  echo "$c"
}
k512=$(cmd_of csrc/moe/moe_kernel_avx512.cpp)
bench="$(cmd_of csrc/moe/moe_layer.cpp) -I$root/benchmarks"
cd "$root"
pids=()
names=(base)
$k512 -Dkernels_avx512=kernels_avx512_base -c csrc/moe/moe_kernel_avx512.cpp -o "$out/k512_base.o" & pids+=($!)
for spec in "$@"; do
  name=${spec%%=*}; rest=${spec#*=}; file=${rest%%@*}; flags=""
  [ "$rest" != "$file" ] && flags=${rest#*@}
  names+=("$name")
  $k512 $flags -Dkernels_avx512=kernels_avx512_$name -c "$file" -o "$out/k512_$name.o" & pids+=($!)
done
for f in csrc/moe/moe_kernel_amx_emulated.cpp csrc/moe/moe_kernel_amx.cpp csrc/moe/moe_kernel_avx2.cpp \
         csrc/moe/moe_kernel_generic.cpp csrc/moe/moe_layer.cpp csrc/moe/pack.cpp csrc/runtime/thread_pool.cpp \
         csrc/runtime/cpu_features.cpp csrc/runtime/read_bandwidth.cpp; do
  c=$(cmd_of "$f")
  $c -c "$f" -o "$out/$(basename "$f" .cpp).o" & pids+=($!)
done
$bench -c benchmarks/kernel_variants.cpp -o "$out/kernel_variants.o" & pids+=($!)
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
$bench -c "$out/kernel_variant_list.cpp" -o "$out/kernel_variant_list.o" & pids+=($!)
for p in "${pids[@]}"; do wait "$p"; done
pids=()
for b in decode_kernel_rate decode_engine_loop; do
  $bench -o "$out/$b" "benchmarks/$b.cpp" "$out"/*.o -lpthread & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
