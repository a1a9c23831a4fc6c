#!/usr/bin/env bash
# Session 4, GPU call C (nvidia-h200-x2): issue 7's full fine-tune pair and issue 6's CUDA-graph bench with the
# static layout that leaves the chunk count free (less filler). Cores 0-15 for GPU 0, 16-31 for GPU 1.
# Phase 1, side by side (both compile cold): GPU 0 `hybridtune bench --modes ht-loop:cg=on,hf-eager`, GPU 1 the
#   1-GPU full fine-tune. The logs' timestamps say whether their timed steps overlapped.
# Phase 2, alone: the 2-GPU FSDP2 full fine-tune (caches warm from phase 1's run of the same graph).
#   HYBRIDTUNE_GIT_COMMIT=<sha> T0=555 bash bench/gpu/session4-c.sh      (carry .whl .cache)
SPLIT=${SPLIT:-15} source bench/gpu/env.sh
T0=${T0:-555}
export STEPS=${STEPS:-40}
(
  export CUDA_VISIBLE_DEVICES=0
  timeout ${T_BENCH:-300} $A0 $HT bench --modes ${MODES0:-ht-loop:cg=on,hf-eager} --profile --startup-timeout 240 \
    --out-dir "$R/b2b-4k" > "$R/gpu0.log" 2>&1; echo "2b rc $? at ${SECONDS}s" >> "$R/gpu0.log"
) &
(
  R=/tmp/dist RUN_T=${T_FULL1:-260} PY="$A1 python3" bash bench/dist/gpu_dist.sh one-full-gpu1 > /dev/null
) &
wait
R=/tmp/dist RUN_T=$((T0 - SECONDS - 40)) bash bench/dist/gpu_dist.sh two-full > /dev/null
mkdir -p "$R/dist" && cp /tmp/dist/*.log /tmp/dist/*.jsonl /tmp/dist/*.md "$R/dist/" 2>/dev/null
rm -f "$R/dist/long.jsonl"
tar czf "$OUT/results.tar.gz" -C "$R" .
cat "$R/b2b-4k/bench.md" 2>/dev/null; cat "$R/dist/table.md"; tail -n 3 "$R"/gpu0.log "$R"/dist/*.log
