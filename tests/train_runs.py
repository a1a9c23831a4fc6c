"""Builders of tiny training runs for tests (plain functions, not fixtures: they are called from parametrized tests,
from other helpers and with varying keys, so a fixture would only wrap them). Import as
`from train_runs import make_cfg, run` (tests/ is on the path, as for tests/checkpoints.py).

- `make_cfg(out, data, **kw)`: a short LoRA run's config (8 steps of 64 tokens, dropout on so that the RNG state
  matters for an exact resume); keys in `kw` override.
- `run(cfg, stop_after=None)`: the Trainer's result; `stop_after=N` raises KeyboardInterrupt after step N's log.
- `run_static(out, data, max_steps=3, **kw)`: (trainer, result) of a run over the static layout with an eval every
  2 steps and no dropout, dynamo reset afterwards (the compiled-loop tests compare such runs).
- `record_run(out, cfg, data=None)`: `out` holds the run of `cfg` (its run file, as claim_output_dir writes it),
  `data` the recorded data fingerprint (default: `cfg`'s own).
- `metrics_rows(out, kind)`: the records of `out`/metrics.jsonl whose type is `kind` ("train", "eval", ...).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hybridtune.config import load_config, to_dict
from hybridtune.run import outdir
from hybridtune.train.trainer import Trainer


def make_cfg(out, data, **kw):
    base = dict(
        dataset=data,
        sequence_len=64,
        max_steps=8,
        eval_steps=0,
        logging_steps=1,
        output_dir=str(out),
        val_set_size=8,
        warmup_steps=2,
        gradient_accumulation_steps=2,
        lora_dropout=0.1,  # dropout makes the RNG state matter for exact resume
    )
    base.update(kw)
    return load_config(None, base)


def run(cfg, stop_after: int | None = None):
    t = Trainer(cfg)
    t.setup()
    if stop_after is not None:

        def interrupt(rec):
            if rec["step"] == stop_after:
                raise KeyboardInterrupt

        t.on_log = interrupt
    return t.train()


def run_static(out, data, max_steps=3, **kw):
    """The trainer's run of `kw` over `data` in `out` (static layout, eval every 2 steps); (trainer, result)."""
    cfg = make_cfg(out, data, max_steps=max_steps, eval_steps=2, lora_dropout=0.0, pack_layout="static", **kw)
    t = Trainer(cfg)
    t.setup()
    try:
        return t, t.train()
    finally:
        torch._dynamo.reset()


def record_run(out, cfg, data=None) -> None:
    """`out` holds the run of `cfg` (its run file, as claim_output_dir writes it)."""
    out.mkdir(parents=True, exist_ok=True)
    record = {"config": to_dict(cfg), "data": outdir.data_fingerprint(cfg) if data is None else data, "cwd": "."}
    (out / outdir.RUN_FILE).write_text(json.dumps(record))


def metrics_rows(out: Path, kind: str) -> list[dict]:
    """The records of `out`/metrics.jsonl whose type is `kind`."""
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == kind]
