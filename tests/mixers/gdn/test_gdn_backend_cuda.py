"""The GDN chunk's backends on a GPU (`cuda`: they skip without one): each backend's self-test against the fp32
reference (the output and every gradient, FLA's relative RMS <= the self-test's tolerance) at the Qwen3.5-2B and 9B
head layouts, and the resolver's decision equal to what FLA 0.6.0's own `chunk_gated_delta_rule` dispatches to.

One GPU call runs them all: `python -m pytest -q -m cuda tests/mixers/gdn/test_gdn_backend_cuda.py -rs`. The
flash-qla cases skip (saying so) where flash-qla is not installed; with it installed, 0 skips."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from hybridtune.kernels.selftest import TOLERANCE  # noqa: E402
from hybridtune.mixers.gdn import backend as cb  # noqa: E402
from hybridtune.mixers.gdn import fla_guard  # noqa: E402
from hybridtune.mixers.gdn import selftest as gdn_selftest  # noqa: E402
from hybridtune.models.presets import preset_config  # noqa: E402

pytestmark = pytest.mark.cuda
PRESETS = ("qwen3_5-2b", "qwen3_5-9b")


def _layout(preset: str):
    (lay,) = gdn_selftest.layouts(preset_config(preset, vocab_size=256))
    return lay


def _need(backend: str):
    pytest.importorskip("fla", reason="FLA is not installed")
    if backend == cb.FLASH_QLA and not cb.installed():
        pytest.skip("flash-qla is not installed (pip install flash-qla)")


@pytest.mark.parametrize("backend", [cb.TRITON, cb.FLASH_QLA])
@pytest.mark.parametrize("preset", PRESETS)
def test_each_backend_matches_the_fp32_reference(preset, backend):
    _need(backend)
    lay = _layout(preset)
    grant = fla_guard.TRITON if backend == cb.TRITON else cb.FLASH_QLA
    fla_guard.grant(lay.key, "test: trial", grant)  # the Triton trial needs FLA's Hopper guard lifted
    try:
        errors = gdn_selftest.SUITE.check(gdn_selftest.CHUNK, lay, torch.device("cuda"), variant=backend)
    finally:
        fla_guard.revoke(lay.key, grant)
    print(f"{preset} {lay} {backend}: " + ", ".join(f"{k} {v:.5f}" for k, v in errors.items()))
    assert set(errors) == {"o", "dq", "dk", "dv", "dg", "dbeta"}
    bad = {k: v for k, v in errors.items() if not v <= TOLERANCE}
    assert not bad, f"{backend} at {lay}: relative RMS over {TOLERANCE}: {bad}"


@pytest.mark.parametrize("preset", PRESETS)
def test_the_ops_really_run_the_forced_backend(preset, monkeypatch):
    """With FlashQLA forced, flash_qla's raw forward and backward are called (and FLA's Triton ones are not)."""
    _need(cb.FLASH_QLA)
    import flash_qla

    from hybridtune.mixers.gdn import fla_adapter

    calls = []
    for name in ("chunk_gated_delta_rule_fwd", "chunk_gated_delta_rule_bwd"):
        real = getattr(flash_qla, name)
        monkeypatch.setattr(flash_qla, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    f = fla_adapter.load()

    def spy(name):
        real = getattr(f, name)
        return lambda *a, **k: calls.append(name) or real(*a, **k)

    spies = {n: spy(n) for n in ("gdn_fwd", "gdn_bwd")}
    monkeypatch.setattr(fla_adapter, "load", lambda: dataclasses.replace(f, **spies))
    gdn_selftest.SUITE.check(gdn_selftest.CHUNK, _layout(preset), torch.device("cuda"), variant=cb.FLASH_QLA)
    assert calls == ["chunk_gated_delta_rule_fwd", "chunk_gated_delta_rule_bwd"]  # FLA's gdn_fwd/gdn_bwd: never


@pytest.mark.parametrize("switch", [None, "0"])
@pytest.mark.parametrize("preset", PRESETS)
def test_decision_is_what_fla_dispatches_to(preset, switch, monkeypatch):
    """`decide` against FLA's public entry: a spy on FlashQLA's backend says whether FLA actually took it."""
    _need(cb.TRITON)
    import fla.backends
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    if switch is None:
        monkeypatch.delenv(cb.ENV, raising=False)
    else:
        monkeypatch.setenv(cb.ENV, switch)
    taken = []
    for b in fla.backends._load_operation_registry("gated_delta_rule")._get_sorted_backends():
        impl = b.get_implementation("chunk_gated_delta_rule")
        if impl is not None and b.backend_type == cb.FLA_TYPE:
            monkeypatch.setattr(b, "chunk_gated_delta_rule", lambda *a, _i=impl, **k: taken.append(1) or _i(*a, **k))
    lay = _layout(preset)
    H, HV, K, V = lay.key
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    q, k = (torch.randn(1, 256, H, K, device=dev, dtype=bf16, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 256, HV, V, device=dev, dtype=bf16, requires_grad=True)
    g = torch.nn.functional.logsigmoid(torch.randn(1, 256, HV, device=dev)).requires_grad_()
    beta = torch.rand(1, 256, HV, device=dev, dtype=bf16).requires_grad_()
    cu = torch.tensor([0, 100, 256], device=dev, dtype=torch.int32)
    chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    choice = cb.decide(lay.key)
    assert (choice.name == cb.FLASH_QLA) == bool(taken), choice
