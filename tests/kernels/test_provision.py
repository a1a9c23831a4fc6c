"""Provisioning policy with a mocked installer: nothing is downloaded, nothing is installed."""

from __future__ import annotations

import subprocess

import pytest

pytest.importorskip("transformers")

from hybridtune.errors import ConfigError, KernelUnavailableError  # noqa: E402
from hybridtune.kernels import gates, provision  # noqa: E402
from hybridtune.kernels.install import InstallResult, PipInstaller  # noqa: E402
from hybridtune.kernels.provision import provision_kernels, resolve_policy  # noqa: E402

GPU = "cuda (fake H200)"


class FakeInstaller:
    """Records every call; 'installs' by adding to the fake environment `present`."""

    def __init__(self, present: dict, ok=True, offline=False, import_ok=True, raises=False):
        self.present, self.ok, self.offline, self.import_ok, self.raises = present, ok, offline, import_ok, raises
        self.installs, self.checks, self.rollbacks = [], [], []

    def command(self, specs):
        return ["python", "-m", "pip", "install", "--only-binary=:all:", *specs]

    def install(self, specs):
        self.installs.append(list(specs))
        if self.raises:
            raise OSError("no pip here")
        changed = {s.split("==")[0]: (None, s.split("==")[1]) for s in specs}
        if self.ok:
            self.present["fla"] = "0.6.0"
        return InstallResult(
            self.ok,
            self.command(specs),
            "ERROR: No matching distribution" if self.offline else "",
            changed,
            self.offline,
        )

    def check_import(self, code):
        self.checks.append(code)
        return self.import_ok, "" if self.import_ok else "ImportError: libcuda.so"

    def rollback(self, result):
        self.rollbacks.append(result)
        self.present.pop("fla", None)
        return True, ""


@pytest.fixture
def env(monkeypatch):
    """A fake environment: import name -> version of what is 'installed'."""
    present: dict[str, str] = {}
    monkeypatch.setattr(provision, "installed_version", lambda name: present.get(name))
    return present


def _prepare(policy, require, model="qwen3_5_text", installer=None, accel=GPU, **kw):
    return provision_kernels(
        policy, require, model, installer=installer, accelerator=accel, selftest=False, env=kw.pop("env", {}), **kw
    )


def test_policy_resolution():
    assert resolve_policy(None, None, {}) == ("check", "default", False)
    assert resolve_policy("auto", True, {}) == ("auto", "config", True)
    assert resolve_policy("auto", False, {"HYBRIDTUNE_KERNELS": "off"}) == ("off", "env HYBRIDTUNE_KERNELS", False)
    assert resolve_policy("auto", False, {"HYBRIDTUNE_REQUIRE_FAST_PATH": "1"})[2] is True
    assert resolve_policy("auto", True, {"HYBRIDTUNE_REQUIRE_FAST_PATH": "0"})[2] is False
    with pytest.raises(ConfigError, match="'fast'"):
        resolve_policy("fast", False, {})
    with pytest.raises(ConfigError, match="boolean"):
        resolve_policy("auto", False, {"HYBRIDTUNE_REQUIRE_FAST_PATH": "maybe"})


def test_auto_installs_pinned_wheels_and_checks_in_a_child(env):
    inst = FakeInstaller(env)
    rep = _prepare("auto", False, installer=inst)
    assert inst.installs == [["flash-linear-attention==0.6.0", "fla-core==0.6.0"]]  # causal_conv1d has no wheel
    assert inst.checks == ["import fla.ops.gated_delta_rule, fla.modules.causal_conv1d"]
    assert rep.kernels["fla"].state == "installed"
    assert rep.kernels["causal_conv1d"].state == "no-wheel"
    assert rep.kernels["causal_conv1d"].substitute == "fla"  # hybridtune's ops use FLA's Triton conv
    assert rep.fast_path, rep.gaps


def test_auto_skips_what_is_present(env):
    env["fla"] = "0.6.0"
    inst = FakeInstaller(env)
    rep = _prepare("auto", True, installer=inst)
    assert inst.installs == []
    assert rep.kernels["fla"].state == "present" and rep.fast_path


def test_environment_switch_overrides_config(env):
    inst = FakeInstaller(env)
    rep = _prepare("auto", False, installer=inst, env={"HYBRIDTUNE_KERNELS": "check"})
    assert inst.installs == []
    assert rep.policy == "check" and rep.policy_source == "env HYBRIDTUNE_KERNELS"
    assert rep.kernels["fla"].state == "missing"
    assert "pip install" in rep.kernels["fla"].detail


