#!/usr/bin/env bash
# Issue 49's proof on one lent GPU, one part a call (each at most T0 = 560 s), parts chained back to back on the warm
# machine (its /tmp: wheels in /tmp/site, Triton and Inductor caches, stay while it is held; the next call must start
# within 30 s of the last):
#
#   HYBRIDTUNE_GIT_COMMIT=<40-digit sha> bash benchmarks/proof.sh PART          (repo root; carry .whl, see below)
#
#   cuda        the whole `-m cuda` tier (pytest -n NPROC=8, at most T_TIER = T0 - 150 s), every test's FLA
#               autotuning choices saved per xdist worker and folded into $OUT/<GPU>.json (the tuned table of this
#               GPU kind: copy it to src/hybridtune/mixers/gdn/tuned/, the way a table is made for any card), then
#               `python -m hybridtune.bench.generation` (GEN_MODEL qwen3_5-2b, ROWS 64 x NEW 512 tokens: the rollout
#               decoder beside transformers' generate, greedy agreement on 8 prompts; GEN=0: the tier alone,
#               TIER=0: the generation alone)
#   preference  benchmarks/dpo.sh on the 2B (TRL's DPOTrainer first, so its row exists whatever our compile takes;
#               at most T_DPO = 330 s), then the GRPO pair (python -m hybridtune.bench.grpo_pair: 8 prompts x 8
#               completions x 256 tokens, TRL's GRPOTrainer without vLLM beside ours) in what is left
#   vision      benchmarks/vl.sh on the 2B shape (transformers + peft unpacked and padding-free beside ours)
#
# Each part appends its rows to benchmarks/results.jsonl (NO_RESULTS=1: none) and brings back at most 8 files in
# $OUT: proof.log (setup, versions, every step's outcome and the summary), results.jsonl, work.tar.gz (every log),
# and the part's own (cuda: <GPU>.json; preference: dpo-*.md; vision: vl.md); SAVE_CACHE=1 adds the compile caches.
# Wheels, in .whl/ (7 MB; what travels stays far under 64 MiB): ../shared/tools/gpu-wheels.sh einops==0.8.1
# datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 torchao==0.18.0 trl==1.16.0 pytest-xdist==3.8.0
# execnet==2.1.2 (FLA 0.6.0 1.5 MB, torchao 3.4 MB, trl 0.9 MB, datasets 0.6 MB, the rest under 0.5 MB each; the
# image's pyarrow 25.0.1 serves datasets 5.2.0). CPU rehearsal (tests/bench/test_proof_script.py runs it, slow tier):
#   PY=.venv/bin/python NO_RESULTS=1 OUT=/tmp/proof-out R=/tmp/proof REHEARSAL=1 bash benchmarks/proof.sh cuda
# REHEARSAL=1 swaps in tiny shapes (the tiny presets, a few tokens and steps; the tier's one file of table tests) so
# every flag and path is exercised; TIER_PATHS picks the tier's test paths (default: tests).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PART=${1:-}
case "$PART" in
  cuda | preference | vision) ;;
  *)
    awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"
    [ -z "$PART" ] && exit 0
    echo "error: unknown part '$PART': give cuda, preference or vision" >&2
    exit 2
    ;;
esac
export HYBRIDTUNE_GIT_COMMIT=${HYBRIDTUNE_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-$PWD/outputs/proof-$PART}
T0=${T0:-560} NPROC=${NPROC:-8}
PY=${PY:-python3}
R=${R:-/tmp/proof}
mkdir -p "$OUT" "$R"
LOG=$OUT/proof.log
. benchmarks/env.sh # wheels into /tmp/site, PYTHONPATH, caches, HT, RESULTS, save_cache
results=(--results "$RESULTS")
[ "${NO_RESULTS:-0}" = 1 ] && results=()
left() { echo $((T0 - SECONDS - 25)); } # what a step may still run: 25 s kept to bring the files back
say() { echo "$*" | tee -a "$LOG"; }

{
  echo "== proof.sh $PART $(date -u +%FT%TZ) commit $HYBRIDTUNE_GIT_COMMIT T0 $T0"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY - <<'PY'
import importlib
for name in ("torch", "triton", "transformers", "peft", "datasets", "fla", "torchao", "trl", "xdist"):
    try:
        print(f"{name} {getattr(importlib.import_module(name), '__version__', '?')}")
    except Exception as e:  # a missing one: the step that needs it says so
        print(f"{name}: does not import ({type(e).__name__}: {e}); carry it in .whl/ (benchmarks/proof.sh)")
PY
} 2>&1 | tee "$LOG"

cuda_tier() { # $1: seconds at most, $2: where the FLA choices are saved, $3: the test paths
  local device slug
  say "== cuda tier: pytest -m cuda -n $NPROC, at most $1 s, from ${SECONDS} s"
  HYBRIDTUNE_SAVE_KERNEL_CONFIGS=$2 timeout -s INT -k 30 "$1" $PY -m pytest -p no:cacheprovider -m cuda \
    --run-slow -n "$NPROC" --dist worksteal -q -rfEs --durations=100 $3 > "$R/tier.log" 2>&1
  say "== cuda tier: rc $? at ${SECONDS} s"
  grep -E "^(FAILED|ERROR|SKIPPED)|(passed|failed|skipped|error|no tests ran).* in [0-9.]+s" "$R/tier.log" \
    | cut -c1-220 | tee -a "$LOG"
  if ls "$2".* > /dev/null 2>&1; then
    device=$($PY -c "import torch; print(torch.cuda.get_device_name(0))")
    slug=$($PY -c "import sys; from hybridtune.mixers.gdn.tuned import device_slug; print(device_slug(sys.argv[1]))" "$device")
    [ -f "src/hybridtune/mixers/gdn/tuned/$slug.json" ] && cp "src/hybridtune/mixers/gdn/tuned/$slug.json" "$R/tuned/$slug.json"
    $PY -m hybridtune.mixers.gdn.tuned merge "$R/tuned/$slug.json" "$2".* 2>&1 | tee -a "$LOG"
    cp "$R/tuned/$slug.json" "$OUT/"
  else
    say "== no kernel table saved (no GPU, or no FLA kernel ran)"
  fi
}

