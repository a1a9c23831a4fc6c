"""Gate hooks with fake gates that count calls: transformers' real import_utils, fake gate functions."""

from __future__ import annotations

import functools
import sys
import types

import pytest

pytestmark = pytest.mark.transformers_compat  # reads transformers' code: run again under another release (CI)

pytest.importorskip("transformers")

from hybridtune.kernels import gates  # noqa: E402

GATE = "is_flash_linear_attention_available"


class FakeGate:
    """An lru_cached gate like transformers' own, reading a flag the fake installer flips."""

    def __init__(self, installed: bool):
        self.installed = installed
        self.probes = 0

        @functools.lru_cache
        def is_flash_linear_attention_available() -> bool:
            self.probes += 1
            return self.installed

        is_flash_linear_attention_available._dynamo_marked_constant = True
        self.fn = is_flash_linear_attention_available


class FakeInstaller:
    def __init__(self, gate: FakeGate, ok: bool = True, raises: bool = False):
        self.gate, self.ok, self.raises, self.calls = gate, ok, raises, []

    def __call__(self, kernel: str, gate_name: str) -> bool:
        self.calls.append((kernel, gate_name))
        if self.raises:
            raise RuntimeError("pip exploded")
        if self.ok:
            self.gate.installed = True
        return self.ok


@pytest.fixture
def fake(monkeypatch):
    """A fake gate on transformers' import_utils and a fake modeling module that bound it by name."""
    import transformers.utils.import_utils as iu

    def make(installed: bool):
        g = FakeGate(installed)
        monkeypatch.setattr(iu, GATE, g.fn)
        modeling = types.ModuleType("fake_modeling_gdn")
        setattr(modeling, GATE, g.fn)  # what `from ...import_utils import is_x` leaves behind
        monkeypatch.setitem(sys.modules, "fake_modeling_gdn", modeling)
        return g, modeling, iu

    return make


def _install(on_false, env=None):
    return gates.install_gate_hooks(on_false, gates={GATE: "fla"}, env=env or {})


def test_install_on_false(fake):
    g, modeling, iu = fake(installed=False)
    inst = FakeInstaller(g)
    hooks = _install(inst)
    assert modeling.is_flash_linear_attention_available() is True
    assert inst.calls == [("fla", GATE)]
    assert g.probes == 2  # probed, installed, cache cleared, probed again
    ev = hooks.events[0]
    assert (ev.first, ev.provisioned, ev.final) == (False, True, True)


def test_skip_on_true(fake):
    g, modeling, iu = fake(installed=True)
    inst = FakeInstaller(g)
    _install(inst)
    assert iu.is_flash_linear_attention_available() is True
    assert inst.calls == []
    assert g.probes == 1


def test_idempotent_and_short_circuit(fake):
    g, modeling, iu = fake(installed=False)
    inst = FakeInstaller(g)
    first = _install(inst)
    assert _install(inst) is first  # a second install is the same hooks, not a second layer
    assert iu.is_flash_linear_attention_available.__wrapped__ is g.fn
    for _ in range(5):
        assert iu.is_flash_linear_attention_available() is True
        assert modeling.is_flash_linear_attention_available() is True
    assert len(inst.calls) == 1
    assert g.probes == 2  # every later call is answered without probing
    assert len(first.events) == 1


def test_install_failure_does_not_crash(fake):
    g, modeling, iu = fake(installed=False)
    inst = FakeInstaller(g, raises=True)
    hooks = _install(inst)
    assert iu.is_flash_linear_attention_available() is False
    assert iu.is_flash_linear_attention_available() is False
    assert len(inst.calls) == 1  # not retried on every call
    assert (hooks.events[0].provisioned, hooks.events[0].final) == (False, False)


def test_install_refused_reports_false(fake):
    g, modeling, iu = fake(installed=False)
    inst = FakeInstaller(g, ok=False)
    hooks = _install(inst)
    assert iu.is_flash_linear_attention_available() is False
    assert hooks.events[0].provisioned is False


def test_environment_switch_disables(fake):
    g, modeling, iu = fake(installed=False)
    inst = FakeInstaller(g)
    assert _install(inst, env={gates.ENV_DISABLE: "1"}) is None
    assert iu.is_flash_linear_attention_available is g.fn
    assert iu.is_flash_linear_attention_available() is False
    assert inst.calls == []


