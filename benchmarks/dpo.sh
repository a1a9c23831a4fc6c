#!/usr/bin/env bash
# Issue 37's figures in one 600 s call on one H200: hybridtune's dpo beside TRL's DPOTrainer, 2B then 9B.
#
#   HYBRIDTUNE_GIT_COMMIT=<sha> bash benchmarks/dpo.sh          (run from the repo root; carry .whl, see below)
#
# One `hybridtune bench` per shape (SHAPES, default "qwen3_5-2b:6:20 qwen3_5-9b:3:12": preset:warm-up:timed
# steps), LoRA r=16 (alpha 32, train's targets), packs of SEQ (8192) tokens of preference pairs (prompt 200-1,000
# tokens, replies 100-800: bench/pairs.py), modes MODES (default trl-dpo, trl-dpo-pf, then hybridtune's dpo step with
# train's own GPU defaults (regions, CUDA graphs, kept cores: `auto`), the baseline first so its row exists whatever
# hybridtune's cold compile takes: on 2026-12-04 ht-loop with every layer inlined outlasted both shapes' budgets):
#   ht-loop:objective=dpo  hybridtune train's dpo step, the decoder loop compiled (first step over 190 s cold at 2B)
#   trl-dpo                TRL 1.16's DPOTrainer on transformers + peft, its own padding, gradient checkpointing
#   trl-dpo-pf             the same with padding_free=True: TRL 1.16 turns it off, so this is a row saying so
# Each row: tokens/s (the real tokens of prompt + chosen and prompt + rejected, no padding), HFU (the reference's
# forward counted), peak memory, the loss at step 1 (ln 2 = 0.69315: policy == reference) and over the last 10 steps
# (the same pairs in the same order for every mode). A mode that fails or is cut is a row with its reason; the next
# runs. Time: the 2B bench may use what is left less NINE (default 270 s, kept for the 9B), the 9B what is left;
# each bench is stopped with SIGINT at its budget (the modes done are kept, the rest listed as not run), each mode
# that has not stepped within STARTUP (240) s is stopped. T0 (570) is the whole budget.
#
# Wheels (the image has torch, transformers, peft, accelerate): .whl/ from ../shared/tools/gpu-wheels.sh einops==0.8.1
# datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 trl==1.16.0 (TRL is pure Python; its other requirements are
# on the image), and .whlx/ with pyarrow 26.0.1 where the image's is too old for datasets (benchmarks/env.sh).
# Back in $OUT: dpo.log, dpo-<preset>.md and dpo-<preset>.json per shape, work.tar.gz (every mode's log),
# results.jsonl (the table with the new rows; NO_RESULTS=1: none appended). SAVE_CACHE=1 also returns the compile
# caches. CPU rehearsal (tiny presets, seconds):
#   PY=.venv/bin/python SHAPES="tiny-qwen3_5:1:3 tiny-qwen3_5@layers=2:1:2" SEQ=256 NINE=60 NO_RESULTS=1 \
#     EXTRA="--compile_backend aot_eager" OUT=/tmp/dpo-out bash benchmarks/dpo.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export HYBRIDTUNE_GIT_COMMIT=${HYBRIDTUNE_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-$PWD/outputs/dpo}
mkdir -p "$OUT"
LOG=$OUT/dpo.log
T0=${T0:-570} NINE=${NINE:-270} STARTUP=${STARTUP:-240} SEQ=${SEQ:-8192} LAYOUTS=${LAYOUTS:-8}
SHAPES=${SHAPES:-"qwen3_5-2b:6:20 qwen3_5-9b:3:12"}
MODES=${MODES:-trl-dpo,trl-dpo-pf,ht-loop:objective=dpo,cuda_graphs=auto,compile_regions=auto,keep_mixer_cores=auto}
EXTRA=${EXTRA:-}
R=${R:-/tmp/dpo}
. benchmarks/env.sh  # wheels into /tmp/site, PYTHONPATH, caches, R, HT, RESULTS, finish
{
  echo "== dpo.sh $(date -u +%FT%TZ) commit $HYBRIDTUNE_GIT_COMMIT shapes: $SHAPES modes: $MODES seq $SEQ"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  ${PY:-python3} - <<'PY'
import importlib
for name in ("torch", "transformers", "peft", "accelerate", "datasets", "trl", "fla"):
    try:
        print(f"{name} {getattr(importlib.import_module(name), '__version__', '?')}")
    except Exception as e:  # (a missing one: its modes say so in their rows)
        print(f"{name}: does not import ({type(e).__name__}: {e}); carry it in .whl/ (see benchmarks/dpo.sh)")
PY
} 2>&1 | tee "$LOG"

results=(--results "$RESULTS")
[ "${NO_RESULTS:-0}" = 1 ] && results=()
set -- $SHAPES
n=$#
for shape in "$@"; do
  IFS=: read -r preset warmup steps <<< "$shape"
  n=$((n - 1))
  left=$((T0 - SECONDS - 25))  # (25 s kept to bring the files back)
  budget=$((n > 0 ? left - NINE * n : left))
  if [ "$budget" -lt 60 ]; then
    echo "== $preset: not run, ${budget} s left of its budget" | tee -a "$LOG"
    continue
  fi
  echo "== $preset: bench, ${budget} s at most, from ${SECONDS} s" | tee -a "$LOG"
  # shellcheck disable=SC2086  # HT and EXTRA are word lists
  timeout -s INT -k 40 "$budget" $HT bench --base_model "$preset" --modes "$MODES" --sequence_len "$SEQ" \
    --warmup "$warmup" --steps "$steps" --layouts "$LAYOUTS" --lora_r 16 --startup_timeout "$STARTUP" \
    --output_dir "$R/$preset" "${results[@]}" $EXTRA > "$R/$preset.log" 2>&1
  echo "== $preset: rc $? at ${SECONDS} s" | tee -a "$LOG"
  grep -E "^[0-9:]+ (INFO|WARNING) bench:" "$R/$preset.log" | tee -a "$LOG"
  for f in bench.md bench.json; do
    [ -f "$R/$preset/$f" ] && cp "$R/$preset/$f" "$OUT/dpo-$preset.${f#bench.}"
  done
  [ -f "$R/$preset/bench.md" ] && cat "$R/$preset/bench.md" >> "$LOG"
done
finish
echo "== done at ${SECONDS} s" | tee -a "$LOG"
