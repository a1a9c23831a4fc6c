"""Config keys freeze_vision_tower / freeze_multi_modal_projector (runtime/vision_train.py): by default only the
language model trains (LoRA or full); unfrozen, the vision tower (its blocks, patch and position embeddings) and the
merger train as the language model does (LoRA on their Linear layers, or every parameter): after a packed step with
images, exactly the parameters that should have gradients have nonzero ones, and the others none. A LoRA run's
adapter then loads in stock transformers + peft on the original class with its vision LoRA, and its merged export in
the original class with the processor files beside it (slow tier)."""

from __future__ import annotations

import json

import pytest
import torch
import vl_tiny
from vl_tiny import chat

from hybridtune.config import DatasetConfig, TrainConfig
from hybridtune.data import PackedCollator
from hybridtune.data.examples import load_examples
from hybridtune.errors import ConfigError
from hybridtune.models.loading import freeze_non_text
from hybridtune.models.patching import patch_model
from hybridtune.runtime.lora import lora_from_config
from hybridtune.runtime.vision_train import train_vision
from hybridtune.train.objectives.sft import SFT


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    vl_tiny.write_image(d / "a.png", 23, 37, seed=1)
    vl_tiny.write_image(d / "b.png", 40, 29, seed=2)
    rows = [chat("Which? ", {"type": "image", "image": "a.png"}, {"type": "image", "image": "b.png"}), chat("Hi")]
    tok = vl_tiny.tokenizer()
    vision = vl_tiny.vision_of(tok)
    examples = load_examples(DatasetConfig(path=str(vl_tiny.write_rows(d / "d.jsonl", rows))), tok, vision=vision)
    return PackedCollator(vision=vision)(examples)


def _model(adapter, tower, merger):
    model, _ = vl_tiny.build_model(seed=0)
    patch_model(model)
    freeze_non_text(model)  # as models.loading leaves it
    cfg = TrainConfig(
        adapter=adapter, lora_r=4, lora_alpha=8, freeze_vision_tower=not tower, freeze_multi_modal_projector=not merger
    )
    if adapter == "lora":
        model = lora_from_config(model, cfg)
    model = train_vision(model.train(), cfg)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for n, p in model.named_parameters():
            if "lora_B" in n:  # (peft starts B at 0, where A's gradient is 0 too: here every adapter's is not)
                p.normal_(0, 0.05)
    return model


def _kind(name: str) -> str:
    if ".visual.merger." in f".{name}":
        return "merger"
    return "tower" if ".visual." in f".{name}" else "text"


CASES = [
    ("lora", False, False),
    ("lora", True, False),
    ("lora", False, True),
    ("lora", True, True),
    ("full", False, False),
    ("full", True, True),
    ("full", False, True),
]


@pytest.mark.parametrize("adapter, tower, merger", CASES)
def test_the_right_parameters_get_gradients(batch, adapter, tower, merger):
    model = _model(adapter, tower, merger)
    SFT(fused=True).loss(model, batch, batch["num_loss_tokens"]).backward()
    wanted = {"text": True, "tower": tower, "merger": merger}
    seen = {"text": set(), "tower": set(), "merger": set()}
    for name, p in model.named_parameters():
        kind = _kind(name)
        lora = "lora_" in name
        trains = wanted[kind] and (lora if adapter == "lora" else True)
        assert p.requires_grad == trains, name
        if trains:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
            seen[kind].add(name.split(".visual.")[-1].split(".")[0] if kind != "text" else "text")
        else:
            assert p.grad is None, name
    assert seen["text"] == {"text"}
    if tower:  # every part of the tower trains: its blocks, and (full) its patch and position embeddings
        assert seen["tower"] == ({"blocks"} if adapter == "lora" else {"blocks", "patch_embed", "pos_embed"})
    assert bool(seen["merger"]) == merger and bool(seen["tower"]) == tower


def test_the_keys_refuse_a_text_model():
    from transformers import AutoModelForCausalLM

    from hybridtune.models.presets import preset_config

    model = AutoModelForCausalLM.from_config(preset_config("tiny-qwen3_5", vocab_size=256))
    with pytest.raises(ConfigError, match="freeze_vision_tower = false: this model has no vision tower"):
        train_vision(model, TrainConfig(freeze_vision_tower=False))


