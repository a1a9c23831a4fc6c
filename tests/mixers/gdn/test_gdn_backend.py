"""The GDN chunk's backend (mixers/gdn/backend.py) on the CPU: FLA's dispatch decision read from FLA's registry, the
`gdn_backend` pin, grants keyed by backend, the self-test of each backend, and the ops' FlashQLA plumbing.

FLA needs Triton, which this machine lacks, so FLA's registry is a stand-in with FLA 0.6.0's semantics, copied from
`fla/backends.py` and `fla/ops/gated_delta_rule/backends/flash_qla.py`: a backend is available when its package is
findable (`find_spec`), enabled unless its env var (`FLA_FLASH_QLA`) is "0", and taken when its verifier accepts the
call (Hopper, K = V = 128, bf16). `flash_qla` is a fake module in `sys.modules`. The real registry is checked against
FLA's actual dispatch on a GPU: test_gdn_backend_cuda.py."""

from __future__ import annotations

import importlib.machinery
import logging
import sys
import types
import typing

import pytest

torch = pytest.importorskip("torch")

from hybridtune.errors import ConfigError  # noqa: E402
from hybridtune.mixers.gdn import backend as cb  # noqa: E402
from hybridtune.mixers.gdn import fla_guard  # noqa: E402
from hybridtune.mixers.gdn import selftest as gdn_selftest  # noqa: E402
from hybridtune.mixers.gdn.selftest import Layout  # noqa: E402

KEY_2B = (16, 16, 128, 128)
KEY_K64 = (4, 8, 64, 64)


class _FlashQLABackend:
    """FLA 0.6.0's FlashQLABackend, its selection logic only (is_available, is_enabled, verify)."""

    backend_type, package_name, env_var, priority = "flash_qla", "flash_qla", "FLA_FLASH_QLA", 3
    hopper = True  # fla.utils.IS_NVIDIA_HOPPER on the machine

    @classmethod
    def is_available(cls):
        return importlib.util.find_spec(cls.package_name) is not None

    def is_enabled(self):
        import os

        if os.environ.get("FLA_FLASH_QLA", "0") != "0":
            return True
        return os.environ.get(self.env_var, "1") != "0"

    def verify(self, function_name, q, k, v, g, beta, **kwargs):
        if not self.hopper:
            return False, "FlashQLA requires NVIDIA SM90, SM100/SM103 or SM120"
        if q.dtype not in (torch.float16, torch.bfloat16):
            return False, f"FlashQLA requires dtype float16 or bfloat16, got {q.dtype}"
        if q.shape[-1] != 128:
            return False, f"FlashQLA requires K=128, got {q.shape[-1]}"
        if v.shape[-1] != 128:
            return False, f"FlashQLA requires V=128, got {v.shape[-1]}"
        return True, None

    def get_implementation(self, name):
        return getattr(self, name, None)

    def chunk_gated_delta_rule(self, *a, **k):  # never called here: the decision is read, not run
        raise AssertionError


@pytest.fixture
def fla(monkeypatch):
    """A stand-in FLA registry (`fla.backends`), with no flash_qla installed yet; the pin back to auto after."""
    registry = types.SimpleNamespace(_get_sorted_backends=lambda: [_FlashQLABackend()])
    backends = types.ModuleType("fla.backends")
    backends._DISPATCH_DISABLED = False
    backends._load_operation_registry = lambda op: registry if op == "gated_delta_rule" else None
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(sys.modules, "fla.backends", backends)
    monkeypatch.delitem(sys.modules, "flash_qla", raising=False)
    monkeypatch.delenv("FLA_FLASH_QLA", raising=False)
    monkeypatch.setattr(_FlashQLABackend, "hopper", True)
    cb.decide_cached.cache_clear()
    yield backends
    cb._PIN[0] = "auto"
    cb.decide_cached.cache_clear()
    for b in fla_guard.BACKENDS:
        for key in list(fla_guard.granted(b)):
            fla_guard.revoke(key, b)


@pytest.fixture
def flash_qla(monkeypatch):
    """A fake `flash_qla` 0.1.3, findable the way FLA looks for it (find_spec through sys.modules)."""
    mod = types.ModuleType("flash_qla")
    mod.__spec__ = importlib.machinery.ModuleSpec("flash_qla", None)
    mod.__version__ = "0.1.3"
    monkeypatch.setitem(sys.modules, "flash_qla", mod)
    monkeypatch.setattr(cb, "dist_version", lambda *names: None)  # the module's __version__, not a distribution
    return mod


def test_without_fla_the_choice_is_triton_and_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla.backends", None)  # import fails
    cb.decide_cached.cache_clear()
    c = cb.decide(KEY_2B)
    assert c.name == cb.TRITON and c.label == "fla-triton" and "no backend registry" in c.why


