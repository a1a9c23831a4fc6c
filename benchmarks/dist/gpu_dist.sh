#!/usr/bin/env bash
# tokens/s of `hybridtune train` on 1 and 2 GPUs for the qwen3_5-2b preset (random weights, real shapes),
# 4096-token packs, the same global batch (2 packs per optimizer step) on every GPU count:
#   DDP + LoRA (distributed: auto -> ddp)  and  FSDP2 + full fine-tune (distributed: auto -> fsdp).
# Run from the repo root on nvidia-h200-x2 with .whl/ carried (FLA wheels, as bench/gpu/session2.sh).
# Phases fit the 10-minute command limit; run them in order on one warm machine (caches and data stay in /tmp):
#   bash bench/dist/gpu_dist.sh one        # 1 GPU: LoRA on GPU 0 and full on GPU 1, side by side
#   bash bench/dist/gpu_dist.sh one-lora   # 1 GPU: LoRA alone (one-full: full alone)
#   bash bench/dist/gpu_dist.sh two-lora   # 2 GPUs: DDP + LoRA
#   bash bench/dist/gpu_dist.sh two-full   # 2 GPUs: FSDP2 + full
#   bash bench/dist/gpu_dist.sh table      # the table of all runs so far (also printed after each phase)
#   bash bench/dist/gpu_dist.sh two-full-modules / one-full-modules   # the full pair under --compile modules
# Optional: TWO_FULL_ARGS adds arguments to two-full; STEPS (default 40) optimizer steps, tok/s is the median of the
# logged windows after step 10 (windows holding a profiled step left out); PACKS (default 2) packs per optimizer
# step (the global batch, on every GPU count); PROFILE=N adds profile_steps N (the profile lands as NAME.profile.json).
# Each run's GPUs are sampled once a second (SM clock, power, temperature, utilisation) into NAME.smi.csv.
# A CPU rehearsal of the whole flow (gloo): BASE=tiny-qwen3_5 SEQ=256 STEPS=12 PY=/work/venv/bin/python R=/tmp/d bash ...
set -o pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache TORCHINDUCTOR_CACHE_DIR=/tmp/icache
if [ ! -d /tmp/site ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src
STEPS=${STEPS:-40} BASE=${BASE:-qwen3_5-2b} SEQ=${SEQ:-4096} PY=${PY:-python3} PACKS=${PACKS:-2}
R=${R:-/tmp/dist}; mkdir -p "$R"
DATA=$R/long.jsonl
[ -f "$DATA" ] || $PY bench/dist/make_long_text.py "$DATA" --docs 200 || exit 1
COMMON="--base_model $BASE --dataset $DATA --dataset_type text --sequence_len $SEQ --micro_batch_size 1
  --gradient_accumulation_steps $PACKS --max_steps $STEPS --warmup_steps 5 --logging_steps 5 --val_set_size 0
  --eval_steps 0 --save_total_limit 1 --overwrite --profile_steps ${PROFILE:-0}"

run() {  # name gpus extra-args...
  local name=$1 gpus=$2; shift 2
  local nproc=""; [ "$gpus" = "0,1" ] && nproc="--nproc 2"
  rm -rf "/tmp/out-$name"
  # 1 process: at the limit SIGUSR1 prints its Python stacks (a stall says where), then it is killed.
  # torchrun: SIGTERM, which every rank handles (a killed launcher would orphan its ranks).
  local lim="-s USR1 -k 20 ${RUN_T:-560}"; [ -n "$nproc" ] && lim="-k 30 ${RUN_T:-560}"
  CUDA_VISIBLE_DEVICES=$gpus TORCH_LOGS=${TORCH_LOGS:-recompiles} timeout $lim $PY -m hybridtune train $COMMON --output_dir "/tmp/out-$name" $nproc "$@" \
    > "$R/$name.log" 2>&1 &
  local pid=$! smi=""
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu,utilization.gpu --format=csv \
      -i "$gpus" -lms 1000 > "$R/$name.smi.csv" 2>&1 &
    smi=$!
  fi
  # Once the last step is logged, stop: the final checkpoint (~24 GB for a full fine-tune) is not measured
  # here and would spend the call's time (timeout passes the SIGTERM on to the run).
  while kill -0 $pid 2>/dev/null; do
    if grep -q "^{\"step\": $STEPS," "/tmp/out-$name/metrics.jsonl" 2>/dev/null; then
      kill -TERM $pid 2>/dev/null && echo "last step logged: stopped (the final save is not measured)" >> "$R/$name.log"
      break
    fi
    sleep 1
  done
  wait $pid
  echo "rc $?" >> "$R/$name.log"
  [ -n "$smi" ] && kill $smi 2>/dev/null
  cp "/tmp/out-$name/metrics.jsonl" "$R/$name.metrics.jsonl" 2>/dev/null
  for f in /tmp/out-"$name"/profile-*.json; do [ -f "$f" ] && cp "$f" "$R/$name.profile.json"; done
  rm -rf "/tmp/out-$name"  # full fine-tune checkpoints are ~24 GB each
}

table() { $PY bench/dist/table.py "$R"; }

case "${1:-}" in
  one)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/nvidia-smi.txt"
    $PY -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__)" > "$R/versions.txt"
    run lora-1 0 --adapter lora & run full-1 1 --adapter full & wait ;;
  one-lora) run lora-1 0 --adapter lora ;;  # alone on the machine (the 1-GPU figure of record)
  # torchrun starts each rank with OMP_NUM_THREADS=1; the same for one process (name lora-1t1), to compare like with like
  one-lora-t1) OMP_NUM_THREADS=1 run lora-1t1 0 --adapter lora ;;
  one-full) run full-1 0 --adapter full ;;
  one-full-gpu1) run full-1 1 --adapter full ;;  # the same on GPU 1 (GPU 0 busy with something else)
  two-lora) run lora-2 0,1 --adapter lora ;;
  two-full) run full-2 0,1 --adapter full ${TWO_FULL_ARGS:-} ;;
  # FSDP2 per decoder layer (prefetch overlaps each layer's gather and reduce-scatter with compute) under the
  # per-layer compile, and the same compile on one GPU (its own baseline): names full-2m, full-1m.
  two-full-modules) run full-2m 0,1 --adapter full --compile modules ;;
  one-full-modules) run full-1m 0 --adapter full --compile modules ;;
  table) ;;
  *) echo "usage: $0 one|one-lora|one-lora-t1|one-full|one-full-gpu1|two-lora|two-full|two-full-modules|one-full-modules|table"; exit 2 ;;
esac
table | tee "$R/table.md"
if [ -n "${OUT:-}" ]; then tar czf "$OUT/dist.tar.gz" -C "$R" --exclude long.jsonl .; fi
tail -n 3 "$R"/*.log
