"""QLoRA's NF4 base (ops/nf4.py, runtime/quant.py) on the CPU: the quantiser is torchao's NF4; every Linear of the
decoder layers (attention, every GDN projection, MLPs) and the routed experts' fused weights are NF4 while
embeddings, norms and the GDN's small parameters stay dense; a QLoRA step's loss and every LoRA gradient equal
those of the same model with its NF4 weights replaced by their dequantised values (fp32: the same numbers, so
within 1e-5 in fp32 and under bf16 autocast: the same products); `adapter: qlora` and `load_in_4bit` as config."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from qlora_models import dequantize_in_place, nf4_names, qlora_model

from hybridtune.errors import ConfigError
from hybridtune.models import experts
from hybridtune.ops import nf4
from hybridtune.runtime import memory, quant

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compiler"))
from loop_models import packed_batch, train_step  # noqa: E402

pytest.importorskip("torchao")
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4  # noqa: E402

GDN = {"tiny-qwen3_5": {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}}
GDN["tiny-qwen3_5_moe"] = GDN["tiny-qwen3_5"]
GDN["tiny-qwen3_next"] = {"in_proj_qkvz", "in_proj_ba", "out_proj"}
ATTENTION_MLP = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_quantize_is_torchaos_nf4_chunk_by_chunk(monkeypatch):
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    want = to_nf4(w.bfloat16()).get_original_weight()
    monkeypatch.setattr(nf4, "CHUNK", 4096)  # 32 chunks: the codes computed piecewise are the same codes
    got = nf4.quantize(w)
    assert got.scaler_block_size == 256 and torch.equal(got.get_original_weight(), want)
    # 3-D (experts) keeps its shape; a tensor of fewer blocks takes a smaller scaler group, still within NF4's error:
    # at most half the widest gap between NF4 levels (0.1385) of each 64-value block's absmax, plus the scalers' int8
    w3 = torch.randn(4, 16, 128, generator=torch.Generator().manual_seed(1))
    q3 = nf4.quantize(w3)
    assert q3.shape == w3.shape and q3.scaler_block_size == 128
    absmax = w3.reshape(-1, 64).abs().amax(1, keepdim=True)
    err = (q3.get_original_weight().float() - w3).reshape(-1, 64).abs()
    assert bool((err <= 0.1385 * absmax * 1.05 + 0.02).all())
    assert nf4.nbytes(q3) < w3.numel() * 0.6  # ~4.1 bits a value (+ the 16-entry table)
    # the eager experts' dequantisation, chunk by chunk, gives torchao's values exactly
    monkeypatch.setattr(nf4, "CHUNK", 1024)
    assert torch.equal(nf4.dequantize_bounded(q3, torch.float32), q3.get_original_weight().float())


@pytest.mark.parametrize(
    "name", ["tiny-qwen3_5", "tiny-qwen3_5_moe", pytest.param("tiny-qwen3_next", marks=pytest.mark.slow)]
)
def test_qlora_step_equals_its_dequantised_reference(name):
    moe = name != "tiny-qwen3_5"
    model, _ = qlora_model(name, experts=moe)
    nf4_names_before = nf4_names(model)
    quantized = {n.replace(".base_layer", "").rsplit(".", 2)[-2] for n in nf4_names(model) if n.endswith(".weight")}
    assert GDN[name] | ATTENTION_MLP <= quantized, GDN[name] | ATTENTION_MLP - quantized  # every GDN projection
    if moe:
        assert {n.rsplit(".", 1)[-1] for n in nf4_names(model)} >= set(experts.PARAMETERS)
    params = dict(model.named_parameters(remove_duplicate=False))  # lm_head tied to embed_tokens too
    kept = ("embed_tokens.weight", "lm_head.weight", "A_log", "dt_bias", "conv1d.weight", "norm.weight")
    kept += ("mlp.gate.weight",) if moe else ()  # the router
    for end in kept:  # embeddings, head, norms, the GDN's small parameters, the router: dense
        held = [p for n, p in params.items() if n.endswith(end)]
        assert held and not any(nf4.is_nf4(p) for p in held), end
    batch = packed_batch([10, 30, 35], "cpu", 0)
    loss, grads = train_step(model, batch)
    assert dequantize_in_place(model) == len(nf4_names_before)
    want_loss, want = train_step(model, batch)
    tol = dict(rtol=1e-5, atol=1e-6)  # the same dequantised values either way: fp32 reordering only
    torch.testing.assert_close(loss, want_loss, **tol)
    assert grads.keys() == want.keys() and all("lora_" in n for n in grads) and len(grads) > 20
    for n in want:
        torch.testing.assert_close(grads[n], want[n], **tol, msg=n)


def test_qlora_under_bf16_autocast_is_the_bf16_reference():
    """A GPU run's form: the base in bf16, autocast bf16; the experts' grouped GEMM dequantises in bf16 too."""
    model, _ = qlora_model("tiny-qwen3_5_moe", dtype=torch.bfloat16, experts=True)
    batch = packed_batch([20, 44], "cpu", 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = train_step(model, batch)
    dequantize_in_place(model)
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_loss, want = train_step(model, batch)
    tol = dict(rtol=1e-5, atol=1e-6)  # the same bf16 weights into the same autocast products: equal on the CPU
    torch.testing.assert_close(loss, want_loss, **tol)
    assert grads.keys() == want.keys() and len(grads) > 20
    for n in want:
        torch.testing.assert_close(grads[n], want[n], **tol, msg=n)


def test_targets_read_shapes_on_the_meta_device():
    from hybridtune.models.meta import skeleton
    from hybridtune.models.presets import preset_config

    model = skeleton(preset_config("tiny-qwen3_5_moe", vocab_size=256))
    found = quant.targets(model)
    assert all(p.is_meta for p in model.parameters())
    assert any(n.endswith("experts.gate_up_proj") for n in found) and not any("embed" in n for n in found)
    assert not any(n.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "conv1d.weight")) for n in found)


def test_resident_bytes_count_nf4_as_held():
    w = torch.randn(128, 256)
    q = torch.nn.Parameter(nf4.quantize(w), requires_grad=False)
    assert memory.resident_bytes([q]) == nf4.nbytes(q) < w.numel() // 2 + w.numel() // 64 * 2 + 64
    assert memory.dequantized_bytes([q, torch.nn.Parameter(w)]) == 2 * w.numel() * 2


def test_without_torchao_one_line(monkeypatch):
    def missing():
        raise ConfigError(nf4.MISSING)

    monkeypatch.setattr(nf4, "_nf4_module", missing)
    with pytest.raises(ConfigError, match=r"pip install 'hybridtune\[qlora\]'"):
        quant.roundtrip_targets(torch.nn.Linear(64, 64))


def test_qlora_and_load_in_4bit_in_config():
    from hybridtune.config import load_config

    for keys in ({"adapter": "qlora"}, {"adapter": "lora", "load_in_4bit": True}):
        cfg = load_config(None, keys)
        assert (cfg.adapter, cfg.load_in_4bit) == ("lora", True)
    assert load_config(None, {"adapter": "lora"}).load_in_4bit is False
    with pytest.raises(ConfigError, match="load_in_4bit.*needs adapter: lora"):
        load_config(None, {"load_in_4bit": True})  # a full fine-tune
    with pytest.raises(ConfigError, match="one process"):
        quant.check_supported(2, "ddp")


def test_the_step_estimate_counts_the_dequantised_transient():
    """`measure.state_bytes` (what the checkpointing choice weighs before the first step) adds the largest NF4
    weight dequantised twice in bf16 to a QLoRA run's trainable state."""
    from hybridtune.runtime.distributed import ONE
    from hybridtune.runtime.measure import state_bytes

    model, _ = qlora_model("tiny-qwen3_5_moe", experts=True, layers=["linear_attention"])
    largest = max(p.numel() for p in model.parameters() if nf4.is_nf4(p))
    with_nf4 = state_bytes(model, ONE, bf16=True)
    dequantize_in_place(model)
    assert with_nf4 - state_bytes(model, ONE, bf16=True) == 2 * largest * 2


def test_the_loop_inlines_every_layer_over_an_nf4_base():
    """torch's compiled regions (invoke_subgraph) take no tensor subclass: under load_in_4bit the loop inlines."""
    from hybridtune.config import load_config
    from hybridtune.runtime.choices import choose_compile_regions
    from hybridtune.runtime.facts import Facts

    facts = Facts(device="cuda")
    assert choose_compile_regions(load_config(None, {"adapter": "lora"}), facts, "loop").value is True
    choice = choose_compile_regions(load_config(None, {"adapter": "qlora"}), facts, "loop")
    assert choice.value is False and "NF4" in choice.reason and not choice.warnings
    forced = choose_compile_regions(load_config(None, {"adapter": "qlora", "compile_regions": True}), facts, "loop")
    assert forced.value is False and forced.warnings
