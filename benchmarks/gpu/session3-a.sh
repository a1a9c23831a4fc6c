#!/usr/bin/env bash
# Session 3, GPU call A (nvidia-h200-x2): cores 0-19 for GPU 0, 20-31 for GPU 1.
# GPU 0: the 2B bench at 4096 tokens: ht-loop first (its cold compile is the long part), then hf-eager, then
#        ht-loop with CUDA graphs if time is left. Profiled.
# GPU 1: the CUDA tests not yet run on a GPU (models, loop, kernels) first, then the rest (ops, train, bench).
source bench/gpu/env.sh
T0=${T0:-530}
(
  export CUDA_VISIBLE_DEVICES=0
  timeout $((T0 - SECONDS - 5)) $A0 $HT bench --modes ${MODES0:-ht-loop,hf-eager,ht-loop:cg=on} --profile \
    --startup-timeout ${STARTUP0:-400} --out-dir "$R/b2b-4k" > "$R/gpu0.log" 2>&1; echo "4k rc $?" >> "$R/gpu0.log"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  HYBRIDTUNE_FLA_GRANT_FOR_TESTS=1 timeout $((T0 - 20)) $A1 python3 -m pytest -p no:cacheprovider -m cuda -v -rA \
    tests/models tests/compiler/test_loop.py tests/kernels tests/train tests/bench tests/ops > "$R/pytest_cuda.log" 2>&1
  echo "pytest rc $?" >> "$R/pytest_cuda.log"
) &
wait
tar czf "$OUT/results.tar.gz" -C "$R" .
save_cache
for f in "$R"/b*/bench.md; do echo "== $f"; cat "$f"; done
grep -E "PASSED|FAILED|ERROR|passed|failed" "$R/pytest_cuda.log" | tail -n 60
