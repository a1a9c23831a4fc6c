"""Provision the fast kernels an architecture needs, under an explicit policy, before its modeling import.

Policy (`kernels:` in the run config, overridden by `HYBRIDTUNE_KERNELS`):

- `auto`: install missing kernels that have pinned wheels (pip in a subprocess, torch, triton and transformers held at
  their versions by a constraints file, the install proved by an import in a child process, rolled back on failure);
  offline or refused, print the exact command;
- `check`: install nothing; report what is missing and what it costs;
- `off`: no provisioning, no gate hooks, no device self-test.

`provision_kernels(cfg.kernels, cfg.require_fast_path, cfg.base_model)` runs before the modeling import and returns a
report (`to_dict()`: JSON for run records); with `require_fast_path` (`HYBRIDTUNE_REQUIRE_FAST_PATH=1`) it raises
`KernelUnavailableError` when a mixer would run a slow fallback. Environment: `HYBRIDTUNE_OFFLINE=1` (never run pip),
`HYBRIDTUNE_WHEELHOUSE=DIR` (local wheels only), `HYBRIDTUNE_NO_GATE_HOOKS=1`.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shlex
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridtune.errors import ConfigError, KernelUnavailableError
from hybridtune.kernels import gates as gates_mod
from hybridtune.kernels import selftest as selftest_mod
from hybridtune.kernels.environment import (
    FALSE_WORDS,
    TRUE_WORDS,
    cache_dir,
    detect_accelerator,
    installed_version,
)
from hybridtune.kernels.install import Installer, InstallResult, PipInstaller
from hybridtune.kernels.needs import ArchitectureNeeds, analyze, kernel_spec, kernels
from hybridtune.mixers.registry import BackendOption, KernelPackage, SelfTestSuite
from hybridtune.models.presets import PRESETS, preset_config

logger = logging.getLogger(__name__)

POLICIES = ("auto", "check", "off")
ENV_POLICY = "HYBRIDTUNE_KERNELS"
ENV_REQUIRE = "HYBRIDTUNE_REQUIRE_FAST_PATH"


# ----------------------------------------------------------------------------------------------------------
# Policy


def resolve_policy(
    policy: str | None, require_fast_path: bool | None, env: Mapping[str, str] | None = None
) -> tuple[str, str, bool]:
    """(policy, where it came from, require_fast_path); the environment overrides the config."""
    env = os.environ if env is None else env
    source = "config"
    if env.get(ENV_POLICY):
        policy, source = env[ENV_POLICY], f"env {ENV_POLICY}"
    elif policy is None:
        policy, source = "check", "default"
    policy = str(policy).strip().lower()
    if policy not in POLICIES:
        raise ConfigError(f"kernels: '{policy}' (from {source}) is not one of {', '.join(POLICIES)}.")
    if env.get(ENV_REQUIRE) is not None:
        raw = env[ENV_REQUIRE].strip().lower()
        if raw not in TRUE_WORDS + FALSE_WORDS:
            raise ConfigError(f"{ENV_REQUIRE}='{env[ENV_REQUIRE]}' is not a boolean (use 1 or 0).")
        require_fast_path = raw in TRUE_WORDS
    return policy, source, bool(require_fast_path)


# ----------------------------------------------------------------------------------------------------------
# Report


@dataclass
class KernelStatus:
    """One needed kernel: present, installed, or the gap with its cost and fix."""

    name: str
    needed_by: list[str]  # the calls in the modeling module that ask for it
    state: str  # present | installed | missing | install-failed | no-wheel | no-accelerator
    version: str | None = None
    detail: str = ""
    fix: str | None = None
    cost: str = ""
    substitute: str | None = None  # present kernel that covers this one on hybridtune's path

    @property
    def available(self) -> bool:
        return self.state in ("present", "installed")

    @property
    def covered(self) -> bool:
        """Available itself, or replaced on hybridtune's path by an available substitute."""
        return self.available or self.substitute is not None


