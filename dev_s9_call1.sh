#!/usr/bin/env bash
# Session 9, device call 1: build, the merged-deferral tests, then deferral_decode one call vs two calls.
set -uo pipefail
export PYTHONUNBUFFERED=1
PY=python3
echo "== build"; date
( time $PY -m pip install --no-build-isolation --no-deps -e . -q ) 2>&1 | tail -4
$PY -c "import hybridmoe._native as n; print('isas', n.available_isas(), 'cpus', n.allowed_cpu_count())"
echo "== tests"; date
timeout 200 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_cpu_experts_deferred.py \
  tests/hybrid/test_handoff_linked_deferral.py tests/device/test_hybrid_fixed_shapes.py \
  tests/device/test_decode_fused_cuda.py tests/device/test_cuda_handoff.py tests/device/test_cuda_graph.py \
  tests/device/test_decode_staged_handoff.py tests/device/test_hybrid_cuda.py 2>&1 | tail -15
echo "== deferral_decode"; date
cd benchmarks
timeout 330 $PY deferral_decode.py --synthetic qwen3-30b-a3b --layers 12 --formats int4 \
  --variants 0,1:mg,1:nomg,2:mg,2:nomg,3:mg --repeats 2 --gen-len 32 --device cuda --gpu-memory-budget 16GiB \
  --json $OUT/deferral_decode.json 2>&1 | tr '\r' '\n' | grep -v "loading weights"
date
