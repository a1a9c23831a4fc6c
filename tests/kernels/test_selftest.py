"""Device self-test runner: verdicts, cache, guard grants and provisioning (CPU, with the device faked, over the
registered GatedDeltaNet suite), and the real check on a GPU (`cuda` marker). The suite's own layouts and checks:
tests/mixers/gdn/test_selftest.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybridtune.kernels import selftest  # noqa: E402
from hybridtune.kernels.environment import environment  # noqa: E402
from hybridtune.kernels.selftest import layouts_from_config, verify  # noqa: E402
from hybridtune.mixers.gdn import fla_guard  # noqa: E402
from hybridtune.mixers.gdn import selftest as gdn_selftest  # noqa: E402
from hybridtune.mixers.gdn.selftest import Layout  # noqa: E402
from hybridtune.models.presets import preset_config  # noqa: E402


def test_without_cuda_nothing_runs_or_is_granted():
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    (v,) = verify([Layout(16, 32, 128, 128)])
    assert v.passed is None and "no CUDA device" in v.verdict
    assert not fla_guard.is_granted((16, 32, 128, 128))


@pytest.fixture
def fake_device(monkeypatch):
    """Pretend to be a Hopper GPU with FLA: the checks are replaced by functions returning chosen errors."""
    from hybridtune.mixers.gdn import ops as gdn

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake H200")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(gdn, "backend", lambda device: ("fla", "flash-linear-attention 0.6.0 (fake)"))
    monkeypatch.setattr(
        selftest, "fingerprint", lambda kernel, lay, i=0, variant=None: f"fake|{kernel}|{lay.key}|{variant}"
    )
    monkeypatch.setattr(fla_guard, "guard_active", lambda: True)
    calls = {"gdn": 0, "conv": 0}
    errors = {"gdn": 0.004}

    def gdn_check(lay, device):
        calls["gdn"] += 1
        assert fla_guard.is_granted(lay.key)  # the trial runs with the guard lifted for this layout only
        return {"o": 0.004, "dq": errors["gdn"]}

    def conv_check(lay, device):
        calls["conv"] += 1
        return {"y": 0.003}

    monkeypatch.setattr(gdn_selftest, "_check_gdn", gdn_check)
    monkeypatch.setattr(gdn_selftest, "_check_conv", conv_check)
    yield calls, errors
    for key in list(fla_guard.granted()):
        fla_guard.revoke(key)


def test_pass_grants_and_is_cached(fake_device):
    calls, _ = fake_device
    lay = Layout(16, 32, 128, 128)
    verdicts = verify([lay])
    assert [(v.kernel, v.passed, v.cached) for v in verdicts] == [
        ("gdn_chunk", True, False),
        ("causal_conv1d", True, False),
    ]
    assert verdicts[0].granted and fla_guard.is_granted(lay.key)
    assert "kernels.selftest" in fla_guard.granted()[lay.key]
    assert not fla_guard.is_granted((16, 16, 128, 128))  # never wider than what was tested
    fla_guard.revoke(lay.key)  # a new process: grants are per process, verdicts are cached on disk
    again = verify([lay])
    assert calls == {"gdn": 1, "conv": 1}
    assert all(v.cached and v.passed for v in again) and fla_guard.is_granted(lay.key)
    assert selftest._cache_path().is_file()


def test_failure_revokes_and_names_the_fix(fake_device):
    calls, errors = fake_device
    errors["gdn"] = 0.9  # what a miscompiled backward looks like
    lay = Layout(8, 8, 64, 64)
    gdn_v, conv_v = verify([lay])
    assert gdn_v.passed is False and not fla_guard.is_granted(lay.key)
    assert "dq" in gdn_v.reason and "triton>=3.7.1" in gdn_v.fix and "tilelang" in gdn_v.fix
    assert gdn_v.to_dict()["verdict"].startswith("FAIL") and gdn_v.to_dict()["package"] == "fla"
    assert conv_v.passed is True


def test_kernel_that_raises_is_a_failed_verdict(fake_device, monkeypatch):
    def boom(lay, device):
        raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results (see #640)")

    monkeypatch.setattr(gdn_selftest, "_check_gdn", boom)
    v = verify([Layout(4, 4, 64, 64)])[0]
    assert v.passed is False and "#640" in v.reason and not fla_guard.is_granted((4, 4, 64, 64))


def test_prepare_runs_the_selftest_on_gpu(fake_device, monkeypatch):
    from hybridtune.kernels import provision

    monkeypatch.setattr(provision, "installed_version", lambda name: "0.6.0" if name == "fla" else None)
    cfg = preset_config("qwen3_5-9b")
    rep = provision.provision_kernels("check", True, cfg, accelerator="cuda (Fake H200)", env={})
    assert [v["kernel"] for v in rep.selftest] == ["gdn_chunk", "causal_conv1d"]
    assert rep.fast_path and fla_guard.is_granted((16, 32, 128, 128))


def test_a_verdict_is_keyed_by_the_shipped_table_it_ran_under(monkeypatch):
    from hybridtune.mixers.gdn import tuned

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    lay = Layout(16, 16, 128, 128)
    with_table = selftest.fingerprint("gdn_chunk", lay)
    assert "|triton " in with_table and "|fla " in with_table and "|tilelang " in with_table
    assert "|gdn_chunk|(16, 16, 128, 128)|bf16|configs " in with_table  # the format of the verdicts cached so far
    assert "|causal_conv1d|D=6144 W=4|bf16|" in selftest.fingerprint("causal_conv1d", lay)
    assert with_table.endswith(f"|configs {tuned.digest('NVIDIA H200')}") and "configs none" not in with_table
    monkeypatch.setattr(tuned, "digest", lambda device: "none")
    assert selftest.fingerprint("gdn_chunk", lay) != with_table


def test_the_shipped_kernel_configs_are_seeded_before_the_selftest_and_said(fake_device, monkeypatch):
    """Provisioning puts the device kind's FLA table into the autotuners before the self-test's first kernel call,
    says so in the report, its summary and doctor; a failure there is a warning and the self-test still runs."""
    from hybridtune.kernels import doctor, provision
    from hybridtune.mixers.gdn import fla_adapter, tuned

    order = []
    monkeypatch.setattr(provision, "installed_version", lambda name: "0.6.0" if name == "fla" else None)
    monkeypatch.setattr(fla_adapter, "load", lambda: order.append("load"))
    monkeypatch.setattr(tuned, "seed", lambda device: order.append(f"seed {device}") or f"kernel configs: for {device}")
    real_verify = selftest.verify
    monkeypatch.setattr(selftest, "verify", lambda *a, **k: order.append("verify") or real_verify(*a, **k))
    rep = provision.provision_kernels("check", False, preset_config("qwen3_5-2b"), accelerator="cuda (x)", env={})
    # The backend lines after the self-test ask FLA's availability again (a cached load): only loads may follow.
    assert order[:3] == ["load", "seed Fake H200", "verify"] and set(order[3:]) <= {"load"}
    assert (
        rep.kernel_configs == "kernel configs: for Fake H200" and rep.to_dict()["kernel_configs"] == rep.kernel_configs
    )
    assert "  kernel configs: for Fake H200" in rep.summary().splitlines()
    d = {"environment": environment(), "attention": {"packed_path": "x"}, "model": {"source": "s", "model_type": "t"}}
    d["provision"] = rep.to_dict()
    assert "  kernel configs: for Fake H200" in doctor.render(d).splitlines()

    def broken():
        raise RuntimeError("no triton")

    monkeypatch.setattr(fla_adapter, "load", broken)
    rep = provision.provision_kernels("check", False, preset_config("qwen3_5-2b"), accelerator="cuda (x)", env={})
    assert rep.kernel_configs == "kernel configs: not seeded (RuntimeError); FLA autotunes its kernels"
    assert rep.selftest and all(v["passed"] for v in rep.selftest)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["qwen3_5-2b", "qwen3_5-9b"])
def test_selftest_on_device(name):
    """On a GPU with FLA: the real kernels against the fp32 reference for the real head layouts."""
    from hybridtune.mixers.gdn import ops as gdn

    if gdn.backend("cuda")[0] != "fla":
        pytest.skip("flash-linear-attention not installed")
    verdicts = verify(layouts_from_config(preset_config(name)), use_cache=False)
    for v in verdicts:
        assert v.passed, v.to_dict()


def test_ops_without_fla_on_gpu_is_a_gap(monkeypatch):
    """FLA importable by name but unusable by the ops (a missing dependency): reported, never called fast."""
    from hybridtune.kernels import provision
    from hybridtune.mixers.gdn import ops as gdn

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake H200")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        gdn, "backend", lambda d: ("reference", "flash-linear-attention is not importable: No module named 'einops'")
    )
    monkeypatch.setattr(provision, "installed_version", lambda name: "0.6.0" if name == "fla" else None)
    rep = provision.provision_kernels(
        "check", False, preset_config("qwen3_5-2b"), accelerator="cuda (Fake H200)", env={}
    )
    assert not rep.fast_path
    assert any("einops" in g for g in rep.gaps)