part_cuda() {
  local tier=${T_TIER:-$((T0 - 150))} kc=$R/tuned/kc.json paths=${TIER_PATHS:-tests}
  [ "${REHEARSAL:-0}" = 1 ] && paths=${TIER_PATHS:-tests/mixers/gdn/test_tuned.py}
  rm -rf "$R/tuned" && mkdir -p "$R/tuned"
  if [ "${TIER:-1}" = 0 ]; then
    say "== cuda tier: not run (TIER=0)"
  else
    cuda_tier "$tier" "$kc" "$paths"
  fi
  if [ "${GEN:-1}" = 0 ]; then
    say "== generation: not run (GEN=0)"
    return
  fi
  local gen=(--base_model "${GEN_MODEL:-qwen3_5-2b}" --rows "${ROWS:-64}" --new_tokens "${NEW:-512}")
  [ "${REHEARSAL:-0}" = 1 ] && gen=(--base_model tiny-qwen3_5 --rows 2 --new_tokens 4)
  say "== generation: ${gen[*]}, at most $(left) s, from ${SECONDS} s"
  timeout -s INT -k 30 "$(left)" $PY -m hybridtune.bench.generation "${gen[@]}" --output_dir "$R/gen" \
    "${results[@]}" > "$R/gen.log" 2>&1
  say "== generation: rc $? at ${SECONDS} s"
  grep -vE "^\s*$" "$R/gen.log" | tail -n 15 | tee -a "$LOG"
}

part_preference() {
  local dpo=${T_DPO:-330} shapes=qwen3_5-2b:6:20 seq=8192 extra="" grpo
  grpo=(--base_model qwen3_5-2b --steps 5 --prompts 8 --num_generations 8 --max_completion_length 256)
  if [ "${REHEARSAL:-0}" = 1 ]; then
    shapes=tiny-qwen3_5:1:2 seq=256 extra="--compile_backend aot_eager"
    grpo=(--base_model tiny-qwen3_5 --steps 2 --prompts 1 --num_generations 2 --max_completion_length 4)
  fi
  say "== dpo: benchmarks/dpo.sh $shapes, at most $dpo s, from ${SECONDS} s"
  OUT=$R/dpo-out R=$R/dpo T0=$dpo SHAPES=$shapes SEQ=$seq NINE=0 EXTRA=$extra PY=$PY NO_RESULTS=${NO_RESULTS:-0} \
    RESULTS=$RESULTS bash benchmarks/dpo.sh > "$R/dpo.log" 2>&1
  say "== dpo: rc $? at ${SECONDS} s"
  grep -E "^\|" "$R"/dpo-out/dpo-*.md 2>/dev/null | cut -c1-200 | tee -a "$LOG"
  cp "$R"/dpo-out/dpo-*.md "$OUT/" 2>/dev/null
  say "== grpo pair: ${grpo[*]}, at most $(left) s, from ${SECONDS} s"
  timeout -s INT -k 30 "$(left)" $PY -m hybridtune.bench.grpo_pair "${grpo[@]}" --output_dir "$R/grpo" \
    "${results[@]}" > "$R/grpo.log" 2>&1
  say "== grpo pair: rc $? at ${SECONDS} s"
  grep -vE "^\s*$" "$R/grpo.log" | tail -n 12 | tee -a "$LOG"
}

part_vision() {
  local env=(PRESET=qwen3_5-2b)
  [ "${REHEARSAL:-0}" = 1 ] && env=(PRESET=tiny-qwen3_5 SEQ=512 LAYOUTS=2 WARMUP=1 STEPS=2 MODES=hf-eager,ht-eager)
  say "== vision: benchmarks/vl.sh ${env[*]}, at most $(left) s, from ${SECONDS} s"
  env "${env[@]}" OUT="$R/vl-out" R="$R/vl" T0="$(left)" PY="$PY" NO_RESULTS="${NO_RESULTS:-0}" RESULTS="$RESULTS" \
    bash benchmarks/vl.sh > "$R/vl.log" 2>&1
  say "== vision: rc $? at ${SECONDS} s"
  grep -E "^\|" "$R/vl-out/vl.md" 2>/dev/null | cut -c1-200 | tee -a "$LOG"
  cp "$R/vl-out/vl.md" "$OUT/" 2>/dev/null
}

"part_$PART"
tar czf "$OUT/work.tar.gz" -C "$R" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' \
  --exclude='*.png' --exclude='*.jpg' --exclude=vl-model --exclude=tuned . 2>/dev/null
[ -f "$RESULTS" ] && cp "$RESULTS" "$OUT/results.jsonl"
[ "${SAVE_CACHE:-0}" = 1 ] && save_cache
say "== proof.sh $PART done at ${SECONDS} s of $T0"
exit 0
