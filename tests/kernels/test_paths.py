"""Per-mixer path report on models built on the meta device (no memory, no weights)."""

from __future__ import annotations

import types

import pytest

pytestmark = pytest.mark.transformers_compat  # reads transformers' code: run again under another release (CI)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybridtune.kernels import report  # noqa: E402
from hybridtune.kernels.paths import classify  # noqa: E402
from hybridtune.models.presets import preset_config  # noqa: E402


def _meta(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module")
def tiny_qwen3_5():
    return _meta(preset_config("tiny-qwen3_5", vocab_size=256))


def test_gdn_mixers_found_by_structure(tiny_qwen3_5):
    rep = report(tiny_qwen3_5)
    assert rep.needs == ["causal_conv1d", "fla"]
    assert [m.name for m in rep.mixers] == [f"model.layers.{i}.linear_attn" for i in range(3)]
    (row,) = rep.grouped()
    assert row["count"] == 3 and row["cls"] == "Qwen3_5GatedDeltaNet"
    if not torch.cuda.is_available():
        assert not rep.fast
        assert rep.mixers[0].path == "transformers -> torch reference (no causal_conv1d, no fla)"
        assert "hybridtune routes it through its ops" in rep.mixers[0].note
    assert "3 x Qwen3_5GatedDeltaNet" in rep.summary()


def test_attention_only_model_has_no_mixers():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256)
    rep = report(_meta(cfg))
    assert rep.needs == [] and rep.mixers == [] and rep.fast


def test_patched_mixer_reports_hybridtune_op(tiny_qwen3_5):
    mixer = tiny_qwen3_5.model.layers[0].linear_attn

    def forward(self, hidden_states, **kw):
        return hidden_states

    forward.__module__ = "hybridtune.models.patching"
    mixer.forward = types.MethodType(forward, mixer)
    try:
        rep = report(tiny_qwen3_5)
    finally:
        del mixer.forward
    first = rep.mixers[0]
    assert first.path.startswith("hybridtune op -> ")
    assert rep.mixers[1].path.startswith("transformers -> ")


def _fallback_wrapper(impl):
    # The shape of transformers 5.16+ `use_kernel_func_from_hub_with_fallback`: a wrapper closing over
    # the implementation it chose at decoration time.
    implementation = impl
    is_new_implementation = True

    def wrapped(*args, **kwargs):
        return implementation(*args, **kwargs) if is_new_implementation else None

    return wrapped


def test_classify_kernel_symbols():
    def fla_kernel(*a):
        return a

    fla_kernel.__module__ = "fla.ops.gated_delta_rule.chunk"

    def torch_path(*a):
        return a

    torch_path.__module__ = "transformers.models.qwen3_5.modeling_qwen3_5"
    assert classify(None) == "torch"
    assert classify(fla_kernel) == "fla"
    assert classify(_fallback_wrapper(fla_kernel)) == "fla"
    assert classify(_fallback_wrapper(torch_path)) == "torch"
    assert classify(types.ModuleType("causal_conv1d")) == "causal_conv1d"