def test_flash_qla_installed_is_what_fla_dispatches_to(fla, flash_qla):
    c = cb.decide(KEY_2B)
    assert (c.name, c.label) == (cb.FLASH_QLA, "flash-qla 0.1.3 via fla")


@pytest.mark.parametrize(
    ("setup", "why"),
    [
        ("env_off", "turned off by FLA_FLASH_QLA=0"),
        ("not_installed", "not installed"),
        ("k64", "FlashQLA requires K=128, got 64"),
        ("not_hopper", "FlashQLA requires NVIDIA SM90"),
        ("dispatch_off", "FLA_DISABLE_BACKEND_DISPATCH=1"),
    ],
)
def test_each_reason_fla_keeps_its_triton_kernels(fla, flash_qla, monkeypatch, setup, why):
    key = KEY_2B
    if setup == "env_off":
        monkeypatch.setenv("FLA_FLASH_QLA", "0")
    elif setup == "not_installed":
        monkeypatch.delitem(sys.modules, "flash_qla")
    elif setup == "k64":
        key = KEY_K64
    elif setup == "not_hopper":
        monkeypatch.setattr(_FlashQLABackend, "hopper", False)
    else:
        fla._DISPATCH_DISABLED = True
    c = cb.decide(key)
    assert c.name == cb.TRITON and why in c.why


def test_pin_refuses_bad_values_and_a_missing_flash_qla_in_one_line(fla):
    with pytest.raises(ConfigError, match="'triton' is not one of auto, fla-triton, flash-qla"):
        cb.pin("triton")
    with pytest.raises(ConfigError) as e:
        cb.pin("flash-qla")
    assert "not installed: pip install flash-qla" in str(e.value) and "\n" not in str(e.value)


def test_pin_sets_fla_switch_and_the_decision_follows(fla, flash_qla, monkeypatch):
    assert cb.pin("fla-triton") == "fla-triton"
    import os

    assert os.environ["FLA_FLASH_QLA"] == "0"
    assert cb.decide_cached(KEY_2B).name == cb.TRITON  # FLA's own check reads the switch
    cb.pin("flash-qla")
    assert os.environ["FLA_FLASH_QLA"] == "1" and cb.decide_cached(KEY_2B).name == cb.FLASH_QLA
    cb.pin("auto")  # leaves the environment to the user
    assert os.environ["FLA_FLASH_QLA"] == "1"


def test_pinned_flash_qla_that_fla_refuses_falls_back_loudly(fla, flash_qla, caplog):
    cb.pin("flash-qla")
    with caplog.at_level(logging.WARNING, logger=cb.__name__):
        c = cb.decide_cached(KEY_K64)
    assert c.name == cb.TRITON and "pinned but refused" in c.why and "K=128" in c.why
    assert any("flash-qla is pinned" in r.getMessage() for r in caplog.records)


def test_grants_are_keyed_by_backend(fla, flash_qla, caplog):
    fla_guard.grant(KEY_2B, "test: triton verified")
    assert fla_guard.is_granted(KEY_2B) and not fla_guard.is_granted(KEY_2B, cb.FLASH_QLA)
    with caplog.at_level(logging.WARNING, logger=cb.__name__):
        c = cb.for_op(KEY_2B)  # FLA would run flash-qla, which no self-test passed: Triton, said once
    assert c.name == cb.TRITON and "not granted" in c.why
    assert any("has not passed" in r.getMessage() for r in caplog.records)
    fla_guard.grant(KEY_2B, "test: flash-qla verified", cb.FLASH_QLA)
    assert cb.for_op(KEY_2B).label == "flash-qla 0.1.3 via fla"
    fla_guard.revoke(KEY_2B)  # the Triton grant withdrawn does not touch flash-qla's
    assert fla_guard.is_granted(KEY_2B, cb.FLASH_QLA) and not fla_guard.is_granted(KEY_2B)
    assert fla_guard.granted(cb.FLASH_QLA) == {KEY_2B: "test: flash-qla verified"}
    with pytest.raises(ValueError, match="backend must be one of"):
        fla_guard.grant(KEY_2B, "x", "tilelang")


def test_forced_backend_overrides_decision_and_grant(fla, flash_qla):
    with cb.forced(cb.FLASH_QLA):
        assert cb.for_op(KEY_2B).name == cb.FLASH_QLA
    with cb.forced(cb.TRITON):
        assert cb.for_op(KEY_2B).name == cb.TRITON
    with pytest.raises(ValueError):
        with cb.forced("tilelang"):
            pass