def test_check_with_require_fast_path_refuses(env):
    with pytest.raises(KernelUnavailableError) as err:
        _prepare("check", True, installer=FakeInstaller(env))
    msg = str(err.value)
    assert "\n" not in msg
    assert "fla missing" in msg and "flash-linear-attention==0.6.0" in msg


def test_install_failure_offline_reports_the_command(env):
    inst = FakeInstaller(env, ok=False, offline=True)
    rep = _prepare("auto", False, installer=inst)
    st = rep.kernels["fla"]
    assert st.state == "install-failed"
    assert "offline or refused" in st.detail and "flash-linear-attention==0.6.0" in st.detail
    assert inst.rollbacks  # the partial install was undone
    assert not rep.fast_path and any("fla" in g for g in rep.gaps)


def test_installer_that_raises_does_not_crash(env):
    rep = _prepare("auto", False, installer=FakeInstaller(env, raises=True))
    assert rep.kernels["fla"].state == "install-failed"
    assert "OSError" in rep.kernels["fla"].detail


def test_failed_import_check_rolls_back(env):
    inst = FakeInstaller(env, import_ok=False)
    rep = _prepare("auto", False, installer=inst)
    assert rep.kernels["fla"].state == "install-failed"
    assert "rolled back" in rep.kernels["fla"].detail
    assert len(inst.rollbacks) == 1 and "fla" not in env


def test_off_does_nothing(env):
    inst = FakeInstaller(env)
    rep = _prepare("off", False, installer=inst)
    assert inst.installs == [] and rep.hooks is None and rep.selftest == []


def test_off_keeps_the_gdn_ops_on_the_reference_even_with_fla_installed(env, monkeypatch):
    """A `kernels: off` run on an H200 with FLA installed crashed in its first backward: the ops used FLA (it
    imported), whose Hopper backward needs the self-test that `off` skips. `off` now keeps them on the reference."""
    from hybridtune.mixers.gdn import fla_adapter
    from hybridtune.mixers.gdn import ops as gdn

    monkeypatch.setattr(fla_adapter, "load", lambda: type("F", (), {"version": "0.6.0"})())
    assert gdn.backend("cuda")[0] == "fla"  # as on the GPU machine: FLA importable
    _prepare("off", False, installer=FakeInstaller(env))
    name, why = gdn.backend("cuda")
    assert name == "reference" and "kernels: off" in why
    _prepare("check", False, installer=FakeInstaller(env))
    assert gdn.backend("cuda")[0] == "fla"  # any other policy leaves the choice to FLA's presence (and the self-test)


def test_no_gpu_installs_nothing_and_says_why(env):
    inst = FakeInstaller(env)
    rep = _prepare("auto", False, installer=inst, accel=None)
    assert inst.installs == []
    assert rep.kernels["fla"].state == "no-accelerator"
    assert rep.gaps == ["no CUDA device: fast kernels need a GPU; the torch reference path runs"]
    with pytest.raises(KernelUnavailableError, match="no CUDA device"):
        _prepare("auto", True, installer=inst, accel=None)


@pytest.mark.parametrize("model_type", ["llama", "gemma", "qwen3"])
def test_models_without_gates_pay_nothing(env, model_type):
    inst = FakeInstaller(env)
    rep = _prepare("auto", True, model=model_type, installer=inst, accel=None)
    assert rep.needs == set() and rep.kernels == {} and rep.fast_path
    assert inst.installs == [] and rep.hooks is None and gates.active() is None


def test_gate_style_release_gets_hooks(env):
    rep = _prepare("check", False, installer=FakeInstaller(env))
    if rep.architecture.style == "gates":
        assert gates.active() is not None and "is_flash_linear_attention_available" in rep.hooks["gates"]
    else:  # 5.16+: the modeling module asks no gate; provisioning happened before the import instead
        assert rep.hooks is None and gates.active() is None


def test_warns_when_modeling_already_imported(env, monkeypatch):
    import importlib.util
    import sys
    import types

    name = "transformers.models.qwen3_next.modeling_qwen3_next"
    if name not in sys.modules:  # stand-in for the real import (7 s): only its presence matters
        fake = types.ModuleType(name)
        fake.__spec__ = importlib.util.find_spec(name)
        monkeypatch.setitem(sys.modules, name, fake)

    rep = _prepare("check", False, model="qwen3_next", installer=FakeInstaller(env))
    assert any("imported before provisioning" in w for w in rep.warnings)


def test_report_serialises_and_summarises(env):
    import json

    rep = _prepare("check", False, installer=FakeInstaller(env))
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["architecture"]["needs"] == ["causal_conv1d", "fla"]
    assert d["fast_path"] is False and d["fixes"]
    assert "qwen3_5_text needs causal_conv1d, fla" in rep.summary()


