"""What `hybridtune --help` and `hybridtune train --help` say about the defaults: a full fine-tune (not LoRA),
where the presets are listed, what else `base_model` takes, and the bundled example configs."""

from __future__ import annotations

import re

from hybridtune.cli import main
from hybridtune.config import TrainConfig, bundled_configs, config_help, objective_names


def _out(capsys, *argv: str) -> str:
    capsys.readouterr()
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_train_help_says_the_default_is_a_full_fine_tune(capsys):
    text = _out(capsys, "train", "--help")
    intro = text.split("config keys")[0]
    assert TrainConfig().adapter == "full"
    assert "The default is a full fine-tune" in intro and "--adapter lora trains a\nLoRA adapter instead" in intro
    assert "With no arguments: a full fine-tune of the tiny Qwen3.5 preset (random weights)" in intro
    assert not re.search(r"no arguments: LoRA", intro)
    adapter = text.split("  --adapter ", 1)[1].split("\n  --", 1)[0]
    assert "default 'full'" in adapter and adapter.split("\n")[1].strip().startswith("full fine-tune (default")


def test_base_model_help_names_doctor_checkpoints_and_hub_ids(capsys):
    text = _out(capsys, "train", "--help")
    row = text.split("  --base_model ", 1)[1].split("\n  --", 1)[0]
    assert "default 'tiny-qwen3_5'" in row
    for words in ("a local checkpoint directory", "a hub id org/name", "`revision`", "random weights"):
        assert words in row, words
    assert "(`hybridtune doctor` lists them; NAME@layers=N is its first N decoder layers)" in row
    assert "`hybridtune doctor` lists the presets" in text  # and the intro says so too
    assert row.split("\n", 1)[1].strip() in config_help()


def test_train_help_names_a_bundled_config_that_exists(capsys):
    text = _out(capsys, "train", "--help")
    (name,) = set(re.findall(r"hybridtune:configs/[\w.-]+\.yaml", text))
    assert name in bundled_configs()


def test_top_level_help_says_full_by_default(capsys):
    text = _out(capsys, "--help")
    assert "fine-tune a model on packed data (full fine-tune by default, or LoRA)" in text
    assert "the presets and example configs" in text  # doctor's line


def test_objective_help_names_the_objectives(capsys):
    """`objective` is text checked against the objectives' registry (config/traits.py); --help names its values as
    it did when the key was a Literal, not `str`."""
    text = _out(capsys, "train", "--help")
    row = text.split("  --objective ", 1)[1].split("\n", 1)[0]
    # the built-ins first, then any objective a test of this process registered (test_toy_objective.py's)
    names = " | ".join(repr(n) for n in objective_names())
    assert names.startswith("'sft' | 'dpo' | 'simpo' | 'orpo' | 'grpo'"), names
    assert row == f"({names}, default 'sft')", row
