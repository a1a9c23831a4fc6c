"""What the torchrun tests share (plain builders and checks, also imported by the ranks' own scripts, so not
fixtures): the child environment, a short run's settings as CLI arguments, one process's run in this one, the train
records of metrics.jsonl, the comparison of two loss curves, and a 2-process torchrun of a script.

Tolerances (LOSS_RTOL, GRAD_NORM_RTOL): tests/runtime/test_distributed.py's docstring says why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridtune.config import load_config
from hybridtune.train.trainer import Trainer

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
LOSS_RTOL = 1e-5
EVAL_RTOL_STEP0 = 1e-9
GRAD_NORM_RTOL = 1e-4
STEPS = 4


def settings(data: str, adapter: str, **kw) -> dict:
    s = dict(
        dataset=data,
        adapter=adapter,
        sequence_len=64,
        max_steps=STEPS,
        eval_steps=0,
        logging_steps=1,
        val_set_size=8,
        warmup_steps=2,
        gradient_accumulation_steps=4,
        save_steps=2,
    )
    s.update({k: str(v) if isinstance(v, Path) else v for k, v in kw.items()})
    return s


def args(s: dict) -> list[str]:
    return [x for k, v in s.items() for x in (f"--{k}", str(v))]


def train_here(s: dict) -> list[dict]:
    """One process, in this one: the train records of metrics.jsonl."""
    t = Trainer(load_config(None, s))
    t.setup()
    t.train()
    return records(Path(s["output_dir"]))


def records(out: Path, kind: str = "train") -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == kind]


def assert_same_curve(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=LOSS_RTOL), (g["step"], got, want)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=GRAD_NORM_RTOL), (g["step"], got, want)
        assert g["tokens"] == w["tokens"] and g["loss_tokens"] == w["loss_tokens"]  # the same global batch


def mismatches(want: dict, got: dict) -> list[str]:
    """The parameters of a plain load (`want`) that the sharded one (`got`, DTensors) lacks or holds otherwise:
    another dtype, another requires_grad, or other values once gathered."""
    return [
        n for n in want
        if n not in got or got[n].dtype != want[n].dtype or got[n].requires_grad != want[n].requires_grad
        or not torch.equal(got[n].full_tensor(), want[n])
    ]  # fmt: skip


def launch_ranks(out, script_text: str, args: list[str]) -> list[dict]:
    """Run `script_text` as a 2-process torchrun (gloo) in `out` with `args`; each rank's `out/rank{k}.json`. The
    meta build must have logged the sharded load (rank 0 logs every rank's figures)."""
    script = out / "ranks.py"
    script.write_text(script_text)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    r = subprocess.run([*cmd, *args], env=ENV, capture_output=True, text=True, timeout=500)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "sharded load: rank 1 holds" in r.stderr, r.stderr[-2000:]
    return [json.loads((out / f"rank{k}.json").read_text()) for k in (0, 1)]
