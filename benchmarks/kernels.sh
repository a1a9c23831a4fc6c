#!/usr/bin/env bash
# Are the fast GDN kernels right on this GPU, and which path does each model take? Numeric errors of hybridtune's
# GDN ops (FLA, bf16) against the fp32 reference, the kernel self-test verdicts for the Qwen3.5 0.8B/2B/9B and tiny
# head layouts, `hybridtune doctor --json` for the tiny Qwen3.5 / Qwen3-Next presets and the 2B preset, and the
# CUDA tests of the ops, the GDN patch and the self-test.
#
#   bash benchmarks/kernels.sh [errors] [selftest] [doctor] [tests]      (default: all four, in that order)
#
# Run from the repo root (carry .whl/ on a lent machine). Writes to $OUT (default ./outputs/kernels): one JSON per
# step, each with the command, git commit, versions and device (DATE-gdn-errors.json, DATE-selftest-*.json,
# DATE-doctor-*.json), plus the full log kernels.log and, last, a verdict table. Every step has its own timeout
# inside a BUDGET (570 s) overall, so a slow first Triton compile costs the later steps, never the files written.
# The verdicts are of this run only (a fresh HYBRIDTUNE_CACHE_DIR). These are correctness results, not speed:
# they do not go into benchmarks/results.jsonl; a claim drawn from them gets a dated report in benchmarks/reports/.
#   HYBRIDTUNE_GIT_COMMIT=<sha> bash benchmarks/kernels.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
OUT=${OUT:-$PWD/outputs/kernels}
mkdir -p "$OUT"
LOG="$OUT/kernels.log"
BUDGET=${BUDGET:-570}
DATE=$(date -u +%Y-%m-%d)
STEPS=${*:-errors selftest doctor tests}
export HYBRIDTUNE_GIT_COMMIT=${HYBRIDTUNE_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export HYBRIDTUNE_CACHE_DIR="${HYBRIDTUNE_CACHE_DIR:-/tmp/hybridtune-cache-$$}"  # not under $OUT: few files come back

{
  echo "== install wheels from .whl into /tmp/site"
  ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
} 2>&1 | tee "$LOG"
export PYTHONPATH=/tmp/site:$PWD/src
python3 -c "import einops" 2>/dev/null || echo "WARNING: einops missing; FLA's conv will not import (add einops==0.8.1 to the carried wheels)" | tee -a "$LOG"
python3 - <<'PY' 2>&1 | tee -a "$LOG"
import torch, triton, transformers, fla
print(f"torch {torch.__version__} triton {triton.__version__} transformers {transformers.__version__} fla {fla.__version__}")
print(f"device {torch.cuda.get_device_name(0)} sm{'.'.join(map(str, torch.cuda.get_device_capability(0)))}")
from hybridtune.ops import fla_guard
print(f"FLA Hopper guard active: {fla_guard.guard_active()}")
PY

left() { echo $((BUDGET - SECONDS)); }

# wrap FILE COMMAND...: add command and date to the JSON a step wrote
wrap() {
  local file=$1; shift
  python3 - "$file" "$*" <<'PY'
import json, sys, datetime
path, cmd = sys.argv[1], sys.argv[2]
try:
    d = json.load(open(path))
except (OSError, ValueError) as e:
    print(f"no JSON in {path}: {e}"); sys.exit(0)
d = {"command": cmd, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **d}
json.dump(d, open(path, "w"), indent=1)
PY
}

# step NAME TIMEOUT_CAP COMMAND...: run with timeout min(cap, what is left), log everything
step() {
  local name=$1 cap=$2; shift 2
  local t=$(( $(left) < cap ? $(left) : cap ))
  if (( t < 20 )); then echo "== $name: skipped, budget spent" | tee -a "$LOG"; return 0; fi
  echo "== $name (timeout ${t}s): $*" | tee -a "$LOG"
  timeout "$t" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "== $name: rc=$rc at ${SECONDS}s" | tee -a "$LOG"
}

want() { [[ " $STEPS " == *" $1 "* ]]; }

if want errors; then
  E="$OUT/$DATE-gdn-errors.json"
  step gdn-errors 200 python3 benchmarks/gdn_errors.py --out "$E"
fi

if want selftest; then
  ST="python3 -m hybridtune.kernels.selftest --no-cache"
  S1="$OUT/$DATE-selftest-qwen3_5-0.8b-2b.json"
  S2="$OUT/$DATE-selftest-qwen3_5-9b.json"
  S3="$OUT/$DATE-selftest-tiny.json"
  step selftest-0.8b-2b 240 $ST --preset qwen3_5-0.8b --preset qwen3_5-2b --json "$S1"
  wrap "$S1" "$ST --preset qwen3_5-0.8b --preset qwen3_5-2b --json $(basename "$S1")"
  step selftest-9b 200 $ST --preset qwen3_5-9b --json "$S2"
  wrap "$S2" "$ST --preset qwen3_5-9b --json $(basename "$S2")"
  step selftest-tiny 120 $ST --preset tiny-qwen3_5 --preset tiny-qwen3_next --json "$S3"
  wrap "$S3" "$ST --preset tiny-qwen3_5 --preset tiny-qwen3_next --json $(basename "$S3")"
fi

if want doctor; then
  for preset in tiny-qwen3_5 tiny-qwen3_next qwen3_5-2b; do
    f="$OUT/$DATE-doctor-$preset.json"
    t=$(( $(left) < 90 ? $(left) : 90 ))
    if (( t < 20 )); then echo "== doctor $preset: skipped, budget spent" | tee -a "$LOG"; continue; fi
    echo "== doctor $preset (timeout ${t}s)" | tee -a "$LOG"
    timeout "$t" python3 -m hybridtune doctor --model "$preset" --json > "$f" 2> >(tee -a "$LOG" >&2)
    echo "== doctor $preset: rc=$? at ${SECONDS}s" | tee -a "$LOG"
    wrap "$f" "python3 -m hybridtune doctor --model $preset --json"
  done
fi

# The CUDA tests of the ops, the GDN patch and the self-test (the same checks through pytest).
if want tests; then
  if python3 -c "import pytest" 2>/dev/null; then
    HYBRIDTUNE_FLA_GRANT_FOR_TESTS=${GRANT:-1} step pytest-cuda 200 python3 -m pytest -m cuda -v -rA -p no:cacheprovider \
      tests/mixers/gdn tests/kernels/test_selftest.py
  else
    echo "== pytest-cuda: skipped, pytest not installed" | tee -a "$LOG"
  fi
fi

# The verdict table, last.
python3 - "$OUT" <<'PY' 2>&1 | tee -a "$LOG"
import glob, json, os, sys
out = sys.argv[1]
print(f"\n{'kernel':<14} {'layout':<24} {'presets':<30} {'verdict':<48} {'cached':<6}")
for path in sorted(glob.glob(os.path.join(out, "*-selftest-*.json"))):
    try:
        d = json.load(open(path))
    except ValueError:
        print(f"{os.path.basename(path)}: unreadable"); continue
    for v in d.get("verdicts", []):
        print(f"{v['kernel']:<14} {v['layout']:<24} {','.join(v.get('presets', [])):<30} {v['verdict'][:48]:<48} {str(v['cached']):<6}")
for path in sorted(glob.glob(os.path.join(out, "*-doctor-*.json"))):
    try:
        d = json.load(open(path))
    except ValueError:
        print(f"{os.path.basename(path)}: no JSON (see log)"); continue
    prov = d.get("provision", {})
    mix = d.get("mixers", {}).get("mixers", [])
    paths = "; ".join(f"{m['count']}x {m['path']}" for m in mix)
    patched = "; ".join(f"{m['count']}x {m['path']}" for m in d.get("mixers_hybridtune", {}).get("mixers", []))
    tests = "; ".join(f"{v['kernel']} {v['layout']}: {v['verdict']}" for v in prov.get("selftest", []))
    print(f"doctor {d['model']['spec']}: fast_path={prov.get('fast_path')} gaps={prov.get('gaps')}")
    print(f"  stock: {paths}\n  hybridtune: {patched}\n  self-test: {tests or 'none'}")
PY
echo "outputs in $OUT" | tee -a "$LOG"