@dataclass
class ProvisionReport:
    policy: str
    policy_source: str
    require_fast_path: bool
    architecture: ArchitectureNeeds
    accelerator: str | None
    kernels: dict[str, KernelStatus] = field(default_factory=dict)
    hooks: dict[str, Any] | None = None
    selftest: list[dict[str, Any]] = field(default_factory=list)
    kernel_configs: str = ""  # the suites' lines on their shipped autotuning tables, when the self-test ran
    backends: list[str] = field(default_factory=list)  # each mixer's kernel backends, one line each
    warnings: list[str] = field(default_factory=list)

    @property
    def needs(self) -> set[str]:
        return self.architecture.needs

    @property
    def gaps(self) -> list[str]:
        """Why the run would be on a slow path; empty when it is fast."""
        out = []
        if self.needs and self.accelerator is None:
            out.append("no CUDA device: fast kernels need a GPU; the torch reference path runs")
        for st in self.kernels.values():
            if st.state != "no-accelerator" and not st.covered:
                out.append(f"{st.name} {st.state}")
        for v in self.selftest:
            if v.get("passed") is False:
                out.append(f"self-test failed for {v.get('kernel')} {v.get('layout')}")
            elif _unusable(v):
                out.append(f"hybridtune's ops cannot use {v['package']} here: {v.get('reason')}")
        return list(dict.fromkeys(out))

    @property
    def fast_path(self) -> bool:
        return not self.gaps

    def fixes(self) -> list[str]:
        out = [st.fix for st in self.kernels.values() if st.fix and not st.covered and st.state != "no-accelerator"]
        for v in self.selftest:
            if v.get("passed") is False and v.get("fix"):
                out.append(v["fix"])
            elif _unusable(v):
                out.append(f"make `python -c '{kernel_spec(v['package']).check_code}'` succeed")
        return list(dict.fromkeys(out))

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "policy_source": self.policy_source,
            "require_fast_path": self.require_fast_path,
            "architecture": self.architecture.to_dict(),
            "accelerator": self.accelerator,
            "kernels": {k: {**vars(v), "covered": v.covered} for k, v in self.kernels.items()},
            "gate_hooks": self.hooks,
            "selftest": self.selftest,
            "kernel_configs": self.kernel_configs,
            "backends": self.backends,
            "fast_path": self.fast_path,
            "gaps": self.gaps,
            "fixes": self.fixes(),
            "warnings": self.warnings,
        }

    def summary(self) -> str:
        arch = self.architecture
        head = f"kernels ({self.policy}, {self.policy_source}): {arch.model_type or '?'} needs " + (
            ", ".join(sorted(self.needs)) or "nothing"
        )
        lines = [head]
        for st in self.kernels.values():
            via = f" via {st.substitute}" if st.substitute and not st.available else ""
            lines.append(f"  {st.name}: {st.state}{' ' + st.version if st.version else ''}{via}. {st.detail}".rstrip())
        if self.kernel_configs:
            lines.append(f"  {self.kernel_configs}")
        lines += [f"  {b}" for b in self.backends]
        for v in self.selftest:
            on = f" on {v['backend']}" if v.get("backend") else ""
            lines.append(f"  self-test {v.get('kernel')} {v.get('layout')}{on}: {v.get('verdict')}")
        if self.gaps:
            lines.append("  slow path: " + "; ".join(self.gaps))
            lines += [f"  fix: {f}" for f in self.fixes()]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Probing and provisioning


def _unusable(v: dict[str, Any]) -> bool:
    """A self-test verdict not run because the ops cannot use its package here (installed, but not importable)."""
    return v.get("passed") is None and v.get("backend") not in (None, "", v.get("package"))


def provision_kernel(spec: KernelPackage, policy: str, installer: Installer) -> tuple[str, str | None, str]:
    """Install one missing kernel under `policy`: (state, version, detail)."""
    cmd = shlex.join(installer.command(list(spec.distributions))) if spec.distributions else spec.fix
    if policy != "auto":
        return "missing", None, f"policy {policy}: not installing; run: {cmd}"
    if not spec.distributions:
        return "no-wheel", None, f"no pinned wheel to install automatically; run: {spec.fix}"
    with _install_lock():
        # Another process (a second rank of the same run) may have installed it while this one waited.
        version = installed_version(spec.name)
        if version is not None:
            return "present", version, "installed meanwhile by another process"
        logger.info("installing %s for the fast path: %s", spec.name, cmd)
        try:
            result = installer.install(list(spec.distributions))
        except Exception as e:  # an installer that raises is an install that failed, never a crashed run
            return "install-failed", None, f"installer raised {type(e).__name__}: {e}; run: {cmd}"
        return _verify_install(spec, installer, result, cmd)


@contextlib.contextmanager
def _install_lock():
    """One installer at a time per user (the ranks of one machine all call `provision_kernels`)."""
    try:
        import fcntl

        path = cache_dir() / "install.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "w")  # noqa: SIM115 (held for the duration of the install)
    except (ImportError, OSError):  # no fcntl (Windows) or no writable cache: proceed unlocked
        yield
        return
    try:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