def test_suite_variants_test_the_chosen_backend_then_its_fallback(fla, flash_qla, monkeypatch):
    suite, lay = gdn_selftest.SUITE, Layout(*KEY_2B)
    dev = torch.device("cpu")
    assert suite.variants(gdn_selftest.CHUNK, lay, dev) == [
        (cb.FLASH_QLA, "flash-qla 0.1.3 via fla"),
        (cb.TRITON, cb.TRITON),
    ]
    assert suite.variants(gdn_selftest.CONV, lay, dev) == [(None, "fla-triton")]
    monkeypatch.setenv("FLA_FLASH_QLA", "0")
    assert suite.variants(gdn_selftest.CHUNK, lay, dev) == [(cb.TRITON, cb.TRITON)]
    assert suite.variant_versions(cb.FLASH_QLA) == "flash-qla 0.1.3" and suite.variant_versions(cb.TRITON) is None
    from hybridtune.mixers.gdn import fla_adapter

    assert "ops run the torch reference" in suite.backend_lines([lay])[1]  # no FLA here: the ops' own path
    monkeypatch.setattr(fla_adapter, "available", lambda: (True, "flash-linear-attention 0.6.0 (fake)"))
    lines = suite.backend_lines([lay])
    assert "flash-qla 0.1.3 installed" in lines[0] and "FLA_FLASH_QLA=0" in lines[0]
    assert "FLA dispatches to fla-triton" in lines[1] and "turned off by FLA_FLASH_QLA=0" in lines[1]
    assert lines[1].endswith("hybridtune's ops run fla-triton")


def _fake_verify_device(monkeypatch, errors):
    """The kernel self-test runner on a pretend Hopper GPU whose GDN check returns `errors[backend]`."""
    from hybridtune.kernels import selftest
    from hybridtune.mixers.gdn import ops as gdn

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake H200")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(gdn, "backend", lambda device: ("fla", "flash-linear-attention 0.6.0 (fake)"))
    monkeypatch.setattr(fla_guard, "guard_active", lambda: True)
    prints = []
    monkeypatch.setattr(
        selftest, "fingerprint", lambda kernel, lay, i=0, variant=None: prints.append(variant) or f"{kernel}|{variant}"
    )
    ran = []

    def gdn_check(lay, device):
        ran.append(cb._FORCED[0])
        if cb._FORCED[0] == cb.TRITON:  # the Triton trial holds the Triton grant (FLA's Hopper guard)
            assert fla_guard.is_granted(lay.key)
        return {"o": 0.004, "dq": errors[cb._FORCED[0]]}

    monkeypatch.setattr(gdn_selftest, "_check_gdn", gdn_check)
    monkeypatch.setattr(gdn_selftest, "_check_conv", lambda lay, device: {"y": 0.003})
    return selftest, ran, prints


