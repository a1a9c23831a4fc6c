"""The GatedDeltaNet self-test suite (mixers/gdn/selftest.py): its layouts from configs, its error measure, and its
checks run on the CPU (where the ops are the reference). The runner, cache and grants: tests/kernels/test_selftest.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybridtune.kernels.needs import kernels  # noqa: E402
from hybridtune.kernels.selftest import TOLERANCE, layouts_from_config, suites  # noqa: E402
from hybridtune.mixers.gdn import ops, spec  # noqa: E402
from hybridtune.mixers.gdn import selftest as gdn_selftest  # noqa: E402
from hybridtune.mixers.gdn.selftest import Layout  # noqa: E402
from hybridtune.models.presets import preset_config  # noqa: E402

SHAPES = {
    "qwen3_5-0.8b": Layout(16, 16, 128, 128),
    "qwen3_5-2b": Layout(16, 16, 128, 128),
    "qwen3_5-9b": Layout(16, 32, 128, 128),
    "tiny-qwen3_5": Layout(2, 4, 32, 32),
    "tiny-qwen3_next": Layout(2, 4, 32, 32),
}


def test_the_suite_is_the_registered_specs():
    assert spec.SPEC.selftest() is gdn_selftest.SUITE and gdn_selftest.SUITE in suites()
    assert gdn_selftest.SUITE.package in {k.name for k in spec.SPEC.kernels}
    assert set(spec.CONV_FORMS) == set(ops.CONV_FORMS)  # the bench's conv= forms are the ops' own
    assert kernels()["fla"] is spec.FLA  # kernels/needs.py lists the spec's package, not a copy


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_layouts_of_presets(name, tmp_path):
    cfg = preset_config(name, vocab_size=256)
    assert layouts_from_config(cfg) == [SHAPES[name]]
    cfg.save_pretrained(tmp_path / "renamed")
    assert layouts_from_config(str(tmp_path / "renamed")) == [SHAPES[name]]


def test_no_layout_without_gdn():
    from transformers import AutoConfig

    assert layouts_from_config(AutoConfig.for_model("llama")) == []
    assert layouts_from_config("qwen3_5_text") == []  # a bare model_type carries no head dims


def test_layout_conv_dim_and_text():
    assert Layout(16, 32, 128, 128).conv_dim == 2 * 16 * 128 + 32 * 128
    assert gdn_selftest.parse_layout("2,4,32,32") == Layout(2, 4, 32, 32)
    assert gdn_selftest.parse_layout("2x4x32x32x3") == Layout(2, 4, 32, 32, 3)
    with pytest.raises(ValueError, match="H,HV,K,V"):
        gdn_selftest.parse_layout("2,4,32")


def test_rel_rms():
    ref = torch.ones(10)
    assert gdn_selftest.rel_rms(ref, ref) == 0.0
    assert gdn_selftest.rel_rms(ref, ref * 1.01) == pytest.approx(0.01, rel=1e-6)
    assert gdn_selftest.rel_rms(ref, torch.full((10,), float("nan"))) == float("inf")


def test_checks_run_on_cpu_against_the_reference():
    """The check code itself, on the CPU where the ops run the reference: errors are bf16 rounding only."""
    lay = Layout(2, 4, 32, 32)
    errs = gdn_selftest._check_gdn(lay, torch.device("cpu"), lengths=(7, 70))  # short: the CPU runs the reference
    assert set(errs) == {"o", "dq", "dk", "dv", "dg", "dbeta"}
    assert max(errs.values()) < TOLERANCE
    conv = gdn_selftest._check_conv(lay, torch.device("cpu"), lengths=(7, 70))
    assert set(conv) == {"y", "dx", "dweight"} and max(conv.values()) < TOLERANCE