def _verify_install(
    spec: KernelPackage, installer: Installer, result: InstallResult, cmd: str
) -> tuple[str, str | None, str]:
    """After pip ran: roll back a failed install, prove a successful one imports in a child process."""
    if not result.ok:
        if result.changed:
            try:
                installer.rollback(result)
            except Exception as e:
                logger.error("rolling back the failed install of %s failed: %s", spec.name, e)
        why = "offline or refused by the index" if result.offline else "pip failed"
        tail = result.output.strip().splitlines()[-1:] or [""]
        return "install-failed", None, f"{why} ({tail[0][:200]}); run: {cmd}"
    try:
        ok, out = installer.check_import(spec.check_code)
    except Exception as e:
        ok, out = False, f"{type(e).__name__}: {e}"
    if not ok:
        try:
            rb_ok, _ = installer.rollback(result)
        except Exception:
            rb_ok = False
        tail = out.strip().splitlines()[-1:] or [""]
        rolled = "rolled back" if rb_ok else "ROLLBACK FAILED, check the environment"
        return (
            "install-failed",
            None,
            f"installed but `{spec.check_code}` failed in a child ({tail[0][:200]}); {rolled}",
        )
    importlib.invalidate_caches()
    version = installed_version(spec.name)
    if version is None:
        return "install-failed", None, f"installed by pip but not importable here (another environment?); run: {cmd}"
    return "installed", version, f"installed by hybridtune ({cmd})"


def provision_kernels(
    policy: str | None,
    require_fast_path: bool | None,
    model_type_or_config: Any,
    *,
    installer: Installer | None = None,
    accelerator: str | None | Callable[[], str | None] = detect_accelerator,
    selftest: bool = True,
    env: Mapping[str, str] | None = None,
    log: bool = True,
    backends: Mapping[str, str | None] | None = None,
) -> ProvisionReport:
    """Resolve, provision and verify the kernels of one architecture. Call before importing its modeling module.

    `model_type_or_config`: a transformers config, a preset name or a local checkpoint directory (these carry
    head dims, which the device self-test needs), or a bare model_type. Raises `KernelUnavailableError` when `require_fast_path` and a gap remains,
    `ConfigError` for a bad policy or kernel backend (`backends`: config key -> choice of each suite's
    `BackendOption`, overridden by its environment variable; pinned here, before the kernels' import). Everything
    else (an installer crash, no network) ends up in the report.
    """
    policy, source, require = resolve_policy(policy, require_fast_path, env)
    pin_backends(backends or {}, os.environ if env is None else env)
    # `off`: the mixers' ops run their torch reference even where their package is installed (said once, as a slow
    # path).
    for package in kernels().values():
        if package.turn_off is not None:
            package.turn_off("kernels: off (the config asks for no fast kernels)" if policy == "off" else None)
    model_type_or_config = _preset_or_self(model_type_or_config)
    arch = analyze(model_type_or_config)
    accel = accelerator() if callable(accelerator) else accelerator
    report = ProvisionReport(policy, source, require, arch, accel)
    installer = installer if installer is not None else PipInstaller(env=env)

    if arch.modeling_module and arch.modeling_module in sys.modules and arch.needs:
        report.warnings.append(
            f"{arch.modeling_module} was imported before provisioning: transformers chose its path then; "
            "kernels installed now take effect in a new process"
        )
    for name in sorted(arch.needs):
        spec = kernel_spec(name)
        st = KernelStatus(
            name,
            [u.via for u in arch.uses if u.kernel == name],
            "missing",
            fix=spec.fix,
            cost=spec.fallback_cost,
        )
        version = installed_version(spec.name)
        if version is not None:
            st.state, st.version, st.detail = "present", version, ""
        elif accel is None:
            st.state, st.detail = "no-accelerator", "not installed; only useful with a CUDA device"
        elif policy == "off":
            st.detail = "policy off: not checked further"
        else:
            st.state, st.version, st.detail = provision_kernel(spec, policy, installer)
        report.kernels[name] = st
    # Substitutes are decided once every kernel is known (FLA's Triton conv stands in for causal_conv1d).
    for st in report.kernels.values():
        sub = kernel_spec(st.name).substitute
        if not st.available and sub and report.kernels.get(sub) and report.kernels[sub].available:
            st.substitute = sub
            st.detail = "; ".join(x for x in (st.detail, f"hybridtune's ops use {sub} instead") if x)
    if any(st.state == "installed" for st in report.kernels.values()):
        gates_mod.clear_gate_caches()
        gates_mod.reset_lazy_kernels()

    if policy != "off" and arch.style == "gates":
        hooks = gates_mod.install_gate_hooks(_gate_provisioner(policy, installer, report), env=env)
        report.hooks = hooks.to_dict() if hooks is not None else {"disabled": gates_mod.disabled(env)}

    ready = [s for s in selftest_mod.suites() if s.package in report.kernels and report.kernels[s.package].available]
    if selftest and policy != "off" and accel is not None and ready:
        report.kernel_configs = _seed_kernel_configs(ready)
        report.selftest = _run_selftest(model_type_or_config, ready)
    if policy != "off" and accel is not None:
        report.backends = backend_lines(model_type_or_config, ready)

    if log:
        for line in report.summary().splitlines():
            if not line.startswith("  slow path: "):  # said once, as the warning below
                logger.info(line)
    if require and not report.fast_path:
        raise KernelUnavailableError(
            f"require_fast_path is set but {arch.model_type or 'this model'} would run a slow path: "
            f"{'; '.join(report.gaps)}. Fix: {' && '.join(report.fixes()) or 'see hybridtune doctor'}; "
            "or set require_fast_path: false."
        )
    if report.gaps and log and report.accelerator is None:  # no faster path on this machine: nothing to fix
        logger.info("no GPU: the mixers run hybridtune's pure-torch reference ops (fast kernels need a CUDA device)")
    elif report.gaps and log:
        logger.warning("slow path: %s (run `hybridtune doctor` for the fix)", "; ".join(report.gaps))
    return report


