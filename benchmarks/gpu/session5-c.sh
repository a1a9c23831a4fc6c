#!/usr/bin/env bash
# Session 5, GPU call C (nvidia-h200-x2): issue 7's full fine-tune under FSDP2 per decoder layer (the per-layer
# compile, `--compile modules`), on 2 GPUs and then on 1 GPU (its own baseline); then, alone, the LoRA 1-GPU
# run whose session-4 figure slowed over its steps (27k -> 22k tok/s), if time is left.
#   HYBRIDTUNE_GIT_COMMIT=<sha> T0=560 bash bench/gpu/session5-c.sh      (carry .whl .cache)
export R=/tmp/dist STEPS=${STEPS:-40}
source bench/gpu/env.sh
T0=${T0:-560}
python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__)" > "$R/versions.txt" 2>&1
RUN_T=200 bash bench/dist/gpu_dist.sh two-full-modules > /dev/null
[ $((T0 - SECONDS)) -gt 80 ] && RUN_T=$(( (T0 - SECONDS - 20) < 170 ? (T0 - SECONDS - 20) : 170 )) bash bench/dist/gpu_dist.sh one-full-modules > /dev/null
[ $((T0 - SECONDS)) -gt 120 ] && RUN_T=$((T0 - SECONDS - 15)) bash bench/dist/gpu_dist.sh one-lora > /dev/null
# Each phase leaves $OUT/dist.tar.gz (every log, metrics file and the table; not the data).
cat "$R/table.md"; tail -n 3 "$R"/*.log
