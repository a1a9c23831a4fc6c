#!/usr/bin/env bash
# How fast is one training step on one GPU? `hybridtune bench` (modes x shapes), one lane per GPU side by side.
#
#   bash benchmarks/single_gpu.sh LANE [LANE ...]
#
# Lane I runs on GPU I (LANES_ON_ONE_GPU=1: every lane on GPU 0, e.g. CUDA tests beside a bench on a one-GPU
# machine) with its share of the host's cores (CPUS_<I>="0-10" sets it), so one lane's compile workers do not slow
# another's host-bound launch path. A lane is a list of jobs joined by " then ", run one after another:
#   bench ARGS...   hybridtune bench ARGS; each mode becomes a row of $RESULTS (benchmarks/results.jsonl)
#   tests ARGS...   pytest -m cuda ARGS (HYBRIDTUNE_FLA_GRANT_FOR_TESTS=$GRANT, default 0)
#   train-smoke     hybridtune train on the tiny preset, 30 steps (the GPU training path end to end)
#   train NAME ARGS hybridtune train ARGS on $R/long.jsonl (long documents, made once) into /tmp/out-NAME; NAME.log
#                   and NAME.metrics.jsonl land in $R and become a row of $RESULTS (add-train: NAME is lora-1 or
#                   full-1 with a variant tail, e.g. lora-1cold -> mode train:cold; shape, sequence length and
#                   packs per step read from ARGS' --base_model, --sequence_len, --micro_batch_size x
#                   --gradient_accumulation_steps; its first_step_s is the first step's wall time, compiling included)
# Every job gets the seconds left of T0 (default 560) less 10; a job with 30 s or less left is skipped and says so.
# STARTUP (default 400) is each bench's --startup_timeout unless the lane names its own. NO_RESULTS=1: no rows (add
# them here later: python -m hybridtune.bench.results add-train DIR NAME --provenance DIR/provenance.json ...);
# NOTE="..." is the note of every train row (say so when lanes share one GPU: such figures are not of record).
# LANE_CACHES=1: each lane its own empty compile and self-test caches, so that lanes side by side each start cold
# (a regional against an inlined first step, say).
# With OUT set (a lent machine): the work folder, logs and bench.json files come back in $OUT/work.tar.gz and the
# table in $OUT/results.jsonl (take its new rows, or add a bench.json here: python -m hybridtune.bench.results
# add-bench FILE); SAVE_CACHE=1 also returns the compile caches for the next call's .cache/.
#
# The questions asked so far, as lanes (a hybridtune mode's options are `hybridtune train`'s keys; the short
# spellings of earlier rows, cg=on, regions=on, sac=on, gc=off, layout=, still parse to them):
#   modes of record, 2B, 4096 tokens:  "bench --modes hf-eager,ht-loop:cuda_graphs=on --profile"
#   conv forms (x2):                    "bench --modes ht-loop:cuda_graphs=on,conv=traced,ht-loop:cuda_graphs=on,conv=stacked --profile"
#                                       "bench --modes ht-loop:cuda_graphs=on,conv=op,hf-eager --profile"
#   no CUDA graphs (train's step):      "bench --modes ht-loop:conv=op,ht-loop,hf-eager"
#   0.8B / 9B (x2, 4 layouts each seen twice in the warm-up):
#     "bench --base_model qwen3_5-0.8b --modes ht-loop:cuda_graphs=on,hf-eager --layouts 4 --warmup 8 --steps 12"
#     "bench --base_model qwen3_5-9b --modes ht-loop:cuda_graphs=on,hf-eager --layouts 4 --warmup 8 --steps 12 --startup_timeout 450"
#   16k-token packs:                    "bench --modes hf-eager,ht-loop --sequence_len 16384 --steps 8 --warmup 2"
#   CUDA tests beside a bench:          "bench ... then tests tests/compiler/test_loop.py -k static"
#   cold first step, regional vs inlined (LANE_CACHES=1 LANES_ON_ONE_GPU=1, two lanes):
#     "bench --modes ht-loop:cuda_graphs=on,compile_regions=true --steps 8" "bench --modes ht-loop:cuda_graphs=on --steps 8"
#   MoE, all 40 layers, regional, in a call of its own (STARTUP=500). Rows 77 and 82 came from two calls: hf-eager
#   first took 232 s (its first step 123 s, FLA's kernels cold) and left the cold compiled mode too little; the
#   compiled mode first warms FLA's kernels for hf-eager after it:
#     "bench --base_model qwen3_5-35b-a3b --modes ht-loop:cuda_graphs=on,compile_regions=true,hf-eager --lora_target_parameters
#      gate_up_proj,down_proj --warmup 3 --steps 10 --profile"
#   Qwen3-Next-80B-A3B cut to half depth (24 layers, ~80 GB of bf16 weights), the same pair:
#     "bench --base_model qwen3_next-80b-a3b@layers=24 --modes ht-loop:cuda_graphs=on,compile_regions=true,hf-eager
#      --lora_target_parameters gate_up_proj,down_proj --warmup 3 --steps 10 --profile"
#   CUDA regional tests (5 passed, 2026-12-02, the first case 280 s cold; rows 83-86 came from the MoE pairs above):
#     "tests tests/compiler/test_loop_regions.py -k cuda"
#   Done 2026-12-02 (rows 87-92): train cold/warm, the shipped FLA table on a fresh machine, 131k, 9B regional, the
#   CUDA-graph step with regions (4 passed; the trainer cases were cut). Next, on a fresh machine (every cache cold
#   but the shipped table), the region-schema memo's first step (predicted 2B about 60-65 s, NOTES 45), then the 9B,
#   then the CUDA regional tests under the memo and the trainer cases:
#     "bench --modes ht-loop:cuda_graphs=on,compile_regions=true --steps 8 then bench --base_model qwen3_5-9b --modes
#      ht-loop:cuda_graphs=on,compile_regions=true --layouts 4 --warmup 8 --steps 12"
#     "tests tests/compiler/test_loop_regions.py -k cuda then tests tests/runtime/test_cuda_graphs_gpu.py -k trainer"
#   (a tests lane's -k takes one word: the lane splits on spaces)
#   Done 2026-12-02 (session 15, rows 93-98): the memo's cold first step (2B 50.5 s, 9B 70.6 s), the GDN cores kept
#   (keep_mixer_cores=true), the figures of record beside hf-eager. Next: the CUDA-graph step with the cores kept (its first
#   minutes are the tiny model's cold self-test: give it a call of its own), the trainer cases, and the varlen
#   attention kept (one entry in compiler/recompute.core_ops, then the bench pair and the CUDA tests again):
#     "tests tests/runtime/test_cuda_graphs_gpu.py -k sac then tests tests/runtime/test_cuda_graphs_gpu.py -k trainer"
#     "bench --modes ht-loop:cuda_graphs=on,compile_regions=true,keep_mixer_cores=true,hf-eager --profile"
#   (the figures of record: one bench run, the compiled mode first, then hf-eager)
#   HYBRIDTUNE_GIT_COMMIT=<sha> T0=545 bash benchmarks/single_gpu.sh "bench --modes hf-eager,ht-loop:cuda_graphs=on"
[ $# -ge 1 ] || { sed -n '2,/^$/s/^# \{0,1\}//p' "$0"; exit 2; }
source "$(dirname "$0")/env.sh"
T0=${T0:-560}
N=$#

job() {  # job LANE GPU N KIND ARGS...: the lane's Nth job
  local lane=$1 gpu=$2 n=$3 kind=$4; shift 4
  local left=$((T0 - SECONDS - 10)) cpus
  cpus=$(lane_cpus "$lane" "$N")
  if [ "$left" -le 30 ]; then echo "lane $lane: skipped '$kind $*' (${left}s left)" | tee -a "$R/skipped.txt"; return 0; fi
  local name="lane$lane-$n-$kind" caches=()
  # LANE_CACHES=1: the lane's own Triton, inductor and hybridtune caches (empty at first: each lane's first job cold)
  [ "${LANE_CACHES:-0}" = 1 ] && caches=(TRITON_CACHE_DIR="/tmp/tcache-$lane" TORCHINDUCTOR_CACHE_DIR="/tmp/icache-$lane"
    HYBRIDTUNE_CACHE_DIR="/tmp/htcache-$lane")
  case $kind in
    bench)
      local res=(--results "$RESULTS"); [ "${NO_RESULTS:-0}" = 1 ] && res=()
      env "${caches[@]}" CUDA_VISIBLE_DEVICES=$gpu timeout "$left" $cpus $HT bench --startup_timeout "${STARTUP:-400}" "$@" \
        --output_dir "$R/$name" "${res[@]}" > "$R/$name.log" 2>&1 ;;
    tests)
      env "${caches[@]}" CUDA_VISIBLE_DEVICES=$gpu HYBRIDTUNE_FLA_GRANT_FOR_TESTS=${GRANT:-0} timeout -s INT -k 20 "$left" $cpus \
        ${PY:-python3} -m pytest -p no:cacheprovider -m cuda -v -rfEs --tb=short --durations=0 "$@" > "$R/$name.log" 2>&1 ;;
    train)
      # seq: train's own default sequence_len unless ARGS name one (a row's seq_len is what the run packed)
      local run=$1 arg base=qwen3_5-2b seq mbs=1 acc=1 prev=""; shift
      seq=$(${PY:-python3} -c "from hybridtune.config import TrainConfig; print(TrainConfig.sequence_len)")
      for arg in "$@"; do
        case $prev in --base_model) base=$arg ;; --sequence_len) seq=$arg ;; --micro_batch_size) mbs=$arg ;;
          --gradient_accumulation_steps) acc=$arg ;; esac
        prev=$arg
      done
      [ -f "$R/long.jsonl" ] || ${PY:-python3} benchmarks/make_long_text.py "$R/long.jsonl" --docs "${DOCS:-400}" > /dev/null
      env "${caches[@]}" CUDA_VISIBLE_DEVICES=$gpu timeout "$left" $cpus $HT train --dataset "$R/long.jsonl" --dataset_type text \
        --val_set_size 0 --eval_steps 0 --save_total_limit 1 --overwrite --output_dir "/tmp/out-$run" "$@" \
        > "$R/$run.log" 2>&1
      echo "rc $? at ${SECONDS}s" >> "$R/$run.log"
      cp "/tmp/out-$run/metrics.jsonl" "$R/$run.metrics.jsonl" 2>/dev/null
      [ "${NO_RESULTS:-0}" = 1 ] || ${PY:-python3} -m hybridtune.bench.results --table "$RESULTS" add-train "$R" "$run" \
        --command "hybridtune train $*" --shape "$base" --seq-len "$seq" --packs $((mbs * acc)) ${NOTE:+--note "$NOTE"} 2>&1 | tee -a "$R/$run.log"
      return 0 ;;
    train-smoke)
      env "${caches[@]}" CUDA_VISIBLE_DEVICES=$gpu timeout "$left" $cpus $HT train --max_steps 30 --eval_steps 0 --logging_steps 10 \
        --output_dir "/tmp/train-smoke-$lane" "$@" > "$R/$name.log" 2>&1 ;;
    *) echo "lane $lane: unknown job '$kind' (bench, tests or train-smoke)" | tee -a "$R/skipped.txt"; return 0 ;;
  esac
  echo "rc $? at ${SECONDS}s" >> "$R/$name.log"
}

lane() {  # lane I "JOB then JOB ..."
  local i=$1 gpu=$1 spec=$2 part n=0
  [ "${LANES_ON_ONE_GPU:-0}" = 1 ] && gpu=0
  while [ -n "$spec" ]; do
    part=${spec%% then *}
    if [ "$part" = "$spec" ]; then spec=""; else spec=${spec#* then }; fi
    read -ra words <<< "$part"
    n=$((n + 1))
    job "$i" "$gpu" "$n" "${words[@]}"
  done
}

i=0
for spec in "$@"; do lane "$i" "$spec" & i=$((i + 1)); done
wait
finish
for f in "$R"/lane*-bench/bench.md; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done
grep -hE "^(PASSED|FAILED|ERROR)|passed|failed" "$R"/lane*-tests.log 2>/dev/null | tail -n 30
tail -qn 1 "$R"/lane*.log; cat "$R/skipped.txt" 2>/dev/null
exit 0
