#!/usr/bin/env bash
# Session 3, GPU call B (nvidia-h200-x2): issue 7's measurements in one call, code from .snap/ (a clean
# `git archive` of the commit named in HYBRIDTUNE_GIT_COMMIT, so edits in progress in the tree do not travel).
# 1 GPU (LoRA on GPU 0, full on GPU 1, side by side), then DDP + LoRA on 2, then FSDP2 + full on 2.
source bench/gpu/env.sh
export PYTHONPATH=/tmp/site:$PWD/.snap/src
export R=/tmp/dist STEPS=${STEPS:-30}
cd .snap || exit 1
cp -r ../.whl . 2>/dev/null
RUN_T=${T_ONE:-250} bash bench/dist/gpu_dist.sh one
RUN_T=${T_TWO:-130} bash bench/dist/gpu_dist.sh two-lora
RUN_T=${T_TWO:-130} bash bench/dist/gpu_dist.sh two-full
