"""`hybridtune doctor` without --model lists the presets (name, family, parameters, what each is for; random
weights) and the example configs shipped with hybridtune."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from hybridtune.config import TrainConfig, load_config  # noqa: E402
from hybridtune.kernels import doctor  # noqa: E402
from hybridtune.models.presets import PRESETS, preset_config  # noqa: E402


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_parameter_count_is_the_built_models(name):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # no memory: the 9B shape builds in a second
        model = AutoModelForCausalLM.from_config(preset_config(name))
    assert PRESETS[name].parameters == sum(p.numel() for p in model.parameters())  # tied weights counted once


def test_text_lists_every_preset_and_the_bundled_configs(capsys):
    assert doctor.main([]) == 0
    out = capsys.readouterr().out
    assert "presets (base_model: NAME; random weights, built here, never downloaded" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and line.split()[0] in PRESETS}
    assert list(rows) == list(PRESETS)
    assert rows["tiny-qwen3_5"].split()[1:4] == ["Qwen3.5", "dense", "870K"]
    assert "CPU demo" in rows["tiny-qwen3_5"] and rows["tiny-qwen3_5"].endswith("(the default base_model)")
    assert rows["tiny-qwen3_next"].split()[1:4] == ["Qwen3-Next", "MoE", "823K"]
    assert rows["qwen3_5-0.8b"].split()[3] == "752M" and rows["qwen3_5-2b"].split()[3] == "1.88B"
    assert rows["qwen3_5-9b"].split()[3] == "8.95B" and "benchmarks" in rows["qwen3_5-9b"]
    assert "a real model: base_model: a local checkpoint directory or a hub id org/name" in out
    (line,) = [ln for ln in out.splitlines() if "hybridtune:configs/arithmetic-lora.yaml" in ln]
    name, path = line.split()
    assert Path(path).is_file() and load_config(name).adapter == "lora"  # the name doctor prints is what train takes


def test_json_lists_the_presets(capsys):
    assert doctor.main(["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    table = {p["name"]: p for p in d["presets"]}
    assert list(table) == list(PRESETS)
    assert all(p["random_weights"] for p in table.values())
    assert [n for n, p in table.items() if p["default"]] == [TrainConfig().base_model]
    assert table["qwen3_5-2b"]["parameters"] == 1_881_825_088 and table["qwen3_5-2b"]["family"] == "Qwen3.5 dense"
    assert all(Path(p).is_file() for p in d["bundled_configs"].values())
