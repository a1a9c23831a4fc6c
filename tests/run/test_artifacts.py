"""What training leaves loads in stock transformers and peft, in the checkpoint's original class, and is what was
trained (issue 17): tiny checkpoints of each kind (tests/checkpoints.py) are trained for a few steps on the CPU,
LoRA and full, then opened without hybridtune.

- A full export is the source checkpoint's form: its architecture, config and dtype, the same tensor keys (the index
  lists every one), every tensor training did not touch (the vision tower, `mtp.*` that transformers drops on load)
  bit for bit, its processor and chat-template files; its logits are those of the trained model.
- An adapter applies in the original class: every `lora_B` of the file lands on a module (none missing), is
  non-zero after training, nothing outside the text model is adapted, and base + adapter gives the trained model's
  logits. LoRA reaches MoE experts through `lora_target_parameters`, and `merge` of such an adapter equals the adapted
  model (and carries `mtp.*` too).
- A preset's `base_model/` holds plain names (no peft `base_layer`, however nested) and loads whole.
- final/README.md: YAML front matter with the base as named; a random-weight preset says so.

Tolerances: the trained model runs hybridtune's patched forward (its own GDN path), the loaded artifact transformers'
stock one; in fp32 they agree to ~1e-5, so 1e-4 (absolute and relative) is asserted. A bf16 export is compared with
the trained fp32 weights rounded to bf16 (the export's values exactly), both computing in fp32.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file

from checkpoints import ARCHITECTURES, MTP_PREFIX, hub_cache, make_checkpoint, read_tensors
from hybridtune.config import load_config
from hybridtune.models.source import INDEX_FILE
from hybridtune.run.merge import merge
from hybridtune.train.trainer import Trainer

MOE_PARAMETERS = ["gate_up_proj", "down_proj"]


def train(tmp: Path, data: str, base: str, adapter: str, **kw) -> Trainer:
    settings = dict(
        base_model=base,
        dataset=data,
        adapter=adapter,
        sequence_len=64,
        max_steps=2,
        eval_steps=0,
        logging_steps=1,
        val_set_size=4,
        warmup_steps=0,
        learning_rate=0.02,  # large, so that every lora_B moves away from zero in two steps
        lora_r=4,
        lora_alpha=8,
        output_dir=str(tmp / "out"),
        device="cpu",  # the fp32 story these tolerances state (also on a machine with a GPU)
    )
    settings.update(kw)
    t = Trainer(load_config(None, settings))
    t.setup()
    t.result = t.train()
    return t


def ids(vocab: int, n: int = 29) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def own_logits(t: Trainer, x: torch.Tensor) -> torch.Tensor:
    """hybridtune's forward of the trained model (patched, as it trained)."""
    t.model.eval()
    return t.model(input_ids=x).logits.float()


@torch.no_grad()
def logits(model, x: torch.Tensor) -> torch.Tensor:
    return model.eval()(input_ids=x).logits.float()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def untouched(key: str) -> bool:
    return key.startswith(MTP_PREFIX) or ".visual." in f".{key}"


# -- full fine-tunes ------------------------------------------------------------------------------------------------


