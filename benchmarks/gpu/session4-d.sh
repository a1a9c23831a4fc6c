#!/usr/bin/env bash
# Session 4, GPU call D (nvidia-h200-x2, the session's last ~300 s of device time), issue 6's other shapes:
# GPU 0 the 0.8B shape, GPU 1 the 9B shape (HV = 2H), each hf-eager and ht-loop with CUDA graphs at 4096-token
# packs, side by side on split cores (cores 0-15 / 16-31; the CUDA-graph mode is GPU-bound once compiled).
#   HYBRIDTUNE_GIT_COMMIT=<sha> T0=280 bash bench/gpu/session4-d.sh      (carry .whl .cache)
SPLIT=${SPLIT:-15} source bench/gpu/env.sh
T0=${T0:-280}
# 4 layouts, each seen twice in the warm-up: every chunk count has its CUDA graph recorded before the timed steps.
SHORT="--layouts 4 --warmup 8 --steps 12"
( CUDA_VISIBLE_DEVICES=0 timeout $((T0 - 15)) $A0 $HT bench --preset qwen3_5-0.8b --modes ht-loop:cg=on,hf-eager $SHORT \
    --startup-timeout 200 --out-dir "$R/b08-4k" > "$R/gpu0.log" 2>&1; echo "0.8b rc $? at ${SECONDS}s" >> "$R/gpu0.log" ) &
( CUDA_VISIBLE_DEVICES=1 timeout $((T0 - 15)) $A1 $HT bench --preset qwen3_5-9b --modes ht-loop:cg=on,hf-eager $SHORT \
    --startup-timeout 215 --out-dir "$R/b9-4k" > "$R/gpu1.log" 2>&1; echo "9b rc $? at ${SECONDS}s" >> "$R/gpu1.log" ) &
wait
tar czf "$OUT/results.tar.gz" -C "$R" .
for f in "$R"/b*/bench.md; do echo "== $f"; cat "$f"; done; tail -n 3 "$R"/gpu*.log
