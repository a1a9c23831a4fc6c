"""Tiny trained runs (a few steps of the Trainer on the CPU) that the use-the-model commands open: one per
preset family and adapter, trained once per session on demand."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from infer_runs import run_config

from hybridtune.train.trainer import Trainer


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory) -> str:
    """Arithmetic chats (as the bundled sample), small enough that a run takes seconds."""
    rng = random.Random(0)
    rows = []
    for _ in range(60):
        a, b = rng.randrange(50), rng.randrange(50)
        rows.append(
            {"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}]}
        )
    path = tmp_path_factory.mktemp("infer-data") / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def trained(tmp_path_factory, chat_data):
    """`trained(preset, adapter) -> output dir` of a finished 4-step run (final/, checkpoint-2/, checkpoint-4/)."""
    runs: dict[tuple[str, str], Path] = {}

    def get(preset: str, adapter: str) -> Path:
        if (preset, adapter) not in runs:
            out = tmp_path_factory.mktemp(f"run-{preset}-{adapter}")
            t = Trainer(run_config(out, chat_data, preset, adapter))
            t.setup()
            t.train()
            runs[preset, adapter] = out
        return runs[preset, adapter]

    return get