def _fake_pip(seen, install_rc=0, install_err=""):
    def run(cmd, **kw):
        if cmd[1] == "-c":  # the environment snapshot
            return subprocess.CompletedProcess(cmd, 0, '{"torch": "2.11.0", "transformers": "5.17.0"}\n', "")
        seen.append(cmd)
        if "--constraint" in cmd:
            seen.append(open(cmd[cmd.index("--constraint") + 1]).read())
        return subprocess.CompletedProcess(cmd, install_rc, "", install_err)

    return run


def test_pip_installer_holds_torch_and_goes_wheels_only(monkeypatch):
    seen = []
    err = "ERROR: No matching distribution found for fla-core==0.6.0"
    monkeypatch.setattr(subprocess, "run", _fake_pip(seen, 1, err))
    res = PipInstaller(env={}).install(["flash-linear-attention==0.6.0", "fla-core==0.6.0"])
    assert not res.ok and res.offline
    assert "--only-binary=:all:" in seen[0]
    assert seen[1].split() == ["torch==2.11.0", "transformers==5.17.0"]  # held at the target's own versions


def test_pip_installer_wheelhouse(monkeypatch):
    seen = []
    monkeypatch.setattr(subprocess, "run", _fake_pip(seen))
    inst = PipInstaller(python="py", env={"HYBRIDTUNE_WHEELHOUSE": "/wheels"})
    assert inst.command(["fla-core==0.6.0"]) == [
        "py", "-m", "pip", "install", "--only-binary=:all:", "--no-index", "--find-links", "/wheels", "fla-core==0.6.0"
    ]  # fmt: skip
    assert inst.install(["fla-core==0.6.0"]).ok


def test_pip_installer_offline_switch_runs_nothing(monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("ran pip while offline"))
    res = PipInstaller(env={"HYBRIDTUNE_OFFLINE": "1"}).install(["fla-core==0.6.0"])
    assert res.offline and not res.ok and "fla-core==0.6.0" in res.command


def test_pip_rollback_uninstalls_added_and_restores_moved(monkeypatch):
    seen = []
    monkeypatch.setattr(subprocess, "run", _fake_pip(seen))
    res = InstallResult(
        True,
        [],
        changed={"flash-linear-attention": (None, "0.6.0"), "einops": ("0.7.0", "0.8.1"), "six": ("1.16.0", None)},
    )
    ok, _ = PipInstaller(python="py", env={}).rollback(res)
    assert ok
    assert seen[0] == ["py", "-m", "pip", "uninstall", "-y", "flash-linear-attention"]
    assert seen[1] == ["py", "-m", "pip", "install", "--no-deps", "einops==0.7.0", "six==1.16.0"]


def test_gate_hook_provisions_under_policy(env, monkeypatch):
    """A gate-style modeling import asking for a kernel provision_kernels() did not know about installs it under auto."""
    import transformers.utils.import_utils as iu

    rep = _prepare("auto", False, model="llama", installer=FakeInstaller(env))
    inst = FakeInstaller(env)
    on_false = provision._gate_provisioner("auto", inst, rep)
    assert on_false("fla", "is_flash_linear_attention_available") is True
    assert inst.installs == [["flash-linear-attention==0.6.0", "fla-core==0.6.0"]]
    rep.accelerator = None
    assert on_false("fla", "is_flash_linear_attention_available") is False  # no GPU: the gate would still say no
    assert hasattr(iu, "is_flash_linear_attention_available")


def test_preset_name_and_checkpoint_dir(env, tmp_path):
    from hybridtune.models.presets import preset_config

    by_preset = _prepare("check", False, model="qwen3_5-9b", installer=FakeInstaller(env))
    assert by_preset.architecture.model_type == "qwen3_5_text"
    preset_config("qwen3_5-9b").save_pretrained(tmp_path / "run-42")
    by_dir = _prepare("check", False, model=str(tmp_path / "run-42"), installer=FakeInstaller(env))
    assert by_dir.to_dict()["kernels"] == by_preset.to_dict()["kernels"]


def test_another_rank_installed_it_meanwhile(monkeypatch):
    """Ranks of one run all call provision_kernels: under the install lock the second finds the kernel there."""
    from hybridtune.kernels.needs import kernels

    monkeypatch.setattr(provision, "installed_version", lambda name: "0.6.0")
    inst = FakeInstaller({})
    state, version, detail = provision.provision_kernel(kernels()["fla"], "auto", inst)
    assert (state, version) == ("present", "0.6.0") and inst.installs == []
    assert "another process" in detail