def test_selftest_grants_flash_qla_only_for_its_own_pass(fla, flash_qla, monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIDTUNE_CACHE_DIR", str(tmp_path))
    selftest, ran, prints = _fake_verify_device(monkeypatch, {cb.FLASH_QLA: 0.5, cb.TRITON: 0.005})
    verdicts = selftest.verify([Layout(*KEY_2B)], use_cache=False)
    assert ran == [cb.FLASH_QLA, cb.TRITON] and prints == [cb.FLASH_QLA, cb.TRITON, None]
    by = {v.backend: v for v in verdicts if v.kernel == gdn_selftest.CHUNK}
    assert by["flash-qla 0.1.3 via fla"].passed is False and by["fla-triton"].passed is True
    assert not fla_guard.is_granted(KEY_2B, cb.FLASH_QLA) and fla_guard.is_granted(KEY_2B)
    assert cb.for_op(KEY_2B).name == cb.TRITON  # the loud fallback onto the verified Triton kernels
    assert "on flash-qla 0.1.3 via fla: FAIL" in _summary_line(verdicts)
    assert "FLA's Triton kernels run this head layout instead" in by["flash-qla 0.1.3 via fla"].fix


def test_selftest_pass_grants_flash_qla_and_the_ops_take_it(fla, flash_qla, monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIDTUNE_CACHE_DIR", str(tmp_path))
    selftest, ran, _ = _fake_verify_device(monkeypatch, {cb.FLASH_QLA: 0.006, cb.TRITON: 0.005})
    selftest.verify([Layout(*KEY_2B)], use_cache=False)
    assert fla_guard.is_granted(KEY_2B, cb.FLASH_QLA) and cb.for_op(KEY_2B).label == "flash-qla 0.1.3 via fla"


def _summary_line(verdicts) -> str:
    from hybridtune.kernels.provision import ProvisionReport

    rep = ProvisionReport("auto", "config", False, types.SimpleNamespace(model_type="qwen3_5", needs=set()), "cuda")
    rep.selftest = [v.to_dict() for v in verdicts]
    return "\n".join(rep.summary().splitlines()[1:])


def test_provision_pins_from_config_or_env_before_fla(fla, flash_qla, monkeypatch):
    from hybridtune.kernels.provision import provision_kernels

    env = {"HYBRIDTUNE_OFFLINE": "1"}
    provision_kernels(
        "check", False, "qwen3_5", env=env, accelerator=None, log=False, backends={"gdn_backend": "fla-triton"}
    )
    assert cb.pinned() == "fla-triton"
    monkeypatch.delitem(sys.modules, "flash_qla")
    with pytest.raises(ConfigError, match="^HYBRIDTUNE_GDN_BACKEND: flash-qla is pinned but"):
        provision_kernels("check", False, "qwen3_5", env={**env, "HYBRIDTUNE_GDN_BACKEND": "flash-qla"}, log=False)


def test_a_runs_gdn_backend_key_reaches_provisioning(fla, flash_qla):
    """`hybridtune train` provisions through `provision_for`: the config's gdn_backend pins FLA's choice."""
    from hybridtune.config import load_config
    from hybridtune.kernels.provision import provision_for

    cfg = load_config(None, {"gdn_backend": "flash-qla", "kernels": "check"})
    provision_for(cfg, "qwen3_5", env={"HYBRIDTUNE_OFFLINE": "1"}, accelerator=None, log=False)
    assert cb.pinned() == "flash-qla"


def test_config_key_default_and_choices():
    from hybridtune.config import TrainConfig

    assert TrainConfig().gdn_backend == "auto" == cb.OPTION.default and cb.OPTION.key == "gdn_backend"
    # The config's declaration lists the mixer's choices (the config package sits below mixers/: it cannot import them).
    assert typing.get_args(typing.get_type_hints(TrainConfig)["gdn_backend"]) == cb.CHOICES == cb.OPTION.choices


def test_ops_call_flash_qla_raw_forward_and_backward_in_its_order(flash_qla, monkeypatch):
    """hybridtune::gdn_chunk on the FlashQLA backend: flash_qla's forward returns (g_cum, A, o, ...), FLA's
    (g_cum, o, A, ...); its backward takes the forward's g_cum and A and returns (dq, dk, dv, dbeta, dg, dh0). The
    fake computes with the fp32 reference, so the op's output and every gradient must equal the reference's."""
    from hybridtune.mixers.gdn import fla_adapter
    from hybridtune.mixers.gdn import ops as gdn
    from hybridtune.mixers.gdn.reference import chunk_gated_delta_rule_ref

    seen = {}

    def fwd(*, q, k, v, g, beta, scale, cu_seqlens, is_train, auto_cp, **_):
        seen["fwd"] = (is_train, auto_cp)
        o = chunk_gated_delta_rule_ref(q, k, v, g, beta, scale=scale, cu_seqlens=cu_seqlens, use_qk_l2norm=False)
        A = torch.full((*beta.shape, 64), 7.0)
        return g * 2, A, o, None, None, None  # g_cum stands for g (x2), to check the backward gets it back

    def bwd(*, q, k, v, g, beta, A, do, scale, cu_seqlens, auto_cp, **_):
        assert bool((A == 7.0).all()) and auto_cp  # the split is FlashQLA's own choice outside graph capture
        with gdn._autograd_inside_op():  # the fake differentiates the reference below the autograd key
            ins = [t.detach().requires_grad_() for t in (q, k, v, g / 2, beta)]
            o = chunk_gated_delta_rule_ref(*ins, scale=scale, cu_seqlens=cu_seqlens, use_qk_l2norm=False)
            dq, dk, dv, dg, db = torch.autograd.grad(o, ins, do)
        return dq, dk, dv, db, dg, None

    flash_qla.chunk_gated_delta_rule_fwd, flash_qla.chunk_gated_delta_rule_bwd = fwd, bwd
    monkeypatch.setattr(gdn, "_use_fla", lambda t: True)
    monkeypatch.setattr(fla_adapter, "load", lambda: types.SimpleNamespace())
    gen = torch.Generator().manual_seed(0)
    T, H, HV, K, V = 40, 2, 4, 8, 8
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    q, k = (torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(1, T, HV, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV, generator=gen))
    beta = torch.rand(1, T, HV, generator=gen)
    do = torch.randn(1, T, HV, V, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    with cb.forced(cb.FLASH_QLA):
        o, _, _ = torch.ops.hybridtune.gdn_chunk(*leaves, K**-0.5, cu, None, False)
        grads = torch.autograd.grad(o, leaves, do)
    ref = [t.clone().double().requires_grad_() for t in (q, k, v, g, beta)]
    o_ref = chunk_gated_delta_rule_ref(*ref, scale=K**-0.5, cu_seqlens=cu, use_qk_l2norm=False)
    grads_ref = torch.autograd.grad(o_ref, ref, do.double())
    assert seen["fwd"] == (True, True)  # the intra-card split decided as the backward decides it
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-5)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, grads_ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5, msg=name)
