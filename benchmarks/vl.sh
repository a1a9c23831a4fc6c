#!/usr/bin/env bash
# Issue 36's H200 figures in one 600 s call: vision-language LoRA, hybridtune packed beside transformers + peft.
#
#   HYBRIDTUNE_GIT_COMMIT=<sha> bash benchmarks/vl.sh          (run from the repo root; carry .whl as dpo.sh says)
#
# One `hybridtune bench --vision` (bench/vl_data.py, bench/vl_modes.py): a random-weight Qwen3.5 vision-language
# checkpoint of PRESET's text shape (default qwen3_5-2b: its text preset and the 2B's vision tower, 24 blocks, width
# 1024) written first (drawn on the GPU, saved bf16), synthetic image-text documents (1-4 images of 256-1,280 visual
# tokens each, text around them) packed into SEQ (8192) tokens, LAYOUTS (6) packs cycled, LoRA r=16 (alpha 32,
# train's targets), WARMUP (2) + STEPS (8) steps, modes MODES (default, the baselines first so their rows exist
# whatever hybridtune's cold compile takes):
#   hf-eager   transformers + peft, the pack's documents as one padded batch (attention_mask), as users run it
#   hf-pf      transformers' padding-free path (DataCollatorWithFlattening: one row, position_ids, cu_seq_lens)
#   ht-eager   hybridtune's packed step, per-document M-RoPE, eager
#   ht-loop    hybridtune's packed step with train's own GPU defaults (regions, CUDA graphs, kept cores: auto)
# Each row: tokens/s (text + visual, no padding), HFU (the vision tower's forward counted), peak memory, the loss at
# step 1 and over the last steps (the same documents in the same order for every mode: loss parity). A mode that
# fails or is cut is a row with its reason; the next runs. The bench is stopped with SIGINT at T0 (570 s) less 25 s
# (the modes done are kept); a mode not stepped within STARTUP (200) s is stopped.
# Back in $OUT: vl.log, vl.md, vl.json, work.tar.gz (every mode's log; the checkpoint and images are deleted
# first), results.jsonl (the table with the new rows; NO_RESULTS=1: none appended). CPU rehearsal (tiny preset):
#   PY=.venv/bin/python PRESET=tiny-qwen3_5 SEQ=512 LAYOUTS=2 WARMUP=1 STEPS=2 MODES=hf-eager,hf-pf,ht-eager \
#     NO_RESULTS=1 OUT=/tmp/vl-out R=/tmp/vl bash benchmarks/vl.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export HYBRIDTUNE_GIT_COMMIT=${HYBRIDTUNE_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-$PWD/outputs/vl}
mkdir -p "$OUT"
LOG=$OUT/vl.log
T0=${T0:-570} STARTUP=${STARTUP:-200} SEQ=${SEQ:-8192} LAYOUTS=${LAYOUTS:-6} WARMUP=${WARMUP:-2} STEPS=${STEPS:-8}
PRESET=${PRESET:-qwen3_5-2b}
MODES=${MODES:-hf-eager,hf-pf,ht-eager,ht-loop:cuda_graphs=auto,compile_regions=auto,keep_mixer_cores=auto}
EXTRA=${EXTRA:-}
R=${R:-/tmp/vl}
. benchmarks/env.sh  # wheels into /tmp/site, PYTHONPATH, caches, R, HT, RESULTS, finish
{
  echo "== vl.sh $(date -u +%FT%TZ) commit $HYBRIDTUNE_GIT_COMMIT preset $PRESET modes: $MODES seq $SEQ"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  ${PY:-python3} - <<'PY'
import importlib
for name in ("torch", "transformers", "peft", "accelerate", "fla", "PIL"):
    try:
        print(f"{name} {getattr(importlib.import_module(name), '__version__', '?')}")
    except Exception as e:  # (a missing one: its modes say so in their rows)
        print(f"{name}: does not import ({type(e).__name__}: {e})")
PY
} 2>&1 | tee "$LOG"

results=(--results "$RESULTS")
[ "${NO_RESULTS:-0}" = 1 ] && results=()
budget=$((T0 - SECONDS - 25))  # (25 s kept to bring the files back)
echo "== $PRESET vision: bench, ${budget} s at most, from ${SECONDS} s" | tee -a "$LOG"
# shellcheck disable=SC2086  # HT and EXTRA are word lists
timeout -s INT -k 40 "$budget" $HT bench --vision --base_model "$PRESET" --modes "$MODES" --sequence_len "$SEQ" \
  --warmup "$WARMUP" --steps "$STEPS" --layouts "$LAYOUTS" --lora_r 16 --startup_timeout "$STARTUP" \
  --output_dir "$R/bench" "${results[@]}" $EXTRA > "$R/bench.log" 2>&1
echo "== rc $? at ${SECONDS} s" | tee -a "$LOG"
grep -E "^[0-9:]+ (INFO|WARNING|ERROR) bench:|Error" "$R/bench.log" | tail -40 | tee -a "$LOG"
for f in bench.md bench.json; do
  [ -f "$R/bench/$f" ] && cp "$R/bench/$f" "$OUT/vl.${f#bench.}"
done
[ -f "$R/bench/bench.md" ] && cat "$R/bench/bench.md" >> "$LOG"
rm -rf "$R/bench/vl-model" "$R/bench/vl-data/img"  # (gigabytes: not brought back)
finish
echo "== done at ${SECONDS} s" | tee -a "$LOG"
