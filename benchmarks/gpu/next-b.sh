#!/usr/bin/env bash
# Planned next GPU call (nvidia-h200, one GPU): the 9B shape (HV = 2H), whose cold compile took more than 215 s
# in session 4: ht-loop with CUDA graphs, then hf-eager, 4 layouts each seen twice in the warm-up.
#   HYBRIDTUNE_GIT_COMMIT=<sha> T0=560 bash bench/gpu/next-b.sh      (carry .whl .cache)
source bench/gpu/env.sh
T0=${T0:-560}
timeout $((T0 - 10)) $HT bench --preset qwen3_5-9b --modes ht-loop:cg=on,hf-eager --layouts 4 --warmup 8 --steps 12 \
  --startup-timeout 450 --out-dir "$R/b9-4k" > "$R/gpu0.log" 2>&1; echo "9b rc $? at ${SECONDS}s" >> "$R/gpu0.log"
tar czf "$OUT/results.tar.gz" -C "$R" .
cat "$R/b9-4k/bench.md" 2>/dev/null; tail -n 3 "$R/gpu0.log"
