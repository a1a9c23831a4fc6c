#!/usr/bin/env bash
# Final GPU run of session 2 on nvidia-h200-x2, from the repo root with .whl/ (FLA, einops, liger) and .cache/
# (Triton + inductor caches of the first run) carried. CPU cores split between the GPUs (taskset) so one GPU's
# compile workers cannot slow the other's CPU-bound launch path.
# GPU 0: 2B bench at 4096 tokens (hf-eager, ht-loop, ht-modules), then at 16k tokens (hf-eager, ht-loop).
# GPU 1: every CUDA test, a `hybridtune train` smoke on the tiny preset, then the 0.8B bench if time is left.
set -o pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=/tmp/tcache TORCHINDUCTOR_CACHE_DIR=/tmp/icache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src
R=/tmp/res; mkdir -p "$R"
if ls .cache/cache.tar.gz.part-* >/dev/null 2>&1; then cat .cache/cache.tar.gz.part-* | tar xzf - -C /; echo "caches restored"; fi
T0=${T0:-530}
HT="python3 -m hybridtune"
if command -v taskset >/dev/null; then A0="taskset -c 0-15"; A1="taskset -c 16-31"; else A0=""; A1=""; echo "no taskset"; fi
(
  export CUDA_VISIBLE_DEVICES=0
  timeout $((T0 - 200)) $A0 $HT bench --modes hf-eager,ht-loop,ht-modules --profile --startup-timeout 280 \
    --out-dir "$R/b2b-4k" > "$R/gpu0.log" 2>&1; echo "4k rc $?" >> "$R/gpu0.log"
  left=$((T0 - SECONDS - 10))
  timeout $left $A0 $HT bench --modes hf-eager,ht-loop --seq-len 16384 --steps 8 --warmup 2 \
    --startup-timeout $left --out-dir "$R/b2b-16k" >> "$R/gpu0.log" 2>&1; echo "16k rc $?" >> "$R/gpu0.log"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  HYBRIDTUNE_FLA_GRANT_FOR_TESTS=1 timeout ${TEST_T:-330} $A1 python3 -m pytest -p no:cacheprovider -m cuda -v \
    tests/ops tests/models tests/compiler/test_loop.py tests/kernels tests/train tests/bench > "$R/pytest_cuda.log" 2>&1
  echo "pytest rc $?" >> "$R/pytest_cuda.log"
  timeout 120 $A1 $HT train --max_steps 30 --eval_steps 0 --logging_steps 10 \
    --output_dir /tmp/train-smoke > "$R/train_smoke.log" 2>&1; echo "train rc $?" >> "$R/train_smoke.log"
  left=$((T0 - SECONDS - 10))
  [ $left -gt 60 ] && timeout $left $A1 $HT bench --preset qwen3_5-0.8b --modes hf-eager,ht-loop --steps 10 \
    --startup-timeout $left --out-dir "$R/b08b-4k" > "$R/gpu1.log" 2>&1; echo "0.8b rc $?" >> "$R/gpu1.log"
) &
wait
tar czf "$OUT/results.tar.gz" -C "$R" .
for f in "$R"/b*/bench.md; do echo "== $f"; cat "$f"; done
grep -E "passed|failed|error" "$R/pytest_cuda.log" | tail -n 3; tail -n 4 "$R/train_smoke.log"
