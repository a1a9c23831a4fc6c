"""`profile_steps`: a profile of a few training steps that does not change the run, and its interval sums."""

from __future__ import annotations

import json
import logging
import random

from test_resume import make_cfg, run

from hybridtune.train.loop import PROFILE_FILE, profile_window
from hybridtune.train.profiling import exposed_length, kernel_group, union_length


def _covered(intervals, length):
    on = [False] * length
    for s, e in intervals:
        for t in range(s, e):
            on[t] = True
    return on


def test_union_and_exposed_lengths_against_a_timeline():
    rng = random.Random()  # fresh intervals each run: the sums must hold for any
    for _ in range(200):
        comm, compute = [], []
        for group in (comm, compute):
            for _ in range(rng.randrange(0, 7)):
                s = rng.randrange(0, 97)
                group.append((s, s + rng.randrange(1, 20)))
        c, k = _covered(comm, 120), _covered(compute, 120)
        assert union_length(comm + compute) == sum(a or b for a, b in zip(c, k))
        assert exposed_length(comm, compute) == sum(a and not b for a, b in zip(c, k))


def test_collectives_are_communication_not_reductions():
    assert kernel_group("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == (
        "communication"
    )
    assert kernel_group("ncclDevKernel_AllGather_RING_LL") == "communication"
    assert kernel_group("triton_red_fused__to_copy_logsumexp_2") == "inductor fused"
    assert kernel_group("void at::native::reduce_kernel<512, 1>") == "reduction"


def test_profile_window():
    assert profile_window(0, 100, 0) is None
    assert profile_window(3, 100, 0) == (11, 13)  # past the compile and the first shapes' recompiles
    assert profile_window(3, 8, 0) == (6, 8)  # a short run: its last steps
    assert profile_window(3, 100, 50) == (52, 54)  # resumed at 50: never this process's first step
    assert profile_window(5, 4, 0) == (2, 4)  # room for 3 of 5 (warned)
    assert profile_window(3, 1, 0) is None


def test_profiled_run_writes_its_profile_and_trains_the_same(tmp_path, small_data, caplog):
    plain = run(make_cfg(tmp_path / "plain", small_data, max_steps=5))
    with caplog.at_level(logging.INFO, logger="hybridtune"):
        profiled = run(make_cfg(tmp_path / "prof", small_data, max_steps=5, profile_steps=2))
    assert profiled.losses == plain.losses  # the profiler watches; it changes nothing
    doc = json.loads((tmp_path / "prof" / PROFILE_FILE).read_text())
    assert doc["steps"] == [4, 5] and doc["world"] == 1 and len(doc["ranks"]) == 1
    p = doc["ranks"][0]
    assert p["steps"] == 2 and p["wall_ms_per_step"] > 0 and p["cpu_self_ms_total_per_step"] > 0
    assert any("addmm" in name or "mm" in name for name, _, _ in p["cpu_self_ms_per_step"])
    assert "gpu_ms_per_step" not in p  # CPU: no GPU fields rather than zeros
    assert any("profile of steps 4-5 (rank 0)" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "plain" / PROFILE_FILE).exists()
