"""The final adapter loads with peft; `hybridtune merge` writes a model transformers loads with equal logits; its
refusals. (Checkpoints of each kind, MoE adapters and their merge: test_artifacts.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from hybridtune.config import load_config
from hybridtune.errors import ModelError, OutputDirError
from hybridtune.run.merge import merge
from hybridtune.train.trainer import Trainer


def test_adapter_loads_and_merge_round_trip(tmp_path, small_data):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = load_config(
        None,
        dict(
            dataset=small_data,
            adapter="lora",
            sequence_len=64,
            max_steps=3,
            eval_steps=0,
            output_dir=str(tmp_path / "run"),
            learning_rate=0.05,
        ),  # a large step so the adapter visibly changes the logits
    )
    t = Trainer(cfg)
    t.setup()
    res = t.train()
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "base_model"))
    ids = torch.randint(0, base.config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
    peft_model = PeftModel.from_pretrained(base, res.final_dir).eval()
    with torch.no_grad():
        adapted = peft_model(input_ids=ids).logits
    assert (adapted - base_logits).abs().max() > 1e-3  # the adapter does something

    out = merge(res.final_dir, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        got = merged(input_ids=ids).logits
    torch.testing.assert_close(got, adapted, rtol=1e-4, atol=1e-4)


def _adapter_dir(tmp_path, config_text: str):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(config_text)
    base = tmp_path / "base"
    base.mkdir(exist_ok=True)
    return adapter


def test_merge_refuses_a_garbled_adapter_config(tmp_path, capsys):
    from hybridtune.cli import main

    adapter = _adapter_dir(tmp_path, '{"base_model_name_or_path": "x",\n  "r": 8,,\n}')
    with pytest.raises(ModelError, match=r"adapter_config\.json:2: malformed JSON \(.* at column 10\)"):
        merge(adapter, tmp_path / "merged")
    # Through the CLI: one line, exit 2, nothing written.
    assert main(["merge", str(adapter), str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "malformed JSON" in err[0], err
    assert not (tmp_path / "merged").exists()
    (adapter / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(ModelError, match="expected a JSON object, got list"):
        merge(adapter, tmp_path / "merged")
    (adapter / "adapter_config.json").write_bytes(b'{"base_model_name_or_path": "\xff"}')
    with pytest.raises(ModelError, match="not UTF-8"):
        merge(adapter, tmp_path / "merged")
    base = tmp_path / "base"
    (adapter / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": str(base), "peft_type": "NOPE"})
    )
    with pytest.raises(ModelError, match="not a LoRA adapter config peft can read"):
        merge(adapter, tmp_path / "merged")
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": None}))
    with pytest.raises(ModelError, match="base model None is not a local directory"):
        merge(adapter, tmp_path / "merged")


def test_merge_refuses_an_existing_file_as_out_dir(tmp_path):
    adapter = _adapter_dir(tmp_path, json.dumps({"base_model_name_or_path": str(tmp_path / "base")}))
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"precious")
    for overwrite in (False, True):
        with pytest.raises(OutputDirError, match="exists and is not a directory"):
            merge(adapter, target, overwrite=overwrite)
    assert target.read_bytes() == b"precious"
    with pytest.raises(OutputDirError, match="is a file; give a directory path"):
        merge(adapter, target / "merged")


def test_merge_of_an_adapter_whose_hub_base_is_not_cached_is_one_line(tmp_path, monkeypatch, capsys):
    from hybridtune.cli import main

    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty_home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    adapter = _adapter_dir(tmp_path, json.dumps({"base_model_name_or_path": "org/not-here", "peft_type": "LORA"}))
    with pytest.raises(ModelError, match=r"base_model 'org/not-here' is not in the hub cache .* HF_HUB_OFFLINE is set"):
        merge(adapter, tmp_path / "merged")
    assert main(["merge", str(adapter), str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "org/not-here" in err[0], err
    assert not (tmp_path / "merged").exists()


def test_merge_overwrite_never_replaces_a_users_directory_nor_its_own_inputs(tmp_path):
    """--overwrite replaces out_dir whole: a directory of the user's files was removed with everything in it, and
    out_dir = the adapter (or its base) replaced what the merge read."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    adapter = _adapter_dir(tmp_path, json.dumps({"base_model_name_or_path": str(base), "peft_type": "LORA"}))
    (adapter / ".hybridtune").touch()  # a run's final/ carries the marker
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "sub" / "thesis.tex").write_text("precious")
    with pytest.raises(OutputDirError, match="not written by hybridtune"):
        merge(adapter, mine, overwrite=True)
    assert (mine / "sub" / "thesis.tex").read_text() == "precious"
    for target, what in ((adapter, "the adapter"), (base, "its base model"), (tmp_path, "the adapter")):
        with pytest.raises(OutputDirError, match=f"holds {what} .* that the merge reads"):
            merge(adapter, target, overwrite=True)
    assert (adapter / "adapter_config.json").is_file() and (base / "config.json").is_file()


def test_merge_of_an_adapter_config_with_a_garbled_field_is_one_line(tmp_path, capsys):
    """peft raises TypeError for a field of the wrong type (lora_alpha "x", target_modules 5): merge printed a
    traceback (exit 1) where generate says one line."""
    from checkpoints import make_checkpoint
    from hybridtune.cli import main

    base = make_checkpoint(tmp_path, "qwen3_5_text")
    good = {"peft_type": "LORA", "base_model_name_or_path": str(base), "r": 4, "target_modules": ["q_proj"]}
    for garbled in ({"lora_alpha": "x"}, {"target_modules": 5}):
        adapter = tmp_path / "adapter"
        adapter.mkdir(exist_ok=True)
        (adapter / "adapter_config.json").write_text(json.dumps(good | garbled))
        with pytest.raises(ModelError, match="cannot load the adapter in"):
            merge(adapter, tmp_path / "merged")
        assert main(["merge", str(adapter), str(tmp_path / "merged")]) == 2
        err = capsys.readouterr().err  # (transformers' loading bar may come first, as other tests leave it on)
        assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: cannot load the adapter")
        assert not (tmp_path / "merged").exists()
