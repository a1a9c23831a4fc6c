#!/usr/bin/env bash
# Session 6, GPU call B (nvidia-h200-x2): the LoRA pair that call A had no time for (DDP on 2 GPUs, then 1 GPU),
# 8 packs per optimizer step, profiled at steps 11-13; then the 1-GPU run again with OMP_NUM_THREADS=1, which is
# what torchrun gives each of its ranks (is the host-bound single process slowed by its CPU thread pool?).
#   HYBRIDTUNE_GIT_COMMIT=<sha> T0=560 bash bench/gpu/session6-b.sh      (carry .whl .cache)
PHASES=${PHASES:-"two-lora one-lora one-lora-t1"} exec bash bench/gpu/session6-a.sh
