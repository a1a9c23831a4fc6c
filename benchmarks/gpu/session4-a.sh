#!/usr/bin/env bash
# Session 4, GPU call A (nvidia-h200, one GPU, 16 cores): cores 0-10 for the bench, 11-15 for the tests.
# The 2B bench of record at 4096 tokens, profiled: the CUDA-graph variant first (the lever for HFU; its cold
# compile is the long part), then ht-loop (static layout) and hf-eager. Beside the first mode's compile, on the
# other cores and the same GPU (tiny models): the CUDA run of the compiled-loop tests (issue 3). So ht-loop and
# hf-eager run alone; the CUDA-graph mode's timed steps may overlap the tests' end (its log says when).
#   HYBRIDTUNE_GIT_COMMIT=<sha> T0=545 bash bench/gpu/session4-a.sh      (carry .whl .cache)
SPLIT=${SPLIT:-10} source bench/gpu/env.sh
T0=${T0:-545}
(
  timeout $((T0 - SECONDS - 5)) $A0 $HT bench --modes ${MODES0:-ht-loop:cg=on,ht-loop,hf-eager} --profile \
    --startup-timeout ${STARTUP0:-240} --out-dir "$R/b2b-4k" > "$R/gpu0.log" 2>&1; echo "2b rc $? at ${SECONDS}s" >> "$R/gpu0.log"
) &
(
  HYBRIDTUNE_FLA_GRANT_FOR_TESTS=0 timeout 250 $A1 python3 -m pytest -p no:cacheprovider -m cuda -v -rA \
    tests/compiler/test_loop.py > "$R/pytest_loop_cuda.log" 2>&1
  echo "pytest rc $? at ${SECONDS}s" >> "$R/pytest_loop_cuda.log"
) &
wait
tar czf "$OUT/results.tar.gz" -C "$R" .
for f in "$R"/b*/bench.md; do echo "== $f"; cat "$f"; done
grep -E "PASSED|FAILED|ERROR|passed|failed|rc " "$R/pytest_loop_cuda.log" | tail -n 20
tail -n 4 "$R"/gpu*.log
