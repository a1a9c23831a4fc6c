"""The sweep and `hybridtune compile` on the hybrid families (the full sweep runs in CI's compat script)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybridtune.compiler.modules.sweep import all_families, run_sweep

pytestmark = pytest.mark.transformers_compat  # reads transformers' code: run again under another release (CI)

HYBRID = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "mamba", "lfm2"]


def test_sweep_hybrid_families_has_no_failures():
    present = [f for f in HYBRID if f in all_families()]
    report = run_sweep(present)
    totals = report.totals()
    assert totals["failures"] == 0, report.failures()
    assert totals["generated"] > 0
    assert totals["decorated_forwards"] > 0
    # Every forward hidden behind a bare closure (transformers 5.13-5.15) is generated all the same.
    assert totals["bare_closure_generated"] == totals["bare_closure_forwards"]


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "hybridtune", "compile", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow  # three fresh interpreters, each importing the compiler stack
def test_cli_family_dump_and_check(tmp_path):
    dump = tmp_path / "gen"
    r = _cli("--family", "qwen3_5", "--backend", "eager", "--dump", str(dump))
    assert r.returncode == 0, r.stderr
    assert "Qwen3_5GatedDeltaNet" in r.stdout and "eager" in r.stdout
    files = json.loads((dump / "MANIFEST.json").read_text())
    assert "modeling_qwen3_5_hybridtune.py" in files
    text = (dump / "modeling_qwen3_5_hybridtune.py").read_text()
    assert "def Qwen3_5GatedDeltaNet_forward(" in text and "def wrapped" not in text
    r = _cli("--family", "qwen3_5", "--backend", "eager", "--check", str(dump))
    assert r.returncode == 0, r.stderr
    (dump / "modeling_qwen3_5_hybridtune.py").write_text(text + "\nprint('edited')\n")
    r = _cli("--family", "qwen3_5", "--backend", "eager", "--check", str(dump))
    assert r.returncode == 2 and "does not match" in r.stderr


def test_cli_errors_are_one_line():
    r = _cli("--family", "qwen3_55")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "qwen3_5" in r.stderr
    r = _cli()
    assert r.returncode == 2


@pytest.mark.slow  # a fresh interpreter sweeping two families
@pytest.mark.parametrize("fmt", ["--json"])
def test_cli_sweep_json(fmt):
    r = _cli("--sweep", "--families", "qwen3_5,mamba", fmt, "--jobs", "1")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["totals"]["failures"] == 0 and data["totals"]["families"] == 2