def _preset_or_self(obj: Any) -> Any:
    """A built-in preset name becomes its config (head dims for the self-test); anything else is unchanged."""
    if isinstance(obj, str) and obj in PRESETS:
        # The vocabulary changes no kernel decision; a fixed size keeps this off the tokenizer.
        return preset_config(obj, vocab_size=256 if PRESETS[obj].uses_bundled_tokenizer else None)
    return obj


def _gate_provisioner(policy: str, installer: Installer, report: ProvisionReport) -> Callable[[str, str], bool]:
    """`on_false` for the gate hooks: a gate said False at a modeling import; provision under the policy."""

    def on_false(kernel: str, gate: str) -> bool:
        if report.accelerator is None:
            return False  # the gates need CUDA: a kernel installed now would not change their answer
        st = report.kernels.get(kernel)
        if st is not None and st.state not in ("missing",):
            return False  # already decided by provision_kernels (installed, failed, or no wheel): do not retry
        state, _version, detail = provision_kernel(kernel_spec(kernel), policy, installer)
        logger.info("%s() said False: %s %s", gate, state, detail)
        return state in ("installed", "present")

    return on_false


def backend_options() -> list[BackendOption]:
    """The kernel backends a user may pin, one per suite that has a choice (`SelfTestSuite.option`)."""
    return [s.option for s in selftest_mod.suites() if s.option is not None]


def pin_backends(backends: Mapping[str, str | None], env: Mapping[str, str]) -> None:
    """Pin each suite's backend: its option's environment variable, else `backends[option.key]` (the config's), else
    its default. Before anything imports the kernels: their switches may be environment variables."""
    for suite in selftest_mod.suites():
        option = suite.option
        if option is not None:
            from_env = env.get(option.env)
            suite.pin(from_env or backends.get(option.key), option.env if from_env else option.key)


def _seed_kernel_configs(ready: list[SelfTestSuite]) -> str:
    """Each ready suite's shipped autotuning choices for this GPU kind, before the self-test's first kernel call
    (`seed_tuning`: a failure there only leaves the kernels to autotune as usual); the lines said, joined."""
    import torch  # torch-bound; this module stays light for `doctor --help`

    device = torch.cuda.get_device_name(torch.cuda.current_device())
    return "; ".join(line for suite in ready for line in [suite.seed_tuning(device)] if line)


def backend_lines(model_type_or_config: Any, among: list[SelfTestSuite]) -> list[str]:
    """Each suite's kernel backends for the config's layouts (`SelfTestSuite.backend_lines`)."""
    out: list[str] = []
    for suite in among:
        try:
            lays = (
                [] if model_type_or_config is None else selftest_mod.layouts_from_config(model_type_or_config, [suite])
            )
            out += suite.backend_lines(lays)
        except Exception as e:  # a report line must not take provisioning down
            out.append(f"{suite.package} backends: not resolved ({type(e).__name__}: {e})")
    return out


def _run_selftest(model_type_or_config: Any, ready: list[SelfTestSuite]) -> list[dict[str, Any]]:
    layouts = selftest_mod.layouts_from_config(model_type_or_config, ready)
    if not layouts:
        return []
    try:
        verdicts = selftest_mod.verify(layouts)
    except Exception as e:  # the self-test must never take training down with it; it refuses instead
        logger.exception("kernel self-test crashed")
        return [{"kernel": s.kernels[0], "layout": "all", "passed": False, "verdict": f"crashed: {e}"} for s in ready]
    return [v.to_dict() for v in verdicts]


def provision_for(cfg, model_type_or_config, **kwargs):
    """`provision_kernels` for a run: its config's `kernels`, `require_fast_path` and kernel backend keys (each
    suite's `BackendOption.key`)."""
    backends = {o.key: getattr(cfg, o.key, None) for o in backend_options()}
    return provision_kernels(cfg.kernels, cfg.require_fast_path, model_type_or_config, backends=backends, **kwargs)