@pytest.mark.slow
def test_a_lora_run_with_the_tower_loads_in_stock_peft_and_exports_merged(tmp_path, capsys):
    import safetensors.torch
    import transformers as tf
    from peft import PeftModel

    from hybridtune.cli import main

    ckpt = vl_tiny.make_checkpoint(tmp_path / "ckpt")
    vl_tiny.write_image(tmp_path / "a.png", 23, 37, seed=1)
    rows = [chat("Which? ", {"type": "image", "image": "a.png"}, answer=c) for c in ("Red.", "Blue.")] * 4
    data = vl_tiny.write_rows(tmp_path / "d.jsonl", rows)
    args = ["train", "--base_model", str(ckpt), "--dataset", str(data), "--output_dir", str(tmp_path / "run")]
    args += ["--adapter", "lora", "--sequence_len", "128", "--max_steps", "2", "--val_set_size", "0"]
    args += ["--learning_rate", "1e-2", "--freeze_vision_tower", "false", "--freeze_multi_modal_projector", "false"]
    assert main(args) == 0, capsys.readouterr().err
    final = tmp_path / "run" / "final"
    saved = safetensors.torch.load_file(final / "adapter_model.safetensors")
    vis = {k: v for k, v in saved.items() if ".visual." in k}
    assert any(".merger." in k for k in vis) and any(".blocks." in k for k in vis)
    assert any(v.abs().sum() > 0 for k, v in vis.items() if "lora_B" in k)  # trained (B starts at 0)
    # stock transformers + peft, the original class: every saved tensor is the loaded model's, none missing
    base = tf.Qwen3_5ForConditionalGeneration.from_pretrained(str(ckpt))
    model = PeftModel.from_pretrained(base, str(final))
    got = {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}
    assert set(got) == set(saved) and all(torch.equal(got[k], saved[k]) for k in saved)
    # merged: the original class loads it, with the processor files beside it, and the tower's weights moved
    assert main(["merge", str(final), str(tmp_path / "merged")]) == 0, capsys.readouterr().err
    merged_dir = next(p.parent for p in (tmp_path / "merged").rglob("config.json"))
    for f in ("preprocessor_config.json", "video_preprocessor_config.json", "tokenizer.json"):
        assert (merged_dir / f).is_file(), f
    merged = tf.Qwen3_5ForConditionalGeneration.from_pretrained(str(merged_dir))
    assert json.loads((merged_dir / "config.json").read_text())["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    qkv = "model.visual.blocks.0.attn.qkv.weight"
    orig = tf.Qwen3_5ForConditionalGeneration.from_pretrained(str(ckpt)).state_dict()[qkv]  # (base is wrapped now)
    assert not torch.equal(merged.state_dict()[qkv], orig.to(merged.dtype))
    want = model.merge_and_unload().state_dict()[qkv]
    torch.testing.assert_close(merged.state_dict()[qkv].float(), want.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_full_run_with_the_tower_loads_in_the_original_class(tmp_path, capsys):
    import safetensors.torch
    import transformers as tf

    from hybridtune.cli import main

    ckpt = vl_tiny.make_checkpoint(tmp_path / "ckpt")
    vl_tiny.write_image(tmp_path / "a.png", 23, 37, seed=1)
    rows = [chat("Which? ", {"type": "image", "image": "a.png"}, answer=c) for c in ("Red.", "Blue.")] * 4
    data = vl_tiny.write_rows(tmp_path / "d.jsonl", rows)
    args = ["train", "--base_model", str(ckpt), "--dataset", str(data), "--output_dir", str(tmp_path / "run")]
    args += ["--adapter", "full", "--sequence_len", "128", "--max_steps", "2", "--val_set_size", "0"]
    args += ["--learning_rate", "1e-2", "--freeze_vision_tower", "false", "--freeze_multi_modal_projector", "false"]
    assert main(args) == 0, capsys.readouterr().err
    final = tmp_path / "run" / "final"
    for f in ("preprocessor_config.json", "video_preprocessor_config.json", "tokenizer.json"):
        assert (final / f).is_file(), f
    model = tf.Qwen3_5ForConditionalGeneration.from_pretrained(str(final))
    base = safetensors.torch.load_file(ckpt / "model.safetensors")
    got = model.state_dict()
    for name in ("model.visual.blocks.0.attn.qkv.weight", "model.visual.merger.linear_fc1.weight",
                 "model.visual.patch_embed.proj.weight", "model.language_model.layers.0.mlp.up_proj.weight"):  # fmt: skip
        assert not torch.equal(got[name], base[name].to(got[name].dtype)), name  # trained, and saved
