#!/usr/bin/env bash
# Session 5, GPU call B (nvidia-h200-x2; cores 0-15 for GPU 0, 16-31 for GPU 1).
# GPU 0: the 9B shape (HV = 2H; cold compile > 215 s in session 4): ht-loop under CUDA graphs (conv op), then
#   hf-eager, 4 layouts, each seen twice in the warm-up (one warm-up for both modes: losses on the same steps).
# GPU 1: the 2B shape without CUDA graphs (what `hybridtune train` runs): conv as FLA's op vs traced, and
#   hf-eager for loss parity of record (all three: 3 warm-up steps, 20 timed).
#   HYBRIDTUNE_GIT_COMMIT=<sha> T0=530 bash bench/gpu/session5-b.sh      (carry .whl .cache)
SPLIT=${SPLIT:-15} source bench/gpu/env.sh
T0=${T0:-530}
( CUDA_VISIBLE_DEVICES=0 timeout $((T0 - 15)) $A0 $HT bench --preset qwen3_5-9b --modes ht-loop:cg=on,hf-eager \
    --layouts 4 --warmup 8 --steps 12 --startup-timeout 420 --out-dir "$R/b9-4k" > "$R/gpu0.log" 2>&1
  echo "9b rc $? at ${SECONDS}s" >> "$R/gpu0.log" ) &
( CUDA_VISIBLE_DEVICES=1 timeout $((T0 - 15)) $A1 $HT bench --modes ht-loop:conv=op,ht-loop,hf-eager \
    --startup-timeout 240 --out-dir "$R/b2b-4k-nocg" > "$R/gpu1.log" 2>&1; echo "2b rc $? at ${SECONDS}s" >> "$R/gpu1.log" ) &
wait
tar czf "$OUT/results.tar.gz" -C "$R" .
cat "$R"/b9-4k/bench.md "$R"/b2b-4k-nocg/bench.md 2>/dev/null; tail -n 2 "$R"/gpu*.log
