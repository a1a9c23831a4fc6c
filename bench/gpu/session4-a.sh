#!/usr/bin/env bash
# Session 4, GPU call A (nvidia-h200-x2): cores 0-19 for GPU 0, 20-31 for GPU 1.
# GPU 0: the 2B bench of record at 4096 tokens, profiled: the CUDA-graph variant first (the lever for HFU; its
#        cold compile is the long part), then ht-loop (static layout) and hf-eager, which runs last, when GPU 1's
#        compiles are over.
# GPU 1: the CUDA run of the compiled-loop tests (issue 3), then the 0.8B pair (issue 6).
#   HYBRIDTUNE_GIT_COMMIT=<sha> T0=545 bash bench/gpu/session4-a.sh      (carry .whl .cache)
source bench/gpu/env.sh
T0=${T0:-545}
(
  export CUDA_VISIBLE_DEVICES=0
  timeout $((T0 - SECONDS - 5)) $A0 $HT bench --modes ${MODES0:-ht-loop:cg=on,ht-loop,hf-eager} --profile \
    --startup-timeout ${STARTUP0:-240} --out-dir "$R/b2b-4k" > "$R/gpu0.log" 2>&1; echo "2b rc $?" >> "$R/gpu0.log"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  HYBRIDTUNE_FLA_GRANT_FOR_TESTS=0 timeout 250 $A1 python3 -m pytest -p no:cacheprovider -m cuda -v -rA \
    tests/compiler/test_loop.py > "$R/pytest_loop_cuda.log" 2>&1
  echo "pytest rc $?" >> "$R/pytest_loop_cuda.log"
  timeout $((T0 - SECONDS - 5)) $A1 $HT bench --preset qwen3_5-0.8b --modes hf-eager,ht-loop \
    --startup-timeout 200 --out-dir "$R/b08-4k" > "$R/gpu1.log" 2>&1; echo "0.8b rc $?" >> "$R/gpu1.log"
) &
wait
tar czf "$OUT/results.tar.gz" -C "$R" .
for f in "$R"/b*/bench.md; do echo "== $f"; cat "$f"; done
grep -E "PASSED|FAILED|ERROR|passed|failed|rc " "$R/pytest_loop_cuda.log" | tail -n 20
tail -n 4 "$R"/gpu*.log
