#!/usr/bin/env bash
# Session 3, GPU call C (nvidia-h200-x2): issue 7's measurements (as call B, which ran out of time: model
# load now 3x faster, 25 steps, per-run limits sized to the call), with the CUDA run of the compiled-loop
# test (issue 3) on GPU 1 beside the 1-GPU phase. Code from .snap/ (see session3-b.sh).
source bench/gpu/env.sh
export PYTHONPATH=/tmp/site:$PWD/.snap/src
export R=/tmp/dist STEPS=${STEPS:-25}; mkdir -p "$R"  # (the call-C record lacked this mkdir: its test log was lost)
cd .snap || exit 1
(CUDA_VISIBLE_DEVICES=1 HYBRIDTUNE_FLA_GRANT_FOR_TESTS=0 timeout ${T_TEST:-180} python3 -m pytest -p no:cacheprovider \
  -m cuda -v -rA tests/compiler/test_loop.py > "$R/pytest_loop_cuda.log" 2>&1; echo "pytest rc $?" >> "$R/pytest_loop_cuda.log") &
RUN_T=${T_ONE:-200} bash bench/dist/gpu_dist.sh one
wait
RUN_T=${T_TWO:-135} bash bench/dist/gpu_dist.sh two-lora
RUN_T=${T_TWO:-135} bash bench/dist/gpu_dist.sh two-full
tail -n 25 "$R/pytest_loop_cuda.log"
