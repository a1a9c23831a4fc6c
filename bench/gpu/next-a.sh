#!/usr/bin/env bash
# Planned next GPU call (nvidia-h200-x2; cores 0-15 for GPU 0, 16-31 for GPU 1):
# GPU 0: the 2B bench at 4096 tokens: CUDA graphs with the conv traced (the record, 42.1% HFU in session 4) and
#        with FLA's conv op in the graph (NOTES 16: the traced conv is 11.6 ms of 122), then hf-eager. Profiled.
# GPU 1: the CUDA loop tests not yet passed on a GPU (static layout, conv in graph), each stack-dumped past 300 s.
#   HYBRIDTUNE_GIT_COMMIT=<sha> T0=545 bash bench/gpu/next-a.sh      (carry .whl .cache)
SPLIT=${SPLIT:-15} source bench/gpu/env.sh
T0=${T0:-545}
( CUDA_VISIBLE_DEVICES=0 timeout $((T0 - 10)) $A0 $HT bench --modes ${MODES0:-ht-loop:cg=on,ht-loop:cg=on,conv=op,hf-eager} \
    --profile --startup-timeout 240 --out-dir "$R/b2b-4k" > "$R/gpu0.log" 2>&1; echo "2b rc $? at ${SECONDS}s" >> "$R/gpu0.log" ) &
( CUDA_VISIBLE_DEVICES=1 HYBRIDTUNE_FLA_GRANT_FOR_TESTS=0 timeout $((T0 - 10)) $A1 python3 -m pytest -p no:cacheprovider -m cuda \
    -v -rA --durations=0 tests/compiler/test_loop.py -k "static or conv_in_graph" > "$R/pytest_loop_cuda.log" 2>&1
  echo "pytest rc $? at ${SECONDS}s" >> "$R/pytest_loop_cuda.log" ) &
wait
tar czf "$OUT/results.tar.gz" -C "$R" .
cat "$R/b2b-4k/bench.md" 2>/dev/null; grep -E "PASSED|FAILED|ERROR|passed|failed|rc " "$R/pytest_loop_cuda.log" | tail -n 20
