"""Fault injection: `hybridtune train` is interrupted by SIGINT, SIGTERM or SIGKILL at random points of its steps
and saves, many times, and resumed each time; the finished run's loss curve equals an uninterrupted run's exactly
(CPU, one thread: bitwise deterministic), each step logged once, and the final model the same."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

STEPS = 30
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _command(data: str, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hybridtune",
        "train",
        "--dataset",
        data,
        "--sequence_len",
        "64",
        "--max_steps",
        str(STEPS),
        "--save_steps",
        "1",  # a save after every step: a random point often falls inside one
        "--save_total_limit",
        "2",
        "--eval_steps",
        "0",
        "--val_set_size",
        "8",
        "--logging_steps",
        "1",
        "--lora_dropout",
        "0.1",  # dropout: the RNG state must resume exactly too
        "--adapter",
        "lora",
        "--warmup_steps",
        "2",
        "--device",
        "cpu",
        "--output_dir",
        str(out),
    ]


def _losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if r["type"] == "train"]


def _logged_steps(out: Path) -> int:
    try:
        return len((out / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def test_random_sigint_sigterm_sigkill_resume_on_the_uninterrupted_curve(tmp_path, small_data):
    ref = tmp_path / "ref"
    r = subprocess.run(_command(small_data, ref), env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    want = _losses(ref)
    assert [s for s, _ in want] == list(range(1, STEPS + 1))

    seed = random.randrange(2**32)
    rng = random.Random(seed)
    out = tmp_path / "faulty"
    faults, finished = [], False
    for _attempt in range(12):
        cmd = _command(small_data, out)
        if any(out.glob("checkpoint-*/checkpoint.json")):
            cmd += ["--resume_from_checkpoint", "latest"]
        proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if len(faults) < 8:
            # Wait until training runs (a step logged since this start), then a random moment inside the steps.
            start = _logged_steps(out)
            deadline = time.monotonic() + 300
            while _logged_steps(out) <= start and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 0.8))
            sig = rng.choice([signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
            if proc.poll() is None:
                proc.send_signal(sig)
                faults.append(sig.name)
        _, err = proc.communicate(timeout=600)
        if proc.returncode == 0 and (out / "final").is_dir():
            finished = True
            break
        assert proc.returncode in (130, 143, -signal.SIGKILL, -signal.SIGTERM, -signal.SIGINT), (
            seed,
            faults,
            err[-3000:],
        )
    assert finished, (seed, faults)
    assert len(faults) >= 3, (seed, faults)  # the run was really interrupted, several ways
    got = _losses(out)
    assert got == want, (seed, faults, got, want)  # every step once, bit for bit
    a = load_file(str(ref / "final" / "adapter_model.safetensors"))
    b = load_file(str(out / "final" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (seed, faults)


@pytest.mark.torchrun
def test_ctrl_c_under_nproc_saves_on_every_rank_and_resumes_on_the_curve(tmp_path, small_data):
    """A terminal's Ctrl-C reaches the launcher and both ranks (and torchrun passes it on): the ranks agree on the
    step to stop after, save it together, and the run resumes in two processes on the uninterrupted curve."""
    steps = 24
    base = [a for a in _command(small_data, tmp_path) if a != str(tmp_path)]
    base = base[: base.index("--output_dir")] + ["--gradient_accumulation_steps", "2", "--nproc", "2"]
    base[base.index("--max_steps") + 1] = str(steps)
    base[base.index("--save_steps") + 1] = "0"  # the only checkpoint is the one the interrupt writes

    ref = tmp_path / "ref"
    r = subprocess.run([*base, "--output_dir", str(ref)], env=ENV, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    want = _losses(ref)

    out = tmp_path / "out"
    proc = subprocess.Popen(
        [*base, "--output_dir", str(out)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the Ctrl-C below reaches it all, as a terminal's does
    )
    deadline = time.monotonic() + 600
    while _logged_steps(out) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err[-3000:]
    saved = [p.name for p in out.glob("checkpoint-*")]
    assert len(saved) == 1 and "continue from " + saved[0] in err, err[-3000:]
    assert (out / saved[0] / "rng-1.pt").is_file()  # both ranks wrote it
    r = subprocess.run(
        [*base, "--output_dir", str(out), "--resume_from_checkpoint", "latest"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert _losses(out) == want
