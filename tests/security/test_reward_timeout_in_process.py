"""`reward_timeout` with `reward_processes: 0`: a reward running in the training process cannot be stopped, so the
timeout the user set did nothing, silently (a 30 s reward under `reward_timeout: 2` ran its 30 s, rc 0). Said in a
config warning naming both keys; with worker processes, or when the timeout is not given, nothing is said."""

from __future__ import annotations

import random

from hybridtune.config import config_warnings, load_config


def _warnings(over: dict) -> list[str]:
    cfg = load_config(None, {"objective": "grpo", "reward_funcs": ["exact_answer"], **over}, warn=False)
    return [w for w in config_warnings(cfg, set(over)) if "reward_timeout" in w]


def test_a_timeout_in_process_is_said():
    t = random.choice([1.5, 2, 7, 42.25])
    (line,) = _warnings({"reward_timeout": t})
    assert f"reward_timeout = {t:g}" in line and "reward_processes: 0" in line


def test_with_workers_or_no_timeout_nothing_is_said():
    assert _warnings({"reward_timeout": random.uniform(1, 9), "reward_processes": random.randrange(1, 4)}) == []
    assert _warnings({"reward_processes": 0}) == []
