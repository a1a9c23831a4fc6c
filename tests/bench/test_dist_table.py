"""hybridtune.bench.table: the figures the scaling table and scaling.json report (medians, windows, pairs)."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from hybridtune.bench import table


def write_run(d: Path, name: str, rates: dict[int, float], profiled: tuple[int, int] | None = None) -> None:
    recs = [{"type": "train", "step": s, "loss": 10.0 / s, "tokens_per_s": r, "mem_gib": 1.5} for s, r in rates.items()]
    (d / f"{name}.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / f"{name}.log").write_text("...\nrc 0\n")
    if profiled:
        (d / f"{name}.profile.json").write_text(json.dumps({"steps": list(profiled), "world": 1, "ranks": []}))


def test_median_of_windows_after_step_10_without_the_profiled_one(tmp_path):
    rng = random.Random()
    seed = rng.randrange(10**6)
    rng.seed(seed)
    rates = {s: rng.uniform(1e4, 5e4) for s in (1, 5, 10, 15, 20, 25, 30, 35)}
    write_run(tmp_path, "lora-1", rates, profiled=(11, 13))
    two = {s: r * 2 * 0.9 for s, r in rates.items()}
    write_run(tmp_path, "lora-2", two, profiled=(11, 13))
    got = table.run(tmp_path, "lora-1")
    want = statistics.median([rates[s] for s in (20, 25, 30, 35)])  # 15's window (11-15) holds the profile
    assert got["tokens_per_s"] == pytest.approx(want), seed
    assert got["windows_used"] == [[16, 20], [21, 25], [26, 30], [31, 35]]
    assert got["windows"][0] == {"steps": [2, 5], "tokens_per_s": rates[5]}  # step 1 (compilation) is no window

    out = tmp_path / "s.json"
    assert (
        table.main([str(tmp_path), "--json", str(out), "--call", f"{tmp_path.name}=HYBRIDTUNE_GIT_COMMIT=abc1234 x"])
        == 0
    )
    doc = json.loads(out.read_text())
    (pair,) = doc["scaling"]
    assert pair["efficiency"] == pytest.approx(0.9) and pair["same_call"], seed
    assert doc["calls"][tmp_path.name]["commit"] == "abc1234"


def test_a_run_without_a_late_window_has_no_figure(tmp_path):
    write_run(tmp_path, "full-2", {1: 100.0, 5: 5e4, 10: 5e4})
    write_run(tmp_path, "full-1", {1: 100.0, 5: 3e4, 10: 3e4, 15: 3e4})
    got = table.run(tmp_path, "full-2")
    assert "tokens_per_s" not in got and got["status"] == "no window after step 10"
    assert "| full-2 | | | no window after step 10 |" in table.table(tmp_path)
    assert table.scaling([{**table.run(tmp_path, n), "id": n, "dir": "x"} for n in ("full-1", "full-2")]) == []


def test_pairs_keep_to_their_variant(tmp_path):
    """full-2m (per-layer FSDP2 under modules) pairs with full-1m only; lora-1t1 (one thread) with lora-2."""
    rates = {1: 1.0, 5: 1.0, 15: 1.0, 20: 1.0}
    for name in ("full-1", "full-1m", "full-2m", "lora-1t1", "lora-2"):
        write_run(tmp_path, name, rates)
    runs = [{**table.run(tmp_path, n), "id": n, "dir": "x"} for n in table.names(tmp_path)]
    runs = [r for r in runs if r["status"] == "ok"]
    assert sorted((p["two"], p["one"]) for p in table.scaling(runs)) == [("full-2m", "full-1m"), ("lora-2", "lora-1t1")]


def test_rc_is_the_runner_line_not_what_the_results_tool_appended(tmp_path):
    """single_gpu.sh appends `rc N at Ns`, then the results tool's own messages to the same log (tee -a): a message
    written while the tool starts came last and was recorded as the run's rc (rows 87-88 of 2026-12-02)."""
    write_run(tmp_path, "lora-1", {1: 1.0, 15: 2.0})
    log = tmp_path / "lora-1.log"
    log.write_text("step 1\nrc 0 at 271s\nHYBRIDTUNE_GIT_COMMIT=abc differs from the tree's git HEAD; recording abc\n")
    assert table.run(tmp_path, "lora-1")["rc"] == "rc 0 at 271s"
    log.write_text("killed before the runner could say\n")
    assert table.run(tmp_path, "lora-1")["rc"] == "no rc line"
    log.unlink()
    assert table.run(tmp_path, "lora-1")["rc"] == "not run"
