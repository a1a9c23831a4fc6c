#!/usr/bin/env bash
# Session 4, GPU call B (nvidia-h200-x2), issue 7: tokens/s of `hybridtune train` (qwen3_5-2b preset, 4096-token
# packs, 2 packs per optimizer step on any GPU count) on 1 and 2 GPUs, one run at a time so none shares the CPUs.
# The 2-GPU run of each pair goes first: its ranks compile cold side by side; the 1-GPU run after it finds the
# inductor and Triton caches warm and spends the call's time on steps. Limits per run in seconds (a 1-process
# run gets 20 s more for its stack dump).
#   HYBRIDTUNE_GIT_COMMIT=<sha> bash bench/gpu/session4-b.sh      (carry .whl .cache)
source bench/gpu/env.sh
export R=/tmp/dist STEPS=${STEPS:-40}
RUN_T=${T_LORA2:-200} bash bench/dist/gpu_dist.sh two-lora > /dev/null
RUN_T=${T_LORA1:-90} bash bench/dist/gpu_dist.sh one-lora > /dev/null
RUN_T=${T_FULL2:-130} bash bench/dist/gpu_dist.sh two-full > /dev/null
RUN_T=$((${T0:-555} - SECONDS - 30)) bash bench/dist/gpu_dist.sh one-full
