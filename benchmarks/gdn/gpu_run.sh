#!/usr/bin/env bash
# One GPU session: CUDA parity tests, the op error table, the 2B benchmark. Logs and JSON to $OUT.
# Run from the repo root on the GPU machine with .whl/ carried (see docs/GPU.md).
set -o pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
HYBRIDTUNE_FLA_GRANT_FOR_TESTS=1 timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m cuda tests/ops tests/models/test_patch_gdn.py 2>&1 | tail -40 | tee "$OUT/pytest_cuda.log"
timeout ${TABLE_TIMEOUT:-120} python3 bench/gdn/error_table.py --out "$OUT/2026-11-29-gdn-errors.json" 2>&1 | tee "$OUT/error_table.log"
if [ -n "$BENCH" ]; then
  timeout ${BENCH_TIMEOUT:-420} python3 bench/gdn/bench_loop.py --out "$OUT/2026-11-29-gdn-bench.json" --steps ${STEPS:-8} --warmup ${WARMUP:-3} 2>&1 | tee "$OUT/bench.log" | grep -v "^\[" ; tail -3 "$OUT/bench.log"
fi
