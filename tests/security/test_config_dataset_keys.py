"""`dataset` and `datasets` given in one place: `dataset` replaces `datasets`, so one of them was dropped without a
word (`--dataset a --datasets b` read a alone). Refused in one line naming where; the command line's `--dataset`
over a file's `datasets` stays an override, and a run record's keys (passed as overrides) still load."""

from __future__ import annotations

import random

import pytest

from hybridtune.config import load_config, parse_overrides
from hybridtune.errors import ConfigError


def _names(tmp_path, n):
    rng = random.Random()
    return [str(tmp_path / f"d{rng.randrange(10**6)}_{k}.jsonl") for k in range(n)]


def test_both_on_the_command_line_is_one_line(tmp_path):
    a, b, c = _names(tmp_path, 3)
    with pytest.raises(ConfigError, match=r"^command line: config keys 'dataset' and 'datasets' are both given"):
        parse_overrides(["--dataset", a, "--datasets", f"{b},{c}"])
    with pytest.raises(ConfigError, match="both given"):  # (either order)
        parse_overrides(["--datasets", b, "--dataset", a])


def test_both_in_one_file_names_its_line(tmp_path):
    a, b = _names(tmp_path, 2)
    pad = "\n" * random.randrange(1, 5)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"base_model: tiny-qwen3_5{pad}dataset: {a}\ndatasets:\n  - path: {b}\n")
    line = 2 + len(pad) - 1
    with pytest.raises(ConfigError, match=rf"c\.yaml:{line}: config keys 'dataset' and 'datasets' are both given"):
        load_config(cfg, {})


def test_an_override_and_a_record_still_load(tmp_path):
    a, b, c = _names(tmp_path, 3)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"base_model: tiny-qwen3_5\ndatasets:\n  - path: {b}\n")
    got = load_config(cfg, parse_overrides(["--dataset", a, "--dataset", c]), warn=False, training=False)
    assert [d.path for d in got.resolved_datasets()] == [a, c]
    record = {"base_model": "tiny-qwen3_5", "dataset": a, "datasets": [{"path": b}]}  # (as a run records it)
    assert [d.path for d in load_config(None, record, warn=False, training=False).resolved_datasets()] == [a]
