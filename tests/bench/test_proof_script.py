"""benchmarks/proof.sh, issue 49's GPU proof, rehearsed part by part on the CPU with tiny shapes (REHEARSAL=1), so no
lent GPU call dies on a flag, a path or a missing module: each step of each part runs to exit 0 and says so in
proof.log, and the files a call brings back are at most 8, no deeper than $OUT/x/y. Without a part it prints its
usage; an unknown part is one line, exit 2."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "proof.sh"
STEPS = {
    "cuda": ["cuda tier", "generation"],
    "preference": ["dpo", "grpo pair"],
    "vision": ["vision"],
}


def _run(tmp_path, *args, timeout=900, **env):
    full = {**os.environ, "PY": sys.executable, "NO_RESULTS": "1", "OUT": str(tmp_path / "out"),
            "R": str(tmp_path / "r"), "REHEARSAL": "1", "NPROC": "1", **env}  # fmt: skip
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_usage_and_an_unknown_part(tmp_path):
    usage = _run(tmp_path)
    assert usage.returncode == 0 and "proof.sh PART" in usage.stdout
    for part in STEPS:
        assert re.search(rf"^  {part} ", usage.stdout, re.M), part
    bad = _run(tmp_path, "cudaa")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: unknown part 'cudaa': give cuda, preference or vision"
    ]


@pytest.mark.slow
@pytest.mark.parametrize("part", list(STEPS), ids=lambda part: f"part_{part}")  # (an id "cuda" reads as the marker)
def test_each_part_runs_every_step_on_the_cpu(tmp_path, part):
    done = _run(tmp_path, part)
    out = tmp_path / "out"
    log = (out / "proof.log").read_text()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for step in STEPS[part]:
        assert re.search(rf"^== {step}: rc 0 at \d+ s$", log, re.M), (step, log[-3000:])
    assert f"== proof.sh {part} done at" in log
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 2 <= len(files) <= 8 and all(len(p.relative_to(out).parts) <= 3 for p in files), files
    assert (out / "work.tar.gz").stat().st_size > 0
