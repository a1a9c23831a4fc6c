"""Exported adapters against the serving engines' own module mappings (a fixture transcribed from their model files,
each with its repository, path and commit): every packed group an adapter touches is complete (its other members
carry zero LoRA, both factors zero), every module name is one the engine expects, what an engine does not adapt is
one warning line naming the engine and the group, stock peft still loads the adapter to the trained model's logits,
and the model card says how to serve it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridtune.config import load_config
from hybridtune.train.trainer import Trainer

# vllm-project/vllm, vllm/model_executor/models/qwen3_5.py (commit 00def4f8): Qwen3_5ForCausalLMBase and
# Qwen3_5ForConditionalGeneration.packed_modules_mapping as they are with LoRA enabled (`vllm_config.lora_config`:
# "in_proj_qkvz" popped, "in_proj_qkv" and "in_proj_z" mapped to themselves; the GDN layer is then built with
# create_in_proj_qkvz=False, vllm/model_executor/layers/mamba/gdn_linear_attn.py).
VLLM_QWEN3_5 = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
    "in_proj_ba": ["in_proj_b", "in_proj_a"],
    "in_proj_qkv": ["in_proj_qkv"],
    "in_proj_z": ["in_proj_z"],
}
# Its other Linear layers (same files: Qwen3NextAttention.o_proj, Qwen2MoeMLP.down_proj, GatedDeltaNetAttention.out_proj):
# vLLM expects the module names of an adapter among these and the packed members (vllm/lora/lora_model.py,
# check_unexpected_modules raises on any other).
VLLM_QWEN3_5_UNPACKED = ["o_proj", "down_proj", "out_proj"]
# vllm-project/vllm, vllm/model_executor/models/qwen3_next.py (commit 002d6073): Qwen3NextForCausalLM.
VLLM_QWEN3_NEXT = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
    "in_proj_qkvz": ["in_proj_qkvz"],
    "in_proj_ba": ["in_proj_ba"],
}
VLLM_QWEN3_NEXT_UNPACKED = ["o_proj", "down_proj", "out_proj"]
# sgl-project/sglang, python/sglang/srt/models/qwen3_5.py (commit 005fa711): Qwen3_5ForCausalLM (and the
# ConditionalGeneration classes, which reuse both attributes).
SGLANG_QWEN3_5 = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
    "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
    "in_proj_ba": ["in_proj_b", "in_proj_a"],
}
SGLANG_QWEN3_5_LORA = ["qkv_proj", "o_proj", "out_proj", "in_proj_qkvz", "gate_up_proj", "down_proj", "lm_head"]
# sgl-project/sglang, python/sglang/srt/models/qwen3_next.py (commit 0201bc80): Qwen3NextForCausalLM.
SGLANG_QWEN3_NEXT = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

ENGINES = {
    "tiny-qwen3_5": {"vLLM": VLLM_QWEN3_5, "SGLang": SGLANG_QWEN3_5},
    "tiny-qwen3_next": {"vLLM": VLLM_QWEN3_NEXT, "SGLang": SGLANG_QWEN3_NEXT},
}
UNPACKED = {"tiny-qwen3_5": VLLM_QWEN3_5_UNPACKED, "tiny-qwen3_next": VLLM_QWEN3_NEXT_UNPACKED}


def _train(out: Path, data: str, preset: str, targets: list[str]) -> Trainer:
    cfg = load_config(
        None,
        dict(
            base_model=preset, dataset=data, adapter="lora", sequence_len=64, max_steps=2, eval_steps=0,
            val_set_size=4, warmup_steps=0, learning_rate=0.02, lora_r=2, lora_alpha=4,
            lora_target_modules=targets, output_dir=str(out), device="cpu",
        ),
    )  # fmt: skip
    t = Trainer(cfg)
    t.setup()
    t.train()
    return t


def _modules(final: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The saved adapter by module path: {"model.layers.0.self_attn.q_proj": {"lora_A": ..., "lora_B": ...}}."""
    by: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(final / "adapter_model.safetensors").items():
        path, factor, _ = key.removeprefix("base_model.model.").rsplit(".", 2)
        by.setdefault(path, {})[factor] = tensor
    return by


