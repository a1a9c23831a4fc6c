#!/usr/bin/env bash
# GPU session 2 on nvidia-h200-x2, run from the repo root with .whl/ carried (FLA 0.6.0, einops, liger-kernel).
# GPU 0: the 2B bench (hf-eager, ht-eager, ht-loop), profiled. GPU 1: the CUDA parity tests, a
# `hybridtune train` smoke on the tiny preset, then the 2B bench's ht-modules and hf-liger.
# Everything small comes back in $OUT/results.tar.gz; the Triton and inductor caches in $OUT/cache.tar.gz.part-*.
set -o pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=/tmp/tcache TORCHINDUCTOR_CACHE_DIR=/tmp/icache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src
R=/tmp/res; mkdir -p "$R"
if ls .cache/cache.tar.gz.part-* >/dev/null 2>&1; then cat .cache/cache.tar.gz.part-* | tar xzf - -C /; echo "warm caches restored"; fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/nvidia-smi.txt"
T0=${T0:-540}
(
  export CUDA_VISIBLE_DEVICES=0
  timeout $((T0 - 10)) python3 -m hybridtune bench --modes ${MODES0:-hf-eager,ht-eager,ht-loop} --profile \
    --startup-timeout 300 --out-dir "$R/bench0" ${BENCH0_ARGS:-} > "$R/gpu0.log" 2>&1
  echo "gpu0 rc $?" >> "$R/gpu0.log"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  HYBRIDTUNE_FLA_GRANT_FOR_TESTS=1 timeout ${TEST_T:-220} python3 -m pytest -q -p no:cacheprovider -m cuda -rA \
    tests/ops tests/models tests/compiler/test_loop.py tests/kernels tests/train tests/bench > "$R/pytest_cuda.log" 2>&1
  echo "pytest rc $?" >> "$R/pytest_cuda.log"
  timeout 100 python3 -m hybridtune train --max_steps 40 --eval_steps 20 --logging_steps 10 \
    --output_dir /tmp/train-smoke > "$R/train_smoke.log" 2>&1
  echo "train rc $?" >> "$R/train_smoke.log"
  left=$((T0 - SECONDS - 15))
  timeout $left python3 -m hybridtune bench --modes ${MODES1:-ht-modules,hf-liger} --startup-timeout 240 \
    --out-dir "$R/bench1" ${BENCH1_ARGS:-} > "$R/gpu1.log" 2>&1
  echo "gpu1 rc $?" >> "$R/gpu1.log"
) &
wait
tar czf "$OUT/results.tar.gz" -C "$R" .
[ "${SAVE_CACHE:-1}" = 1 ] && tar czf - -C / tmp/tcache tmp/icache 2>/dev/null | split -b 15M - "$OUT/cache.tar.gz.part-"
ls -la "$OUT"; du -sh /tmp/tcache /tmp/icache
for f in "$R"/bench*/bench.md; do cat "$f"; done
tail -n 5 "$R/pytest_cuda.log" "$R/train_smoke.log"