def test_stale_lru_cache_is_cleared(fake):
    g, modeling, iu = fake(installed=False)
    assert g.fn() is False  # an early probe cached False ...
    g.installed = True  # ... then the kernel arrived (another process, a manual pip install)
    assert g.fn() is False  # the plain gate keeps its stale answer
    inst = FakeInstaller(g)
    _install(inst)
    assert modeling.is_flash_linear_attention_available() is True
    assert inst.calls == []


def test_sys_modules_rebind_and_uninstall(fake):
    g, modeling, iu = fake(installed=True)
    hooks = _install(FakeInstaller(g))
    wrapper = hooks.wrappers[GATE]
    assert modeling.is_flash_linear_attention_available is wrapper
    assert iu.is_flash_linear_attention_available is wrapper
    assert "fake_modeling_gdn." + GATE in hooks.rebound
    assert getattr(wrapper, "_dynamo_marked_constant", False)
    assert wrapper.__wrapped__ is g.fn
    gates.uninstall_gate_hooks()
    assert modeling.is_flash_linear_attention_available is g.fn
    assert iu.is_flash_linear_attention_available is g.fn
    assert gates.active() is None


def test_module_imported_after_hooking_sees_wrapper(fake):
    g, modeling, iu = fake(installed=True)
    _install(FakeInstaller(g))
    later = types.ModuleType("late_modeling")
    exec(f"from transformers.utils.import_utils import {GATE}", later.__dict__)
    assert getattr(later, GATE) is iu.is_flash_linear_attention_available


def test_clear_gate_caches_resets_wrapper(fake):
    g, modeling, iu = fake(installed=False)
    inst = FakeInstaller(g, ok=False)
    _install(inst)
    assert iu.is_flash_linear_attention_available() is False
    g.installed = True
    assert GATE in gates.clear_gate_caches({GATE: "fla"})
    assert iu.is_flash_linear_attention_available() is True


def test_missing_transformers_is_a_noop(monkeypatch):
    for name in ("transformers", "transformers.utils", "transformers.utils.import_utils"):
        monkeypatch.setitem(sys.modules, name, None)
    assert gates.install_gate_hooks(lambda k, g: True, env={}) is None
    assert gates.clear_gate_caches() == []


def test_reset_lazy_kernels(monkeypatch):
    hub = types.ModuleType("transformers.integrations.hub_kernels")
    hub._KERNEL_MODULE_MAPPING = {"causal-conv1d": None, "mamba-ssm": types.ModuleType("mamba_ssm")}
    monkeypatch.setitem(sys.modules, "transformers.integrations.hub_kernels", hub)
    assert gates.reset_lazy_kernels() == ["causal-conv1d"]
    assert list(hub._KERNEL_MODULE_MAPPING) == ["mamba-ssm"]


def test_real_gates_hooked_and_restored():
    import transformers.utils.import_utils as iu

    originals = {name: getattr(iu, name) for name in gates.GATES if hasattr(iu, name)}
    calls = []
    hooks = gates.install_gate_hooks(lambda k, g: calls.append(k) or False, env={})
    assert set(hooks.wrappers) == set(originals)
    assert iu.is_causal_conv1d_available() is False  # CPU: no CUDA, so False, and the policy is asked once
    assert calls == ["causal_conv1d"]
    gates.uninstall_gate_hooks()
    assert {name: getattr(iu, name) for name in originals} == originals


def test_reinstall_replaces_the_policy(fake):
    g, modeling, iu = fake(installed=False)
    refuse = FakeInstaller(g, ok=False)
    accept = FakeInstaller(g)
    _install(refuse)
    _install(accept)  # e.g. doctor hooked under `check`, then training under `auto`
    assert iu.is_flash_linear_attention_available() is True
    assert refuse.calls == [] and len(accept.calls) == 1


def test_without_transformers_everything_degrades(tmp_path):
    """A fresh interpreter where transformers cannot be imported: hooks are a no-op, needs() says why."""
    import subprocess
    import textwrap

    code = textwrap.dedent(
        """
        import sys
        sys.modules["transformers"] = None  # import transformers -> ImportError
        from hybridtune.errors import ModelError
        from hybridtune.kernels import gates, needs, provision, selftest, doctor  # noqa: F401
        assert gates.install_gate_hooks(lambda k, g: True, env={}) is None
        assert gates.clear_gate_caches() == [] and gates.reset_lazy_kernels() == []
        try:
            needs("qwen3_5_text")
        except ModelError as e:
            assert "needs transformers" in str(e), e
        else:
            raise AssertionError("no error")
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
