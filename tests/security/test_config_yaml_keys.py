"""A key given twice in a config (a merge or copy-paste slip) was resolved to its last value without a word
(REDTEAM2 defect 10): it is one line naming the key and both lines, exit 2, nothing run. A YAML merge key
(`<<: *base`) is YAML's own and stays accepted, its values overridable."""

from __future__ import annotations

import random

import pytest

from hybridtune.config import load_config
from hybridtune.errors import ConfigError


def test_a_top_level_key_given_twice_names_both_lines(tmp_path, error_line):
    rng = random.Random()
    before = rng.randint(0, 5)  # other keys before the first, so the lines are not fixed
    between = rng.randint(0, 5)
    lines = [f"# comment {i}" for i in range(before)]
    lines.append("base_model: tiny-qwen3_5")
    lines += [f"# between {i}" for i in range(between)]
    lines.append("base_model: tiny-qwen3_next")
    config = tmp_path / "dup.yaml"
    config.write_text("\n".join(lines) + "\n")
    first, second = before + 1, before + between + 2
    line = error_line(["data", str(config)])
    assert line == (
        f"error: {config}:{second}: key 'base_model' given twice (lines {first} and {second}); "
        "keep one (YAML keeps the last)"
    )


def test_every_key_given_twice_is_named_at_once_nested_ones_too(tmp_path):
    config = tmp_path / "dup.yaml"
    config.write_text(
        "lr_scheduler: cosine\ndatasets:\n  - path: a.jsonl\n    type: chat\n    path: b.jsonl\nlr_scheduler: linear\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(config, warn=False)
    text = str(e.value)
    assert "2 problems in the config" in text
    assert f"{config}:5: key 'path' given twice (lines 3 and 5)" in text
    assert f"{config}:6: key 'lr_scheduler' given twice (lines 1 and 6)" in text


def test_a_key_given_twice_on_the_command_line_value(error_line):
    line = error_line(["data", "--datasets", "[{path: a.jsonl, path: b.jsonl}]"])
    assert line == "error: command line: key 'path' given twice; keep one (YAML keeps the last)"


def test_a_yaml_merge_key_is_not_a_duplicate(tmp_path):
    rate = random.choice([1e-4, 3e-4, 5e-5])
    config = tmp_path / "merge.yaml"
    config.write_text(
        f"base: &b\n  path: {tmp_path}/a.jsonl\n  type: chat\n"
        "datasets:\n  - <<: *b\n    type: alpaca\n"
        f"learning_rate: {rate}\n"
    )
    with pytest.raises(ConfigError, match="unknown config key 'base'"):  # (an anchor needs a key of its own)
        load_config(config, warn=False)
    config.write_text(
        f"datasets:\n  - &b\n    path: {tmp_path}/a.jsonl\n    type: chat\n  - <<: *b\n    type: alpaca\n"
        f"learning_rate: {rate}\n"
    )
    cfg = load_config(config, warn=False)
    assert [d.type for d in cfg.datasets] == ["chat", "alpaca"] and cfg.learning_rate == rate
