#!/usr/bin/env bash
# Session 16, call 1: AMX streaming stores / interleaved loads, side by side on the host.
set -uo pipefail
L=$OUT/log.txt
exec > >(tee -a $L) 2>&1
export PYTHONUNBUFFERED=1
date
nproc; lscpu | grep -i "model name\|L2\|L3\|MHz" 
time python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3
python3 -c "import hybridmoe._native as n; print(n.cpu_features(), n.available_isas())"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/device/test_amx_experts.py tests/kernels 2>&1 | tail -3
V='old=amx_stream:0,amx_interleave:0;nt=amx_stream:1,amx_interleave:0;ntil=amx_stream:1,amx_interleave:1'
echo "== qwen3 A/B"
timeout 200 python3 benchmarks/moe_layer.py --shape qwen3-30b-a3b --format bf16,int8,int4 --tokens 512,2048 --gap-us 0 \
  --layers 2 --variants "$V" --api forward --budget-s 3 --reps 12 --no-torch --json $OUT/q3_ab.json 2>&1 | tail -25
echo "== dsv3-64 A/B"
timeout 240 python3 benchmarks/moe_layer.py --shape deepseek-v3 --experts 64 --format int4,int8,bf16 --tokens 2048 --gap-us 0 \
  --layers 2 --variants "$V" --api forward --budget-s 3 --reps 6 --no-torch --json $OUT/dsv3_ab.json 2>&1 | tail -20
echo "== qwen3 split (defaults)"
timeout 90 python3 benchmarks/moe_prefill_sweep.py --shape qwen3-30b-a3b --format int4,bf16 --experts all --split 2>&1 | tail -6
date
