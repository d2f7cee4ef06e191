#!/usr/bin/env bash
# On the GPU host (16-core Xeon with AMX): build the native engine, run the AMX device tests and
# the CPU kernel suite, then the MoE layer benchmark for the target table. Everything
# goes to $OUT (logs, JSON); the last lines printed are the tables.
#   OUT=/tmp/out bash scripts/device_check.sh
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

echo "== build"
time $PY -m pip install --no-build-isolation --no-deps -e . -q 2>&1 | tail -5 | tee "$OUT/build.log"
$PY -c "import hybridmoe._native as n; print('features', n.cpu_features()); print('isas', n.available_isas(), 'cpus', n.allowed_cpu_count(), 'numa', n.numa_node_count())" 2>&1 | tee "$OUT/cpu.txt"

echo "== tests"
timeout ${TEST_TIMEOUT:-240} $PY -m pytest tests/device tests/kernels -q -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -12

echo "== benchmarks"
bench() {  # falls back to AVX-512 if the default (AMX) run fails, so a table always comes back
  local name=$1 rc; shift
  timeout "$BENCH_TIMEOUT" $PY benchmarks/moe_layer.py "$@" --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
  rc=$?
  if [ $rc -ne 0 ] && [ $rc -ne 124 ]; then  # not after a timeout: that would only time out again
    timeout "$BENCH_TIMEOUT" $PY benchmarks/moe_layer.py "$@" --isa avx512 --json "$OUT/$name.json" 2>&1 | tee -a "$OUT/$name.log"
  fi
}
# The target table's cells (decode T=1/4 with dirty-cache flushes as before, prefill T=2048),
# then decode again with clean-cache flushes (--flush read; see benchmarks/moe_layer.py).
BENCH_TIMEOUT=${QWEN_TIMEOUT:-150} bench qwen3 --shape qwen3-30b-a3b --tokens ${QWEN_TOKENS:-1,4,2048}
BENCH_TIMEOUT=${DSV3_TIMEOUT:-240} bench dsv3 --shape deepseek-v3 --tokens 1,2048 --reps 15 ${DSV3_EXTRA:-}
BENCH_TIMEOUT=90 bench qwen3_read --shape qwen3-30b-a3b --tokens 1,4 --no-torch --flush read

# CPU/GPU handoff (native host functions on the CUDA stream; its tests ran with tests/device above):
# µs per layer vs a Python host callback and a Python-side synchronize, in the same run.
echo "== cuda handoff"
timeout ${HANDOFF_TIMEOUT:-120} $PY benchmarks/handoff.py --json "$OUT/handoff.json" 2>&1 | tee "$OUT/handoff.log"
