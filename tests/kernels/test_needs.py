"""Architecture detection: what a modeling module asks for, never the model's name.

Runs under every transformers version the project tests (5.14.1 gate style, 5.17+ decorator style).
"""

from __future__ import annotations

import sys
import textwrap

import pytest

pytestmark = pytest.mark.transformers_compat  # reads transformers' code: run again under another release (CI)

transformers = pytest.importorskip("transformers")

from hybridtune.errors import ModelError  # noqa: E402
from hybridtune.kernels import needs  # noqa: E402
from hybridtune.kernels.needs import analyze  # noqa: E402

GDN = {"fla", "causal_conv1d"}
MAMBA = {"causal_conv1d", "mamba_ssm"}
EXPECTED = {
    "qwen3_5_text": GDN,
    "qwen3_5": GDN,
    "qwen3_5_moe": GDN,
    "qwen3_next": GDN,
    "lfm2": {"causal_conv1d"},
    "lfm2_moe": {"causal_conv1d"},
    "mamba": MAMBA,
    "mamba2": MAMBA,
    "falcon_mamba": MAMBA,
    "jamba": MAMBA,
    "bamba": MAMBA,
    "zamba": MAMBA,
    "zamba2": MAMBA,
    "falcon_h1": MAMBA,
    "granitemoehybrid": MAMBA,
    "nemotron_h": MAMBA,
    "llama": set(),
    "gemma": set(),
    "gemma3_text": set(),
    "qwen2": set(),
    "qwen3": set(),
    "mistral": set(),
}


def _config(model_type: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type)


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_family_needs_and_renamed_directory(model_type, tmp_path):
    cfg = _config(model_type)
    # A directory whose name says nothing (or lies) about the architecture resolves exactly as the original.
    renamed = tmp_path / "llama-3-8b-final-v2"
    cfg.save_pretrained(renamed)
    by_type = analyze(model_type)
    by_config = analyze(cfg)
    by_dir = analyze(str(renamed))
    assert by_type.needs == EXPECTED[model_type]
    assert by_config.needs == by_type.needs == by_dir.needs == needs(renamed / "config.json")
    assert by_dir.modeling_module == by_type.modeling_module
    assert by_dir.mixer_classes == by_type.mixer_classes
    assert bool(by_type.mixer_classes) == bool(EXPECTED[model_type])
    assert by_type.style == ("none" if not EXPECTED[model_type] else by_type.style)


def test_style_matches_transformers_release():
    from packaging.version import Version

    style = analyze("qwen3_5_text").style
    assert style == ("gates" if Version(transformers.__version__) < Version("5.16") else "decorators")


def test_olmo_hybrid_asks_for_fla():
    if "olmo_hybrid" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
        pytest.skip("olmo_hybrid not in this transformers")
    assert "fla" in needs("olmo_hybrid")  # 5.14 uses FLA's own conv; 5.16+ asks for causal_conv1d as well


def test_parsing_does_not_import_the_modeling_module():
    module = "transformers.models.falcon_h1.modeling_falcon_h1"
    if module in sys.modules:
        pytest.skip("already imported by another test")
    assert needs("falcon_h1") == MAMBA
    assert module not in sys.modules


def test_model_instance_and_dict(tmp_path):
    cfg = _config("qwen3_next")
    assert needs({"model_type": "qwen3_next"}) == GDN

    class Holder:
        config = cfg

    assert needs(Holder()) == GDN


def test_unknown_inputs_are_user_errors(tmp_path):
    with pytest.raises(ModelError, match="unknown to transformers"):
        needs("not_a_real_model_type")
    with pytest.raises(ModelError, match="no config.json"):
        needs(str(tmp_path))
    with pytest.raises(ModelError, match="model_type"):
        needs({"hidden_size": 8})


def _fake_architecture(tmp_path, monkeypatch, body: str, name: str = "zzfake"):
    pkg = tmp_path / f"{name}_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / f"configuration_{name}.py").write_text(
        textwrap.dedent(
            f"""
            class FakeConfig:
                model_type = "{name}"
            """
        )
    )
    (pkg / f"modeling_{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = __import__(f"{name}_pkg.configuration_{name}", fromlist=["FakeConfig"])
    return mod.FakeConfig()


def test_new_architecture_decorator_style(tmp_path, monkeypatch):
    # A future architecture asking for a package nobody has heard of: the need follows the source.
    cfg = _fake_architecture(
        tmp_path,
        monkeypatch,
        """
        from transformers.integrations import use_kernel_func_from_hub_with_fallback

        @use_kernel_func_from_hub_with_fallback("fancy_scan", "fancy-kernels")
        def torch_fancy_scan(x):
            return x

        class FancyMixer:
            def forward(self, x):
                return torch_fancy_scan(x)

        class FancyMLP:
            def forward(self, x):
                return x
        """,
        name="zzdeco",
    )
    arch = analyze(cfg)
    assert arch.needs == {"fancy_kernels"}
    assert arch.style == "decorators"
    assert arch.mixer_classes == {"FancyMixer": ("fancy_kernels",)}


def test_new_architecture_gate_style_with_aliases(tmp_path, monkeypatch):
    cfg = _fake_architecture(
        tmp_path,
        monkeypatch,
        """
        from transformers.utils.import_utils import is_flash_linear_attention_available as fla_ok
        from transformers.utils.import_utils import is_mamba_2_ssm_available
        from transformers.integrations import lazy_load_kernel

        if fla_ok():
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        else:
            chunk_gated_delta_rule = None

        fast = all((chunk_gated_delta_rule,))

        class GatedMixer:
            def __init__(self):
                self.rule = chunk_gated_delta_rule

        class FlagUser:
            def forward(self):
                return fast

        class ScanMixer:
            def __init__(self):
                self.conv = lazy_load_kernel("causal-conv1d")
                self.ok = is_mamba_2_ssm_available()
        """,
        name="zzgate",
    )
    arch = analyze(cfg)
    assert arch.style == "gates"
    assert arch.needs == {"fla", "causal_conv1d", "mamba_ssm"}
    assert arch.mixer_classes["GatedMixer"] == ("fla",)
    assert arch.mixer_classes["FlagUser"] == ("fla",)  # through the derived module-level flag
    assert arch.mixer_classes["ScanMixer"] == ("causal_conv1d", "mamba_ssm")
    assert "chunk_gated_delta_rule" in arch.symbols("fla")


@pytest.mark.parametrize("preset", ["tiny-qwen3_5", "tiny-qwen3_next", "qwen3_5-0.8b", "qwen3_5-2b", "qwen3_5-9b"])
def test_presets_resolve_the_same_from_any_directory(preset, tmp_path):
    from hybridtune.models.presets import PRESETS, preset_config

    cfg = preset_config(preset, vocab_size=256)
    saved = tmp_path / "checkpoint-0001"  # nothing in the name says what it is
    cfg.save_pretrained(saved)
    a, b = analyze(cfg).to_dict(), analyze(str(saved)).to_dict()
    a.pop("reason"), b.pop("reason")
    assert a == b
    assert a["model_type"] == PRESETS[preset].model_type
    assert set(a["needs"]) == GDN
