"""patch_model on tiny Qwen3.5 / Qwen3-Next: patched == upstream on unpacked input; packed == per-document
at the GDN layer and at the logits (no leak through the conv or the recurrence); B > 1 packed raises."""

from __future__ import annotations

import pytest
import torch

from hybridtune.data.collator import varlen_metadata
from hybridtune.models.patching import find_mixers, patch_model, unpatch_model
from hybridtune.models.presets import preset_config

pytestmark = pytest.mark.transformers_compat  # reads transformers' code: run again under another release (CI)

FAMILIES = ["tiny-qwen3_5", "tiny-qwen3_next"]
LENS = [10, 1, 64, 75, 3]  # uneven, a one-token document, a document of exactly one chunk


def _devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _model(name, device="cpu", dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = preset_config(name, vocab_size=256)
    kw = {"experts_implementation": "batched_mm"} if getattr(cfg, "num_experts", 0) else {}
    return AutoModelForCausalLM.from_config(cfg, **kw).to(device, dtype).eval()


def _packed_batch(lens, device):
    T = sum(lens)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (1, T), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    meta = varlen_metadata(lens)
    batch = {"input_ids": ids, "position_ids": pos, **meta}
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _tol(device):
    return dict(rtol=2e-4, atol=2e-4) if device == "cpu" else dict(rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("name", FAMILIES)
def test_patched_equals_upstream_unpacked(name):
    model = _model(name)
    ids = torch.randint(0, 256, (2, 75), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        report = patch_model(model)
        got = model(input_ids=ids, use_cache=False).logits
    assert report.num_routed == 3 and not report.skipped
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    attn = model.config._attn_implementation
    assert unpatch_model(model) == 3
    assert model.config._attn_implementation != attn == "hybridtune_varlen"


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("name", FAMILIES)
def test_packed_equals_per_document_logits(name, device):
    model = _model(name, device)
    patch_model(model)
    batch = _packed_batch(LENS, device)
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits
        start = 0
        for n in LENS:
            ids = batch["input_ids"][:, start : start + n]
            alone = model(input_ids=ids, use_cache=False).logits
            torch.testing.assert_close(packed[:, start : start + n].float(), alone.float(), **_tol(device))
            start += n


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("name", FAMILIES)
def test_packed_equals_per_document_at_the_gdn_layer(name, device):
    model = _model(name, device)
    patch_model(model)
    _, layer, _, _ = next(iter(find_mixers(model)))
    T = sum(LENS)
    x = torch.randn(1, T, model.config.hidden_size, device=device, generator=None)
    meta = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in varlen_metadata(LENS).items()}
    with torch.no_grad():
        packed = layer(x, **meta)
        start = 0
        for n in LENS:
            alone = layer(x[:, start : start + n])
            torch.testing.assert_close(packed[:, start : start + n], alone, **_tol(device))
            start += n
        # And the leak this prevents: the upstream path on the packed row differs from per-document.
        if device == "cpu":
            unpatch_model(model)
            leaky = layer(x)
            assert (leaky[:, LENS[0] :] - packed[:, LENS[0] :]).abs().max() > 1e-3


@pytest.mark.parametrize("name", FAMILIES)
def test_packed_batch_gt_1_raises(name):
    model = _model(name)
    patch_model(model)
    meta = varlen_metadata([30, 45])
    with pytest.raises(ValueError, match="batch size 1"):
        model(input_ids=torch.randint(0, 256, (2, 75)), use_cache=False, **meta)


def test_generation_with_cache_keeps_upstream_path():
    model = _model("tiny-qwen3_5")
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=5, do_sample=False)
        patch_model(model)
        got = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(want, got)


def test_report_names_every_mixer_and_attention():
    model = _model("tiny-qwen3_next")
    report = patch_model(model)
    assert sorted(report.routed) == [f"model.layers.{i}.linear_attn" for i in range(3)]
    assert "hybridtune_varlen" in report.attention
    assert "H=2, HV=4" in str(report)
    assert patch_model(model).num_routed == 3  # idempotent


def test_varlen_attention_fallback_keeps_documents_apart():
    """Without a mask (a packed row on CPU, or CUDA without varlen kwargs) the attention function builds
    the causal document mask from the restarting position_ids."""
    from hybridtune.mixers.attention.varlen import varlen_attention_forward

    torch.manual_seed(0)
    lens = [5, 1, 9]
    T = sum(lens)
    q, k, v = (torch.randn(1, 4, T, 8) for _ in range(3))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = varlen_attention_forward(module, q, k, v, None, scaling=8**-0.5, position_ids=pos)
    start = 0
    for n in lens:
        s = slice(start, start + n)
        want = torch.nn.functional.scaled_dot_product_attention(q[:, :, s], k[:, :, s], v[:, :, s], is_causal=True)
        torch.testing.assert_close(out[:, s], want.transpose(1, 2), rtol=1e-5, atol=1e-5)
        start += n


def test_conditional_generation_text_path_packed_equals_per_document():
    """The text path of Qwen3_5ForConditionalGeneration (every shipped Qwen3.5 checkpoint's class)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from hybridtune.models.anatomy import text_model

    text = preset_config("tiny-qwen3_5", vocab_size=256).to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128, patch_size=4)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    assert patch_model(model).num_routed == 3
    assert type(text_model(model)).__name__ == "Qwen3_5TextModel"
    batch = _packed_batch(LENS, "cpu")
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits
        start = 0
        for n in LENS:
            alone = model(input_ids=batch["input_ids"][:, start : start + n], use_cache=False).logits
            torch.testing.assert_close(packed[:, start : start + n], alone, **_tol("cpu"))
            start += n


def test_patch_routes_moe_experts_and_unpatch_gives_them_back():
    """patch_model selects the grouped-GEMM experts for every MoE layer (what `hybridtune train` then runs, with
    grouped expert LoRA), says so in its report, and unpatch_model restores transformers' implementation."""
    from hybridtune.models.loading import load_model
    from hybridtune.models.patching import patch_model, unpatch_model

    model = load_model("tiny-qwen3_5_moe").model
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    before = {m.config._experts_implementation for m in experts}
    report = patch_model(model)
    assert len(report.experts) == len(experts) == model.config.get_text_config().num_hidden_layers
    assert {m.config._experts_implementation for m in experts} == {"hybridtune_grouped"}
    assert "routed experts" in str(report)
    unpatch_model(model)
    assert {m.config._experts_implementation for m in experts} == before != {"hybridtune_grouped"}
