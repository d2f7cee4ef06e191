#!/usr/bin/env bash
# Session 9, device call 2: the merged deferral with per-side item sizes.
set -uo pipefail
export PYTHONUNBUFFERED=1
PY=python3
echo "== build"; date
( time $PY -m pip install --no-build-isolation --no-deps -e . -q ) 2>&1 | tail -4
echo "== tests"; date
timeout 150 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_cpu_experts_deferred.py \
  tests/hybrid/test_handoff_linked_deferral.py tests/device/test_hybrid_fixed_shapes.py \
  tests/device/test_decode_staged_handoff.py tests/device/test_cuda_graph.py 2>&1 | tail -8
echo "== deferral_decode"; date
cd benchmarks
timeout 300 $PY deferral_decode.py --synthetic qwen3-30b-a3b --layers 12 --formats int4 \
  --variants 0,1,2,3,2:nomg,4 --repeats 3 --gen-len 32 --device cuda --gpu-memory-budget 16GiB \
  --json $OUT/deferral_decode.json 2>&1 | tr '\r' '\n' | grep -v "loading weights" | grep -v "^    round"
date
