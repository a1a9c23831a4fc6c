#!/usr/bin/env bash
# Does everything hold on one GPU? One command for a lent one-GPU machine (nvidia-h200), within one 600 s call:
#   setup   install the carried FLA wheels (.whl/) into /tmp/site; stop here if FLA does not import (the CUDA
#           tests would only skip, the bench and train would run the slow torch reference)       ~10-20 s
#   tests   pytest -m cuda tests/mixers tests/runtime tests/train tests/compiler: the FLA GDN tests run the kernel self-test per
#           head layout, then compare with the fp32 reference (tests/mixers/gdn/conftest.py); tests/compiler last, as the
#           slowest: each cuda-inductor loop test compiled 100-250 s cold (2026-11-30 reports), so the call's
#           limit cuts them, and pytest prints what passed (SIGINT)             the whole limit; ops ~200-330 s cold
#   bench   the 2B one-GPU question of benchmarks/single_gpu.sh, `bench --modes ht-loop:cg=on,hf-eager` (qwen3_5-2b,
#           4096-token packs, LoRA r=16): ht-loop:cg=on's first step 130-170 s cold, hf-eager's 4-6 s, ~23 s model
#           init per mode (results rows 19-20, 26-27)                                            ~300-350 s
#   train   hybridtune train, qwen3_5-2b, LoRA, 4096-token packs, 2 per step, 40 steps, profile off, log every 5:
#           model init ~23 s, self-test (82 s cold autotuning), loop compile 110-150 s, then 33-37k tok/s (rows 56, 61)
#                                                                                                ~250 s
# Sequentially that is over the 600 s a call may run, so the three run side by side on GPU 0 (139 GiB is room for
# all: 15.5 + 5.6 + 15 GiB), each on its own cores (tests 0-4, bench 5-10, train 11-15; CPUS_TESTS, CPUS_BENCH,
# CPUS_TRAIN override). The bench shares the host, so its figures are NOT of record (a row of record needs the
# machine alone: benchmarks/NOTES.md 9): no row is appended; `python -m hybridtune.bench.results add-bench
# bench.json` adds them if wanted. PARTS="tests bench train" (default) picks parts; T0 (560) is the whole budget.
#
#   HYBRIDTUNE_GIT_COMMIT=<sha> bash benchmarks/gpu_check.sh                  (carry .whl; run from the repo root)
#
# Back in $OUT (default ./outputs/gpu_check), 8 files at most: gpu_check.log (setup, versions, the summary table),
# pytest.log, bench.json, bench.md, bench.log (the job's log and every mode's log), train.log, train-metrics.jsonl.
# CPU rehearsal of the train part: PARTS=train BASE=tiny-qwen3_5 SEQ=256 STEPS=3 PY=.venv/bin/python bash $0
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tcache}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/icache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HYBRIDTUNE_GIT_COMMIT=${HYBRIDTUNE_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-$PWD/outputs/gpu_check}
W=${W:-/tmp/gpu_check}
PY=${PY:-python3} T0=${T0:-560} PARTS=${PARTS:-tests bench train}
BASE=${BASE:-qwen3_5-2b} SEQ=${SEQ:-4096} STEPS=${STEPS:-40}
BENCH=${BENCH:-"bench --modes ht-loop:cg=on,hf-eager"}
mkdir -p "$OUT" "$W"
LOG=$OUT/gpu_check.log
has() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
left() { echo $((T0 - SECONDS - 25)); }  # what a part may still run: leaves time to collect the files
cpus() { command -v taskset >/dev/null && [ "$(nproc)" -ge 16 ] && echo "taskset -c $1"; }

{
  echo "== gpu_check $(date -u +%FT%TZ) commit $HYBRIDTUNE_GIT_COMMIT parts: $PARTS"
  if command -v nvidia-smi >/dev/null && ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "wheel install failed"; exit 1; }
  fi
  if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; fi
} 2>&1 | tee "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || exit 1
export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
$PY - <<'PY' 2>&1 | tee -a "$LOG"
import torch, transformers
from hybridtune.ops import fla_adapter, fla_guard
print(f"torch {torch.__version__} transformers {transformers.__version__} cuda {torch.cuda.is_available()}")
if torch.cuda.is_available():
    import triton
    ok, why = fla_adapter.available()
    print(f"device {torch.cuda.get_device_name(0)}; triton {triton.__version__}; FLA: {why}; Hopper guard active: "
          f"{fla_guard.guard_active()}")
    if not ok:
        raise SystemExit(f"FLA is not usable on this GPU ({why}): carry .whl (../shared/tools/gpu-wheels.sh)")
