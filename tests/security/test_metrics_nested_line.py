"""A run's metrics.jsonl holding a line nested past Python's recursion limit (a hand edit, another tool): a resume
ended in a RecursionError traceback (rc 1) reading the log, and the curves were skipped whole. The line is dropped
as a torn one is; the run's own records are kept and drawn."""

from __future__ import annotations

import json
import random

from hybridtune.run.plots import read_metrics
from hybridtune.runtime.metrics import MetricsLog


def _log(tmp_path):
    rng = random.Random()
    steps = rng.randrange(3, 9)
    rows = [json.dumps({"step": s, "kind": "train", "loss": rng.uniform(1, 9)}) for s in range(1, steps + 1)]
    depth = rng.randrange(50_000, 120_000)
    rows.insert(rng.randrange(len(rows)), '{"step": 1, "a": ' + "[" * depth + "]" * depth + "}")
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path, steps


def test_a_resume_drops_a_deep_line(tmp_path):
    path, steps = _log(tmp_path)
    after = random.randrange(1, steps)
    MetricsLog(path, truncate=False, after_step=after).close()
    kept = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in kept] == list(range(1, after + 1))


def test_the_curves_read_past_a_deep_line(tmp_path):
    path, steps = _log(tmp_path)
    assert [r["step"] for r in read_metrics(path)] == list(range(1, steps + 1))
