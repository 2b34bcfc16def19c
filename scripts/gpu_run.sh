#!/usr/bin/env bash
# The one device call: GPU tests, then the benchmark. Logs and results go to $OUT.
#   scripts/gpu_run.sh [pytest args...]      (run from the repository root)
set -uo pipefail
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/selective_scan_gpu}"
mkdir -p "$OUT"
{ nvidia-smi; python3 -c "import torch, triton, platform; print('torch', torch.__version__, 'triton', triton.__version__, 'python', platform.python_version(), torch.cuda.get_device_name())"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt" | tail -3
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
timeout "${BENCH_TIMEOUT:-330}" python3 bench/gpu_bench.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -40
