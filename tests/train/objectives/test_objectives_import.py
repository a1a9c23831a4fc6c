"""What importing the objectives costs: `hybridtune eval`, `hybridtune data` and `hybridtune bench` import
train.objectives (its specs' table imports every built-in objective's modules) at their start, `--help` included;
transformers' trainer stack (TrainerState's module, which loads torchao: seconds, and its load warnings on stderr) is
only grpo's rollouts', when a grpo run builds them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HEAVY = ("transformers.trainer_callback", "torchao")


def test_the_objectives_import_without_the_trainer_stack():
    code = (
        "import sys\n"
        "import hybridtune.train.objectives, hybridtune.infer.evaluate, hybridtune.infer.data_preview\n"
        "import hybridtune.bench.modes\n"
        f"print('loaded', [m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    src = str(Path(__file__).resolve().parents[3] / "src")
    env = {**os.environ, "PYTHONPATH": src}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines()[-1] == "loaded []", r.stdout[-500:]
