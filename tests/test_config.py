"""Config: YAML + overrides, typed, unknown keys name the nearest key, errors name file and line."""

from __future__ import annotations

import dataclasses

import pytest

from hybridtune.config import TrainConfig, config_help, load_config, parse_overrides
from hybridtune.errors import ConfigError


def test_defaults_and_overrides_win_over_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("lora_r: 4\nsequence_len: 128\nlearning_rate: 1e-3\n")
    cfg = load_config(p, parse_overrides(["--lora_r", "8", "--bf16=false", "--lora_target_modules", "q_proj,v_proj"]))
    assert cfg.lora_r == 8 and cfg.sequence_len == 128 and cfg.learning_rate == 1e-3 and cfg.bf16 is False
    assert cfg.lora_target_modules == ["q_proj", "v_proj"]
    assert load_config().base_model == "tiny-qwen3_5"


def test_bare_flag_is_true_and_paths_stay_strings():
    o = parse_overrides(["--overwrite", "--output_dir", "2024", "--dataset", "x.jsonl"])
    assert o == {"overwrite": True, "output_dir": "2024", "dataset": "x.jsonl"}
    cfg = load_config(None, o)
    assert cfg.resolved_datasets()[0].path == "x.jsonl" and cfg.output_dir == "2024"


def test_unknown_key_names_nearest(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'lora_rank'; did you mean 'lora_r'"):
        load_config(None, parse_overrides(["--lora_rank", "8"]))
    p = tmp_path / "c.yaml"
    p.write_text("base_model: tiny-qwen3_5\nsequence_len: 128\nlearnin_rate: 0.1\n")
    with pytest.raises(
        ConfigError, match=r"c\.yaml:3: unknown config key 'learnin_rate'; did you mean 'learning_rate'"
    ):
        load_config(p)
    p.write_text("datasets:\n  - path: a.jsonl\n    typ: chat\n")
    with pytest.raises(ConfigError, match="unknown config key 'typ'; did you mean 'type'"):
        load_config(p)


def test_ill_typed_and_out_of_range(tmp_path):
    with pytest.raises(ConfigError, match="key 'lora_r': expected int, got 'eight'"):
        load_config(None, parse_overrides(["--lora_r", "eight"]))
    with pytest.raises(ConfigError, match="key 'adapter': expected 'lora' | 'full'"):
        load_config(None, {"adapter": "qlora"})
    p = tmp_path / "c.yaml"
    p.write_text("micro_batch_size: 1\nsequence_len: many\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:2: key 'sequence_len': expected int"):
        load_config(p)
    with pytest.raises(ConfigError, match="'sequence_len' = 1 must be at least 2"):
        load_config(None, {"sequence_len": 1})
    p.write_text("lora_r: [1\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:\d+: not valid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_compile_overrides():
    from hybridtune.config import compile_overrides

    cfg = load_config(
        None, parse_overrides(["--compile", "modules", "--compile_overrides", "Qwen3_5MLP=eager,Foo=fullgraph"])
    )
    assert compile_overrides(cfg) == {"Qwen3_5MLP": "eager", "Foo": "fullgraph"}
    with pytest.raises(ConfigError, match="Class=compile|fullgraph|eager|off"):
        load_config(None, {"compile_overrides": ["Qwen3_5MLP:eager"]})


def test_help_lists_every_key_with_default():
    text = config_help()
    for f in dataclasses.fields(TrainConfig):
        assert f"--{f.name} (" in text
    assert "default 16" in text  # lora_r


def test_shipped_configs_load():
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert files
    for f in files:
        load_config(f)
