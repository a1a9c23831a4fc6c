#!/usr/bin/env bash
# Kernel resolver on the GPU machine: the self-test verdict table for the Qwen3.5 0.8B/2B/9B head layouts
# and `hybridtune doctor --json` for the tiny Qwen3.5 / Qwen3-Next presets and the 2B preset.
#
# Run from the repo root with the FLA wheels in .whl/ (bash ../shared/tools/gpu-wheels.sh), carry [".whl"]:
#   HYBRIDTUNE_GIT_COMMIT=<sha> bash bench/kernels/gpu_doctor.sh
# Writes to $OUT (default ./outputs/gpu_doctor): one JSON per step, each with the command, git commit,
# versions and device, plus the full log. Every step has its own timeout inside a 570 s overall budget, so
# a slow first Triton compile costs the later steps, never the files already written.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/outputs/gpu_doctor}
mkdir -p "$OUT"
LOG="$OUT/gpu_doctor.log"
BUDGET=${BUDGET:-570}
DATE=$(date -u +%Y-%m-%d)
export HYBRIDTUNE_GIT_COMMIT=${HYBRIDTUNE_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
# Verdicts of this run only: a fresh cache, kept with the outputs.
export HYBRIDTUNE_CACHE_DIR="${HYBRIDTUNE_CACHE_DIR:-/tmp/hybridtune-cache-$$}"  # not under $OUT: only 8 files come back

{
  echo "== install wheels from .whl into /tmp/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
} 2>&1 | tee "$LOG"
export PYTHONPATH=/tmp/site:$PWD/src
python3 -c "import einops" 2>/dev/null || echo "WARNING: einops missing; FLA's conv will not import (add einops==0.8.1 to gpu-wheels.sh)" | tee -a "$LOG"
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

for preset in tiny-qwen3_5 tiny-qwen3_next qwen3_5-2b; do
  f="$OUT/$DATE-doctor-$preset.json"
  echo "== doctor $preset (timeout cap 90s)" | tee -a "$LOG"
  t=$(( $(left) < 90 ? $(left) : 90 ))
  if (( t < 20 )); then echo "== doctor $preset: skipped, budget spent" | tee -a "$LOG"; continue; fi
  timeout "$t" python3 -m hybridtune doctor --model "$preset" --json > "$f" 2> >(tee -a "$LOG" >&2)
  echo "== doctor $preset: rc=$? at ${SECONDS}s" | tee -a "$LOG"
  wrap "$f" "python3 -m hybridtune doctor --model $preset --json"
done

# The GPU tests of tests/kernels (the same check through pytest), when pytest is there and time is left.
if python3 -c "import pytest" 2>/dev/null; then
  step pytest-cuda 150 python3 -m pytest tests/kernels/test_selftest.py -m cuda -q -p no:cacheprovider
else
  echo "== pytest-cuda: skipped, pytest not installed" | tee -a "$LOG"
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
echo "outputs in $OUT; copy *-selftest-*.json and *-doctor-*.json to bench/results/" | tee -a "$LOG"