CASES = {
    # Partial groups of every kind: q without k/v, in_proj_qkv without in_proj_z, in_proj_b without in_proj_a,
    # gate without up.
    "tiny-qwen3_5": ["q_proj", "in_proj_qkv", "in_proj_b", "gate_proj", "o_proj"],
    "tiny-qwen3_next": ["q_proj", "in_proj_qkvz", "out_proj"],
}


@pytest.mark.parametrize("preset", sorted(CASES))
def test_exported_adapter_fills_every_packed_group_of_each_engine(preset, tmp_path, small_data, caplog):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        t = _train(tmp_path / "run", small_data, preset, CASES[preset])
    final = tmp_path / "run" / "final"
    modules = _modules(final)
    leaves = {path.rsplit(".", 1)[-1] for path in modules}
    for engine, mapping in ENGINES[preset].items():
        for packed, members in mapping.items():
            touched = leaves & set(members)
            assert not touched or touched == set(members), (engine, packed, sorted(touched))
    expected = {m for members in ENGINES[preset]["vLLM"].values() for m in members} | set(UNPACKED[preset])
    assert leaves <= expected  # vLLM refuses an adapter naming any other module
    # What training adapted moved; what the export added is zero, both factors.
    added = {p: f for p, f in modules.items() if p.rsplit(".", 1)[-1] not in CASES[preset]}
    assert added and all(not f["lora_A"].any() and not f["lora_B"].any() for f in added.values())
    assert all(f["lora_B"].any() for p, f in modules.items() if p not in added)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("vLLM:", "SGLang:"))]
    if preset == "tiny-qwen3_5":
        touched = {packed for packed, members in SGLANG_QWEN3_5.items() if leaves & set(members)}
        # Not among SGLang's LoRA modules; and in_proj_qkvz, which its loader fills from its own name only, not from
        # the split in_proj_qkv/in_proj_z (sgl-project/sglang pull requests 30189 and 31522, open, say so).
        left_out = {p for p in touched if p not in SGLANG_QWEN3_5_LORA} | ({"in_proj_qkvz"} & touched)
        assert left_out == {"in_proj_ba", "in_proj_qkvz"}
        for packed in left_out:
            assert [s for s in said if s.startswith(f"SGLang: no LoRA on {packed} ")], said
    assert len(said) == len(set(said)) and all("\n" not in s for s in said)
    # Stock peft loads the completed adapter onto the saved base: the trained model's logits.
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "base_model"))
    loaded = PeftModel.from_pretrained(base, str(final)).eval()
    lora_a = [n.removeprefix("base_model.model.") for n, _ in loaded.named_parameters() if ".lora_A." in n]
    assert {n.split(".lora_A.")[0] for n in lora_a} == set(modules)  # peft adapts exactly the saved modules
    x = torch.randint(0, base.config.vocab_size, (1, 29), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        t.model.eval()
        torch.testing.assert_close(loaded(input_ids=x).logits, t.model(input_ids=x).logits, rtol=1e-4, atol=1e-4)
    card = (final / "README.md").read_text()
    serve = card[card.index("## Serve") :]
    assert "--enable-lora --max-lora-rank 8 --lora-modules adapter=path/to/final" in serve
    assert "hybridtune merge" in serve and "export --merged" in serve
    assert all(f"`{leaf}`" in serve for leaf in {p.rsplit(".", 1)[-1] for p in added})


def test_the_default_targets_need_no_completion(tmp_path, small_data, caplog):
    with caplog.at_level(logging.INFO, logger="hybridtune"):
        _train(tmp_path / "run", small_data, "tiny-qwen3_5", ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"])
    final = tmp_path / "run" / "final"
    leaves = {p.rsplit(".", 1)[-1] for p in _modules(final)}
    assert leaves == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    assert not [r for r in caplog.records if "zero LoRA" in r.getMessage() or r.getMessage().startswith("SGLang:")]
    config = json.loads((final / "adapter_config.json").read_text())
    assert "|(?:" not in config["target_modules"]  # the regex as training wrote it


# -- export --merged: for engines that take no adapters -----------------------------------------------------------


def test_export_merged_writes_the_base_with_the_lora_folded_in_in_its_dtype_and_class(tmp_path, small_data, capsys):
    """`hybridtune export CHECKPOINT OUT --merged` of a LoRA run on a bf16 Qwen3-Next checkpoint: OUT/final is the
    adapter, OUT/merged the source's architecture, config and dtype with the LoRA folded in (run/merge.py), its
    `mtp.*` carried over, loadable by the original class with the outputs of base + adapter; OUT's lock is released,
    a second export needs --overwrite, which replaces merged/ whole."""
    import transformers
    from peft import PeftModel

    from checkpoints import ARCHITECTURES, MTP_PREFIX, make_checkpoint, read_tensors
    from hybridtune.cli import main
    from hybridtune.run import checkpoint as ckpt
    from hybridtune.run.lock import OutputLock

    source = make_checkpoint(tmp_path, "qwen3_next", torch.bfloat16)
    cfg = load_config(
        None,
        dict(
            base_model=str(source), dataset=small_data, adapter="lora", sequence_len=64, max_steps=2, save_steps=2,
            eval_steps=0, val_set_size=4, warmup_steps=0, learning_rate=0.05, lora_r=2, lora_alpha=4,
            lora_target_modules=["q_proj", "in_proj_qkvz"], output_dir=str(tmp_path / "run"), device="cpu",
        ),
    )  # fmt: skip
    t = Trainer(cfg)
    t.setup()
    t.train()
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "run" / "checkpoint-2"), str(out), "--merged"]) == 0
    merged = out / "merged"
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "final", "hybridtune_run.json", "merged",
    ]  # fmt: skip
    assert ckpt.is_ours(merged)
    OutputLock(out).release()  # the export let go of OUT's lock
    config = json.loads((merged / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURES["qwen3_next"]]
    tensors = read_tensors(merged)
    assert {str(v.dtype) for k, v in tensors.items() if v.is_floating_point()} == {"torch.bfloat16"}
    assert not [k for k in tensors if "lora_" in k or "base_layer" in k]
    theirs = read_tensors(source)
    assert {k for k in theirs if k.startswith(MTP_PREFIX)} <= set(tensors)
    cls = getattr(transformers, ARCHITECTURES["qwen3_next"])
    x = torch.randint(0, config["vocab_size"], (1, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = cls.from_pretrained(str(merged), dtype=torch.float32).eval()(input_ids=x).logits
        base = cls.from_pretrained(str(source), dtype=torch.float32)
        want = PeftModel.from_pretrained(base, str(out / "final")).eval()(input_ids=x).logits
        plain = cls.from_pretrained(str(source), dtype=torch.float32).eval()(input_ids=x).logits
    assert (want - plain).abs().max() > 1e-3  # the adapter does something
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)  # the merged weights are rounded to bf16
    assert (got - plain).abs().max() > (got - want).abs().max()
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run" / "checkpoint-2"), str(out), "--merged"]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    before = (merged / "config.json").stat().st_ino
    assert main(["export", str(tmp_path / "run" / "checkpoint-2"), str(out), "--merged", "--overwrite"]) == 0
    assert (out / "merged" / "config.json").stat().st_ino != before
    held = OutputLock(out)  # a run (or another export) holding OUT: refused before anything is written
    try:
        capsys.readouterr()
        assert main(["export", str(tmp_path / "run" / "checkpoint-2"), str(out), "--merged", "--overwrite"]) == 2
        assert "is in use by another hybridtune run" in capsys.readouterr().err
    finally:
        held.release()
    assert main(["export", str(out / "final"), str(tmp_path / "other"), "--merged"]) == 2
    assert "hybridtune merge" in capsys.readouterr().err


def test_export_merged_of_a_full_fine_tune_writes_final_alone_and_says_so(tmp_path, small_data, caplog):
    from hybridtune.infer.export_command import export_checkpoint

    cfg = load_config(
        None,
        dict(
            base_model="tiny-qwen3_5", dataset=small_data, adapter="full", sequence_len=64, max_steps=2, save_steps=2,
            eval_steps=0, val_set_size=4, warmup_steps=0, output_dir=str(tmp_path / "run"), device="cpu",
        ),
    )  # fmt: skip
    t = Trainer(cfg)
    t.setup()
    t.train()
    with caplog.at_level(logging.INFO, logger="hybridtune"):
        final = export_checkpoint(tmp_path / "run" / "checkpoint-2", tmp_path / "out", merged=True)
    assert (final / "config.json").is_file() and not (tmp_path / "out" / "merged").exists()
    assert [r for r in caplog.records if "already the whole model; nothing to merge" in r.getMessage()]
