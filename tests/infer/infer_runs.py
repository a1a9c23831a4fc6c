"""What the tests of tests/infer share besides fixtures (a module of its own: `from conftest import ...` finds
whichever directory's conftest was imported first when several test directories are collected together)."""

from __future__ import annotations

import json
from pathlib import Path

from hybridtune.config import load_config

PROMPTS = ["3+4=", "17+25=", "What is 40+2?"]


def run_config(out: Path, data: str, preset: str, adapter: str, **kw):
    keys = dict(
        base_model=preset,
        dataset=data,
        adapter=adapter,
        sequence_len=64,
        max_steps=4,
        save_steps=2,  # checkpoint-2 (mid-run) and checkpoint-4
        eval_steps=2,  # logged evals at steps 0, 2 and 4
        logging_steps=1,
        val_set_size=8,
        warmup_steps=1,
        learning_rate=1e-2,
        output_dir=str(out),
    )
    keys.update(kw)
    return load_config(None, keys, warn=False)


def logged_evals(out: Path) -> dict[int, dict]:
    """The trainer's eval rows of metrics.jsonl by step."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows if r.get("type") == "eval"}
