#!/usr/bin/env bash
# On a GPU host (a Xeon with AMX, one GPU): build the native engine, run the device tests
# (AMX, CUDA handoff, graphs, hybrid, GPU experts, streamed prefill) and the CPU kernel suite, then
# the benchmarks behind issues #3 and #4 (about 15-20 minutes). Everything goes to $OUT (logs, JSON).
#   OUT=/tmp/out bash scripts/device_check.sh [PART ...]
# PARTs (default all, in this order; the build always runs): tests, cpu (issue #3's layer tables, load RSS),
# gpu (handoff, GPU experts, streamed prefill, decode GPU ops, prefill profile), e2e (issue #4's runs). A
# device call is limited to 10 minutes: run the parts over several calls.
set -uo pipefail
PARTS=${*:-tests cpu gpu e2e}
for part in $PARTS; do
  case $part in tests|cpu|gpu|e2e) ;; *) echo "unknown part '$part' (tests, cpu, gpu, e2e)" >&2; exit 2;; esac
done
wants() { [[ " $PARTS " == *" $1 "* ]]; }
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

echo "== build"
time $PY -m pip install --no-build-isolation --no-deps -e . -q 2>&1 | tail -5 | tee "$OUT/build.log"
$PY -c "import hybridmoe._native as n; print('features', n.cpu_features()); print('isas', n.available_isas(), 'cpus', n.allowed_cpu_count(), 'numa', n.numa_node_count())" 2>&1 | tee "$OUT/cpu.txt"

if wants tests; then
echo "== tests"
timeout ${TEST_TIMEOUT:-240} $PY -m pytest tests/device tests/kernels -q -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -12
fi

echo "== benchmarks"
# Each benchmark prints its table; a timeout cuts one without losing the others. Issue #3's table
# (decode T=1/4 and prefill T=2048 per format; DeepSeek-V3 with 64 of its 256 experts so packing fits),
# the CPU/GPU handoff, the GPU-expert kernel, the PCIe-streamed prefill, then issue #4's end-to-end
# suite on in-memory synthetic models (4 layers, extrapolated to full depth, with the ablation rows).
run() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" 2>&1 | tr '\r' '\n' | grep -v "loading weights" | tee "$OUT/$name.log"; }
if wants cpu; then
run qwen3_layer 60 $PY benchmarks/kernel.py moe-layer --shape qwen3-30b-a3b --tokens 1,4,2048 --reps 15 --json "$OUT/qwen3_layer.json"
run dsv3_layer 90 $PY benchmarks/kernel.py moe-layer --shape deepseek-v3 --experts 64 --tokens 1,4,2048 --no-torch --reps 8 --json "$OUT/dsv3_layer.json"
run load_rss 150 $PY benchmarks/load.py rss --experts 256 --formats bf16,int4 --dir /dev/shm --json "$OUT/load_rss.json"
fi
if wants gpu; then
run handoff 40 $PY benchmarks/kernel.py handoff --layers 48 --tokens 1,4 --json "$OUT/handoff.json"
run gpu_experts 30 $PY benchmarks/kernel.py gpu-experts --shape qwen3-30b-a3b --tokens 1,4,8,16,512 \
    --json "$OUT/gpu_experts.json"
M=/dev/shm/device_check_q3_2
$PY -m hybridmoe.cli make-model --arch qwen3_moe --preset qwen3-30b-a3b --layers 2 --out $M --quiet --force >/dev/null 2>&1
run streamed_prefill 40 $PY benchmarks/prefill.py streamed --shape qwen3-30b-a3b --format int4 --layers 3 --tokens 2048 \
    --reps 2 --model $M --prompt-len 2048 --json "$OUT/streamed_prefill.json"
rm -rf $M
run decode_gpu_ops 60 $PY benchmarks/decode.py gpu-ops --synthetic qwen3-30b-a3b --layers 2 --format int4 \
    --gpu-experts-per-layer 26 --batch 1 --reps 200 --json "$OUT/decode_gpu_ops.json"
run prefill_profile 110 $PY benchmarks/prefill.py profile --synthetic qwen3-30b-a3b --layers 4 --formats int4 \
    --prompt-lens 512,2048 --device cuda --gpu-memory-budget 16GiB --reps 2 --json "$OUT/prefill_profile.json"
fi
if wants e2e; then
run e2e_qwen3 240 $PY benchmarks/e2e.py run --device cuda --gpu-memory-budget 16GiB --synthetic qwen3-30b-a3b --layers 4,12 \
    --formats int4,bf16 --ablation graph,deferral,gpu-experts,trim --prompt-lens 512,2048,8192 --gen-len 64 \
    --json "$OUT/e2e_qwen3.json"
run e2e_dsv3 120 $PY benchmarks/e2e.py run --device cuda --gpu-memory-budget 16GiB --synthetic deepseek-v3 --layers 2 \
    --formats bf16 --prompt-lens 512,2048 --gen-len 16 --json "$OUT/e2e_dsv3.json"
fi
