#!/usr/bin/env bash
# Planned next GPU call (nvidia-h200-x2; cores 0-15 for GPU 0, 16-31 for GPU 1): the three forms of the GDN conv
# inside the CUDA-graphed loop (NOTES 16: the traced conv is 11.6 ms of the 2B step's 122 ms of GPU work), 2B
# shape, 4096-token packs, profiled. Each GPU measures its own bf16 peak, so compare HFU, or tokens/s within 2%.
# GPU 0: conv traced (the record: 42.1% HFU in session 4), then conv stacked; GPU 1: conv as FLA's op, then
# hf-eager. Then, if time is left, the CUDA loop tests not yet passed on a GPU (static layout, conv forms).
#   HYBRIDTUNE_GIT_COMMIT=<sha> T0=545 bash bench/gpu/next-a.sh      (carry .whl .cache)
SPLIT=${SPLIT:-15} source bench/gpu/env.sh
T0=${T0:-545}
( CUDA_VISIBLE_DEVICES=0 timeout $((T0 - 10)) $A0 $HT bench --modes ht-loop:cg=on,ht-loop:cg=on,conv=stacked \
    --profile --startup-timeout 240 --out-dir "$R/b2b-4k-gpu0" > "$R/gpu0.log" 2>&1; echo "gpu0 rc $? at ${SECONDS}s" >> "$R/gpu0.log" ) &
( CUDA_VISIBLE_DEVICES=1 timeout $((T0 - 10)) $A1 $HT bench --modes ht-loop:cg=on,conv=op,hf-eager \
    --profile --startup-timeout 240 --out-dir "$R/b2b-4k-gpu1" > "$R/gpu1.log" 2>&1; echo "gpu1 rc $? at ${SECONDS}s" >> "$R/gpu1.log"
  HYBRIDTUNE_FLA_GRANT_FOR_TESTS=0 timeout $((T0 - SECONDS - 10)) $A1 python3 -m pytest -p no:cacheprovider -m cuda \
    -v -rA --durations=0 tests/compiler/test_loop.py -k "static or conv_in_graph" > "$R/pytest_loop_cuda.log" 2>&1
  echo "pytest rc $? at ${SECONDS}s" >> "$R/pytest_loop_cuda.log" ) &
wait
tar czf "$OUT/results.tar.gz" -C "$R" .
cat "$R"/b2b-4k-gpu*/bench.md 2>/dev/null; grep -E "PASSED|FAILED|ERROR|passed|failed|rc " "$R/pytest_loop_cuda.log" | tail -n 20
