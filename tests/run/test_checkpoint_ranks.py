"""Checksums over real ranks: every rank hashes its share of the files at save and at verification (collectives
that must neither hang nor miss a rank's file), under DDP and FSDP2 on gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

RANK = """
import json, pathlib, sys
import torch
from torch import nn
from hybridtune.run import checkpoint as ckpt
from hybridtune.run.resume import find_resume, load_checkpoint
from hybridtune.runtime import distributed
from hybridtune.runtime.adapter_kind import FULL

out, engine = pathlib.Path(sys.argv[1]), sys.argv[2]
d = distributed.init(engine, FULL, "cpu")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 4))
if engine == "fsdp":
    from torch.distributed.fsdp import fully_shard
    fully_shard(model)
else:
    model = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
for n in range(1, 5):  # the schedule steps with the optimizer: a checkpoint's step is its schedule's (resume checks)
    model(torch.randn(8, 32)).pow(2).mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    if n % 2 == 0:
        ckpt.save_checkpoint(out / f"checkpoint-{n}", model, opt, sched, n, {"index": n}, d=d)
intact = ckpt.verify_checkpoint(out / "checkpoint-4", d)
distributed.barrier(d)
if d.is_main:  # damage a file the other rank wrote
    victim = sorted((out / "checkpoint-4").glob("rng-1.pt"))[0]
    victim.write_bytes(victim.read_bytes()[:-1] + b"?")
distributed.barrier(d)
path, skipped = find_resume("latest", out, d)
state = load_checkpoint(path, model, opt, sched, d, verified=True)
got = {"intact": intact, "path": path.name, "skipped": skipped, "step": state["step"]}
(out / f"rank{d.rank}.json").write_text(json.dumps(got))
distributed.shutdown(d)
"""


@pytest.mark.slow
@pytest.mark.torchrun
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_checksums_over_two_ranks(tmp_path, engine):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    r = subprocess.run([*cmd, str(out), engine], env=ENV, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-4000:]
    files = json.loads((out / "checkpoint-4" / "checkpoint.json").read_text())["files"]
    assert {"rng-0.pt", "rng-1.pt", "trainer_state.pt", "state/.metadata"} <= files.keys()
    got = [json.loads((out / f"rank{k}.json").read_text()) for k in (0, 1)]
    want = {
        "intact": None,
        "path": "checkpoint-2",
        "skipped": [
            "resume_from_checkpoint latest: skipped checkpoint-4 (rng-1.pt does not match its sha256 in "
            "checkpoint.json (corrupt, or changed since it was saved)); resuming from checkpoint-2"
        ],
        "step": 2,
    }
    assert got == [want, want], got
