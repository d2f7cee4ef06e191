#!/usr/bin/env bash
# The first step of a device call: the GPU host has no package index, so the wheels it lacks travel in an
# ignored folder (default .wheels/, filled on a machine with the network: docs/benchmarks.md); they are
# installed without dependencies, then our native extension is built in place. Prints what the host has.
set -uo pipefail
WHEELS=${1:-.wheels}
export PYTHONUNBUFFERED=1
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  python3 -m pip install --no-index --no-deps -q "$WHEELS"/*.whl 2>&1 | tail -3
fi
python3 -m pip install --no-build-isolation --no-deps -e . -q 2>&1 | tail -3
python3 -c "import hybridmoe._native as n; print('isas', n.available_isas(), 'cpus', n.allowed_cpu_count())"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core"
