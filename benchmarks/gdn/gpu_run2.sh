#!/usr/bin/env bash
# Second GPU session: op error table first (it warms FLA's autotuning for the real head layouts), then the
# CUDA parity tests. Logs and JSON to $OUT. Run from the repo root with .whl/ carried.
set -o pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import pytest; print('pytest', pytest.__version__)" 2>&1 | tee "$OUT/pytest_cuda.log"
timeout ${TABLE_TIMEOUT:-200} python3 bench/gdn/error_table.py --out "$OUT/2026-11-29-gdn-errors.json" 2>&1 | tee "$OUT/error_table.log"
HYBRIDTUNE_FLA_GRANT_FOR_TESTS=1 timeout ${TEST_TIMEOUT:-120} python3 -m pytest -v -p no:cacheprovider -m cuda -k "not tiny" tests/ops tests/models/test_patch_gdn.py 2>&1 | grep -E "PASS|FAIL|ERROR|SKIP|passed|failed|error" | tail -40 | tee -a "$OUT/pytest_cuda.log"