def check_full_export(t: Trainer, ckpt: Path, dtype: torch.dtype) -> None:
    final = Path(t.result.final_dir)
    src_config, out_config = (json.loads((d / "config.json").read_text()) for d in (ckpt, final))
    assert out_config["architectures"] == src_config["architectures"]
    assert out_config["model_type"] == src_config["model_type"]
    assert out_config["dtype"] == str(dtype).removeprefix("torch.")

    src, out = read_tensors(ckpt), read_tensors(final)
    assert set(out) == set(src)  # no tensor lost (mtp.*, vision), none added (a tied head)
    index = json.loads((final / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(src)
    assert all((final / f).is_file() for f in index["weight_map"].values())
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in out.values())
    assert {k: v.dtype for k, v in out.items()} == {k: v.dtype for k, v in src.items()}
    kept = [k for k in src if untouched(k)]
    assert all(same_bits(out[k], src[k]) for k in kept), [k for k in kept if not same_bits(out[k], src[k])]
    trained = [k for k in src if not untouched(k)]
    changed = [k for k in trained if not same_bits(out[k], src[k])]
    assert len(changed) >= 0.9 * len(trained)  # what trained, moved (a few small norms may round back)

    for name in ("preprocessor_config.json", "chat_template.jinja"):
        if (ckpt / name).is_file():
            assert (final / name).read_bytes() == (ckpt / name).read_bytes()
    assert (final / "tokenizer.json").is_file() and (final / "README.md").is_file()

    # Stock transformers, the original class; values upcast to fp32 so both sides compute alike.
    cls = getattr(transformers, src_config["architectures"][0])
    loaded = cls.from_pretrained(str(final), dtype=torch.float32)
    with torch.no_grad():  # the trained model's weights, as the export holds them
        for p in t.model.parameters():
            p.copy_(p.to(dtype).float())
    x = ids(loaded.config.get_text_config().vocab_size)
    torch.testing.assert_close(logits(loaded, x), own_logits(t, x), rtol=1e-4, atol=1e-4)


def test_full_export_of_a_vision_language_bf16_checkpoint(tmp_path, small_data):
    """bf16 Qwen3.5 VL with mtp.*: trained in fp32 masters, exported in bf16 as the source was."""
    ckpt = make_checkpoint(tmp_path, "qwen3_5_vl", torch.bfloat16)
    t = train(tmp_path, small_data, str(ckpt), "full")
    assert all(p.dtype == torch.float32 for p in t.model.parameters() if p.requires_grad)
    check_full_export(t, ckpt, torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,dtype",
    [("qwen3_5_text", torch.float32), ("qwen3_5_moe_vl", torch.float32), ("qwen3_next", torch.bfloat16)],
)
def test_full_export_of_each_kind(tmp_path, small_data, kind, dtype):
    ckpt = make_checkpoint(tmp_path, kind, dtype)
    check_full_export(train(tmp_path, small_data, str(ckpt), "full"), ckpt, dtype)


# -- adapters -------------------------------------------------------------------------------------------------------


def check_adapter(t: Trainer, ckpt: Path, caplog) -> None:
    """Base (stock, original class, from the source) + adapter (stock peft) is the trained model."""
    from peft import PeftModel

    final = Path(t.result.final_dir)
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(ckpt)  # as named (absolute here)
    saved = load_file(str(final / "adapter_model.safetensors"))
    b = {k: v for k, v in saved.items() if "lora_B" in k}
    assert b and all(v.abs().max() > 0 for v in b.values()), [k for k, v in b.items() if not v.abs().max() > 0]

    cls = getattr(transformers, ARCHITECTURES[ckpt.name.rsplit("-", 1)[0]])
    base = cls.from_pretrained(str(ckpt))
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, str(final))
    said = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "missing adapter keys" in m.lower() or "unexpected" in m.lower()], said
    state = model.state_dict()
    applied = {k for k in state if "lora_B" in k}
    assert len(applied) == len(b)  # every lora_B of the file has its module, and no other module was adapted
    for k, v in saved.items():  # and holds the saved values (peft's key: the adapter name inserted)
        stem, _, leaf = k.rpartition(".")
        assert torch.equal(state[f"{stem}.default.{leaf}"], v.to(state[f"{stem}.default.{leaf}"].dtype)), k
    assert not [k for k in applied if ".visual." in k]
    x = ids(base.config.get_text_config().vocab_size)
    torch.testing.assert_close(logits(model, x), own_logits(t, x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["qwen3_5_vl"])
def test_adapter_of_a_vision_language_checkpoint_applies(tmp_path, small_data, caplog, kind):
    ckpt = make_checkpoint(tmp_path, kind, torch.float32)
    t = train(tmp_path, small_data, str(ckpt), "lora")
    check_adapter(t, ckpt, caplog)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_5_text", "qwen3_5_moe_vl", "qwen3_next"])
def test_adapter_of_each_kind_applies(tmp_path, small_data, caplog, kind):
    from checkpoints import MOE_KINDS

    ckpt = make_checkpoint(tmp_path, kind, torch.float32)
    extra = {"lora_target_parameters": MOE_PARAMETERS} if kind in MOE_KINDS else {}
    t = train(tmp_path, small_data, str(ckpt), "lora", **extra)
    if kind in MOE_KINDS:  # the experts are adapted
        names = {n for n, p in t.model.named_parameters() if p.requires_grad}
        assert any(".experts." in n for n in names)
    check_adapter(t, ckpt, caplog)


def test_merge_of_an_moe_adapter_equals_the_adapted_model(tmp_path, small_data):
    """Qwen3.5-MoE VL, LoRA on attention, GDN, shared expert and the routed experts (target_parameters): the merged
    model loads in the original class, gives base + adapter's logits, and carries mtp.* and the processor file."""
    from peft import PeftModel

    ckpt = make_checkpoint(tmp_path, "qwen3_5_moe_vl", torch.float32)
    t = train(tmp_path, small_data, str(ckpt), "lora", lora_target_parameters=MOE_PARAMETERS)
    out = merge(t.result.final_dir, tmp_path / "merged")
    cls = transformers.Qwen3_5MoeForConditionalGeneration
    adapted = PeftModel.from_pretrained(cls.from_pretrained(str(ckpt)), t.result.final_dir)
    merged = cls.from_pretrained(str(out))
    x = ids(merged.config.get_text_config().vocab_size)
    torch.testing.assert_close(logits(merged, x), logits(adapted, x), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits(merged, x), own_logits(t, x), rtol=1e-4, atol=1e-4)
    src, got = read_tensors(ckpt), read_tensors(out)
    assert set(got) == set(src)
    assert all(same_bits(got[k], src[k]) for k in src if untouched(k))
    experts = [k for k in src if ".experts." in k and "mtp" not in k]
    assert experts and all(not same_bits(got[k], src[k]) for k in experts)  # the experts' update is folded in
    assert (out / "preprocessor_config.json").read_bytes() == (ckpt / "preprocessor_config.json").read_bytes()


def test_moe_preset_base_model_has_plain_names_and_merges(tmp_path, small_data):
    """tiny-qwen3_next + LoRA (peft maps the MLP names onto both expert weights: nested wrappers): base_model/ loads
    whole (the experts are not re-initialised), and merge equals base + adapter."""
    from peft import PeftModel

    t = train(tmp_path, small_data, "tiny-qwen3_next", "lora", lora_target_parameters=MOE_PARAMETERS)
    base_dir = t.out / "base_model"
    keys = set(read_tensors(base_dir))
    assert not [k for k in keys if "base_layer" in k or "lora_" in k]
    base, info = transformers.Qwen3NextForCausalLM.from_pretrained(str(base_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    in_memory = t.model.get_base_model()
    for name, p in base.named_parameters():  # the frozen base as trained against
        ours = in_memory.get_parameter(name.replace("experts.", "experts.base_layer.base_layer.", 1))
        assert torch.equal(p, ours.to(p.dtype)), name
    config = json.loads((Path(t.result.final_dir) / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "../base_model"  # relative to final/ (run/adapter_base.py)
    adapted = PeftModel.from_pretrained(base, t.result.final_dir)
    x = ids(base.config.vocab_size)
    want = logits(adapted, x)
    torch.testing.assert_close(want, own_logits(t, x), rtol=1e-4, atol=1e-4)
    merged = transformers.Qwen3NextForCausalLM.from_pretrained(str(merge(t.result.final_dir, tmp_path / "merged")))
    torch.testing.assert_close(logits(merged, x), want, rtol=1e-4, atol=1e-4)


# -- where the base is recorded, and the card -----------------------------------------------------------------------


def front_matter(readme: Path) -> dict:
    text = readme.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_hub_id_is_recorded_as_named_and_merge_finds_it(tmp_path, small_data, monkeypatch):
    ckpt = make_checkpoint(tmp_path, "qwen3_5_text", torch.float32)
    home = hub_cache(tmp_path, "org/tiny", ckpt)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t = train(tmp_path, small_data, "org/tiny", "lora")
    final = Path(t.result.final_dir)
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "org/tiny" and config["revision"] == t.loaded.revision
    card = front_matter(final / "README.md")
    assert card["base_model"] == "org/tiny" and card["library_name"] == "peft"
    out = merge(final, tmp_path / "merged")
    x = ids(t.model.config.vocab_size)
    merged = transformers.Qwen3_5ForCausalLM.from_pretrained(str(out))
    torch.testing.assert_close(logits(merged, x), own_logits(t, x), rtol=1e-4, atol=1e-4)


def test_preset_card_says_random_and_a_moved_adapter_still_merges(tmp_path, small_data):
    t = train(tmp_path, small_data, "tiny-qwen3_5", "lora", max_steps=1)
    final = Path(t.result.final_dir)
    card = front_matter(final / "README.md")
    assert "base_model" not in card  # a preset is not a hub model
    assert card["library_name"] == "peft" and {"hybridtune", "lora", "random-weights"} <= set(card["tags"])
    text = (final / "README.md").read_text()
    assert "weights are RANDOM" in text and "`tiny-qwen3_5`" in text
    assert "## Final metrics" in text and "eval loss" in text and "hybridtune" in text
    assert small_data in text and "| lora_r | 4 |" in text
    # Its Use section loads the saved base, not the preset's name (which from_pretrained cannot load).
    assert 'from_pretrained("path/to/base_model")' in text and 'from_pretrained("tiny-qwen3_5")' not in text
    # Moved: the recorded base_model/ path is gone; merge takes the base_model/ beside the adapter.
    moved = tmp_path / "moved"
    t.out.rename(moved)
    out = merge(moved / "final", tmp_path / "merged")
    assert (out / "model.safetensors.index.json").is_file()


def test_full_card_names_the_checkpoint(tmp_path, small_data):
    ckpt = make_checkpoint(tmp_path, "qwen3_5_text", torch.float32)
    t = train(tmp_path, small_data, str(ckpt), "full", max_steps=1)
    card = front_matter(Path(t.result.final_dir) / "README.md")
    assert card["base_model"] == str(ckpt) and card["library_name"] == "transformers"
    assert "random-weights" not in card["tags"] and "full-fine-tune" in card["tags"]
    assert "RANDOM" not in (Path(t.result.final_dir) / "README.md").read_text()


@pytest.mark.slow
def test_full_export_from_a_hub_snapshot(tmp_path, small_data, monkeypatch):
    """A hub id's snapshot holds links into blobs/: the untouched tensors and processor files are read through them
    and written as files; the card names the hub id."""
    ckpt = make_checkpoint(tmp_path, "qwen3_5_vl", torch.bfloat16)
    monkeypatch.setenv("HF_HOME", str(hub_cache(tmp_path, "org/tiny-vl", ckpt)))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t = train(tmp_path, small_data, "org/tiny-vl", "full")
    assert t.loaded.source_dir is not None and (t.loaded.source_dir / "preprocessor_config.json").is_symlink()
    final = Path(t.result.final_dir)
    assert not [p for p in final.iterdir() if p.is_symlink()]
    check_full_export(t, ckpt, torch.bfloat16)
    assert front_matter(final / "README.md")["base_model"] == "org/tiny-vl"


def test_card_loads_a_hub_base_at_the_commit_trained_on():
    from types import SimpleNamespace

    from hybridtune.run.card import _base_line

    hub = SimpleNamespace(name="Qwen/Qwen3.5-0.8B", revision="a" * 40, random_init=False)
    assert _base_line("Qwen3_5ForConditionalGeneration", hub) == (
        f'base = Qwen3_5ForConditionalGeneration.from_pretrained("Qwen/Qwen3.5-0.8B", revision="{"a" * 40}")'
    )