PY
[ "${PIPESTATUS[0]}" = 0 ] || { echo "setup failed: nothing run" | tee -a "$LOG"; exit 1; }

declare -A RC START END
part() {  # part NAME COMMAND...: run in the background with the time left, SIGINT at the limit (summaries print)
  local name=$1; shift
  START[$name]=$SECONDS
  ( timeout -s INT -k 20 "$(left)" "$@"; echo "rc $? at ${SECONDS}s" ) > "$W/$name.log" 2>&1 &
}

if has tests; then
  part tests $(cpus "${CPUS_TESTS:-0-4}") $PY -m pytest -p no:cacheprovider -q -m cuda -rA --durations=15 \
    tests/mixers tests/runtime tests/train tests/compiler
fi
if has bench; then
  if [ -f benchmarks/single_gpu.sh ]; then  # its bench job: the same question as the results table's rows
    part bench env OUT= R="$W/bench" NO_RESULTS=1 T0="$(left)" CPUS_0="${CPUS_BENCH:-5-10}" PY="$PY" \
      bash benchmarks/single_gpu.sh "$BENCH --base_model $BASE --sequence_len $SEQ"
  else
    part bench $(cpus "${CPUS_BENCH:-5-10}") $PY -m hybridtune $BENCH --base_model "$BASE" --sequence_len "$SEQ" \
      --output_dir "$W/bench/lane0-1-bench"
  fi
fi
if has train; then
  $PY benchmarks/make_long_text.py "$W/long.jsonl" --docs 200 >> "$LOG" 2>&1 || echo "no training data" >> "$LOG"
  part train $(cpus "${CPUS_TRAIN:-11-15}") $PY -m hybridtune train --base_model "$BASE" --adapter lora \
    --dataset "$W/long.jsonl" --dataset_type text --sequence_len "$SEQ" --micro_batch_size 1 \
    --gradient_accumulation_steps 2 --max_steps "$STEPS" --warmup_steps 5 --logging_steps 5 --val_set_size 0 \
    --eval_steps 0 --save_total_limit 1 --profile_steps 0 --overwrite --output_dir "$W/train"
fi
wait

# Collect (8 files at most, no deeper than $OUT/x/y).
[ -f "$W/tests.log" ] && cp "$W/tests.log" "$OUT/pytest.log"
[ -f "$W/train.log" ] && cp "$W/train.log" "$OUT/train.log"
[ -f "$W/train/metrics.jsonl" ] && cp "$W/train/metrics.jsonl" "$OUT/train-metrics.jsonl"
b=$W/bench/lane0-1-bench
for f in bench.json bench.md; do [ -f "$b/$f" ] && cp "$b/$f" "$OUT/$f"; done
if [ -f "$W/bench.log" ]; then
  { cat "$W/bench.log"; for f in "$W/bench/lane0-1-bench.log" "$b"/logs/*.log; do
      [ -f "$f" ] && { echo "==== $f"; cat "$f"; }; done; } > "$OUT/bench.log"
fi

{
  echo "== summary (${SECONDS}s of T0=$T0)"
  printf '%-6s %-22s %s\n' part "exit (at s)" "outcome"
  for name in tests bench train; do
    has "$name" || continue
    rcline=$(grep -h "^rc " "$W/$name.log" 2>/dev/null | tail -n 1)
    case $name in
      tests) what=$(grep -E "(passed|failed|skipped|error|no tests ran).* in [0-9.]+s" "$W/tests.log" | tail -n 1) ;;
      bench) what=$( [ -f "$b/bench.md" ] && grep -E "^\| *(hf|ht)-" "$b/bench.md" | cut -c1-110 | tr '\n' ';' \
               || echo "no bench.md: see bench.log") ;;
      train) what=$(grep -E "step +[0-9]+" "$W/train.log" | tail -n 1 | cut -c1-110) ;;
    esac
    printf '%-6s %-22s %s\n' "$name" "${rcline:-not run}" "${what:-see $name.log}"
  done
  echo "-- failed or skipped tests:"
  grep -E "^(FAILED|ERROR|SKIPPED)" "$W/tests.log" 2>/dev/null | cut -c1-200 | head -n 25
  echo "-- train's step lines:"
  grep -E "step +[0-9]+" "$W/train.log" 2>/dev/null | tail -n 10 | cut -c1-160
} 2>&1 | tee -a "$LOG"
exit 0
