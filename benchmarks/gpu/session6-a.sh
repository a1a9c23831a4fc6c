#!/usr/bin/env bash
# Session 6, GPU call A (nvidia-h200-x2): issue 7's pairs at 8 packs per optimizer step (32k tokens, the same
# global batch on 1 and 2 GPUs), where FSDP2's whole-model unit reduces its gradients once per step; every run
# profiles steps 11-13 (profile_steps 3) and samples its GPUs' clocks. Full fine-tune first (FSDP2 on 2, then
# 1 GPU), then the LoRA pair (DDP) while time is left.
#   HYBRIDTUNE_GIT_COMMIT=<sha> T0=560 bash bench/gpu/session6-a.sh      (carry .whl .cache)
export R=/tmp/dist STEPS=${STEPS:-35} PACKS=${PACKS:-8} PROFILE=${PROFILE:-3}
source bench/gpu/env.sh
T0=${T0:-560}
python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__)" > "$R/versions.txt" 2>&1
left() { echo $((T0 - SECONDS)); }
for phase in ${PHASES:-two-full one-full two-lora one-lora}; do
  t=$(left)
  [ "$t" -gt 100 ] || { echo "skipped $phase: ${t}s left" >> "$R/skipped.txt"; continue; }
  RUN_T=$((t - 10 < 260 ? t - 10 : 260)) bash bench/dist/gpu_dist.sh "$phase" > /dev/null
done
# Each phase leaves $OUT/dist.tar.gz (every log, metrics, profile and GPU-sample file and the table).
cat "$R/table.md"; cat "$R/skipped.txt" 2>/dev/null; tail -n 2 "$R"/*.log
