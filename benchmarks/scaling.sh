#!/usr/bin/env bash
# How does `hybridtune train` scale from 1 to 2 GPUs? tokens/s of the same global batch on 1 and 2 GPUs (torchrun).
#
#   bash benchmarks/scaling.sh PHASE [PHASE ...]
#
# The qwen3_5-2b preset by default (random weights, real shapes) on synthetic long text, $SEQ-token packs, $PACKS
# packs per optimizer step on every GPU count: DDP + LoRA (distributed: auto -> ddp) and FSDP2 + full fine-tune
# (auto -> fsdp). Phases run in order on one machine (caches and data stay in $R); a phase with less than 100 s of
# T0 left is skipped and says so. Each run's figures become a row of $RESULTS (benchmarks/results.jsonl):
# tokens/s is the median of the logged windows after step 10, leaving out a window that holds a profiled step
# (hybridtune.bench.table); the row keeps every window.
#   one               1 GPU: LoRA on GPU 0 and full on GPU 1, side by side (names lora-1, full-1)
#   one-lora          1 GPU: LoRA alone (the 1-GPU figure of record)   one-full, one-full-gpu1: full alone
#   one-lora-t1       1 GPU with OMP_NUM_THREADS=1, as torchrun starts its ranks (lora-1t1)
#   two-lora          2 GPUs: DDP + LoRA (lora-2)                      two-full: FSDP2 + full (full-2)
#   one-full-modules / two-full-modules   the full pair under --compile modules (FSDP2 per decoder layer)
#   table             the table of every run in $R (also printed after each phase)
# Environment: STEPS (40) optimizer steps; PACKS (2) packs per step; SEQ (4096); BASE (qwen3_5-2b); PROFILE=N
#   adds profile_steps N (NAME.profile.json); TWO_FULL_ARGS adds arguments to two-full; RUN_T caps one run (260 s);
#   T0 (560) the whole call; R (/tmp/dist); PY (python3); NO_RESULTS=1: no rows. A run stops once its last step is
#   logged (the final checkpoint, ~24 GB for a full fine-tune, is not measured). Each run's GPUs are sampled once a
#   second (SM clock, power, temperature, utilisation) into $R/NAME.smi.csv.
# The questions asked so far:
#   PACKS=8 STEPS=35 PROFILE=3 bash benchmarks/scaling.sh two-full one-full two-lora one-lora   # the figures of record
#   PACKS=8 STEPS=35 PROFILE=3 bash benchmarks/scaling.sh two-lora one-lora one-lora-t1         # thread pool or not
#   bash benchmarks/scaling.sh two-full-modules one-full-modules                                # FSDP2 per layer
# A CPU rehearsal of the whole flow (gloo):
#   BASE=tiny-qwen3_5 SEQ=256 STEPS=12 PY=.venv/bin/python R=/tmp/d bash benchmarks/scaling.sh one-lora table
[ $# -ge 1 ] || { sed -n '2,/^$/s/^# \{0,1\}//p' "$0"; exit 2; }
R=${R:-/tmp/dist}
source "$(dirname "$0")/env.sh"
PY=${PY:-python3} STEPS=${STEPS:-40} BASE=${BASE:-qwen3_5-2b} SEQ=${SEQ:-4096} PACKS=${PACKS:-2} T0=${T0:-560}
COMMAND="PACKS=$PACKS STEPS=$STEPS SEQ=$SEQ BASE=$BASE PROFILE=${PROFILE:-0}${TWO_FULL_ARGS:+ TWO_FULL_ARGS='$TWO_FULL_ARGS'} bash benchmarks/scaling.sh $*"
DATA=$R/long.jsonl
[ -f "$DATA" ] || $PY benchmarks/make_long_text.py "$DATA" --docs 200 || exit 1
COMMON="--base_model $BASE --dataset $DATA --dataset_type text --sequence_len $SEQ --micro_batch_size 1
  --gradient_accumulation_steps $PACKS --max_steps $STEPS --warmup_steps 5 --logging_steps 5 --val_set_size 0
  --eval_steps 0 --save_total_limit 1 --overwrite --profile_steps ${PROFILE:-0}"

run() {  # run NAME GPUS ARGS...
  local name=$1 gpus=$2; shift 2
  local nproc=""; [ "$gpus" = "0,1" ] && nproc="--nproc 2"
  local left=$((T0 - SECONDS - 10)); local cap=${RUN_T:-260}; [ "$left" -lt "$cap" ] && cap=$left
  rm -rf "/tmp/out-$name"
  # 1 process: at the limit SIGUSR1 prints its Python stacks (a stall says where), then it is killed.
  # torchrun: SIGTERM, which every rank handles (a killed launcher would orphan its ranks).
  local lim="-s USR1 -k 20 $cap"; [ -n "$nproc" ] && lim="-k 30 $cap"
  CUDA_VISIBLE_DEVICES=$gpus TORCH_LOGS=${TORCH_LOGS:-recompiles} timeout $lim $PY -m hybridtune train $COMMON \
    --output_dir "/tmp/out-$name" $nproc "$@" > "$R/$name.log" 2>&1 &
  local pid=$! smi=""
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu,utilization.gpu --format=csv \
      -i "$gpus" -lms 1000 > "$R/$name.smi.csv" 2>&1 &
    smi=$!
  fi
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
  [ "${NO_RESULTS:-0}" = 1 ] || $PY -m hybridtune.bench.results --table "$RESULTS" add-train "$R" "$name" \
    --command "$COMMAND" --shape "$BASE" --seq-len "$SEQ" --packs "$PACKS"
}

for phase in "$@"; do
  if [ "$phase" != table ] && [ $((T0 - SECONDS)) -le 100 ]; then
    echo "skipped $phase: $((T0 - SECONDS))s left" | tee -a "$R/skipped.txt"; continue
  fi
  case $phase in
    one) run lora-1 0 --adapter lora & run full-1 1 --adapter full & wait ;;
    one-lora) run lora-1 0 --adapter lora ;;
    one-lora-t1) OMP_NUM_THREADS=1 run lora-1t1 0 --adapter lora ;;
    one-full) run full-1 0 --adapter full ;;
    one-full-gpu1) run full-1 1 --adapter full ;;
    two-lora) run lora-2 0,1 --adapter lora ;;
    two-full) run full-2 0,1 --adapter full ${TWO_FULL_ARGS:-} ;;
    two-full-modules) run full-2m 0,1 --adapter full --compile modules ;;
    one-full-modules) run full-1m 0 --adapter full --compile modules ;;
    table) ;;
    *) echo "unknown phase '$phase': one, one-lora, one-lora-t1, one-full, one-full-gpu1, two-lora, two-full," \
         "one-full-modules, two-full-modules, table"; exit 2 ;;
  esac
  $PY -m hybridtune.bench.table "$R" | tee "$R/table.md"
done
finish
tail -n 3 "$R"/*.log; cat "$R/skipped.txt" 2>/dev/null
exit 0
