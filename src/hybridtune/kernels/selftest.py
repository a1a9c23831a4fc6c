"""Device self-test: run each mixer's fast kernels forward and backward against its fp32 reference on the device.

Before the first training step on a GPU, every registered mixer's self-test suite (`MixerSpec.selftest`, in the
mixer's folder) runs its checks for the layouts of the model's config (the mixer's head layout), each by FLA's
relative RMS ||ref - out|| / ||ref|| of the output and every gradient against TOLERANCE. A guarded kernel's
trial holds its suite's grant for its layout; a pass keeps the grant, a failure revokes it and names the fix.
Verdicts are cached per device, capability, torch and the suite's versions, kernel and layout in
`$HYBRIDTUNE_CACHE_DIR` (default `$XDG_CACHE_HOME/hybridtune`, else `~/.cache/hybridtune`).

`python -m hybridtune.kernels.selftest --preset qwen3_5-9b [--layout H,HV,K,V] [--no-cache] [--json FILE]`
prints the verdict table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridtune.files import atomic_write_text
from hybridtune.kernels.environment import cache_dir, dist_version, environment
from hybridtune.kernels.needs import read_config
from hybridtune.mixers import registry
from hybridtune.mixers.registry import SelfTestSuite
from hybridtune.models.presets import preset_config

logger = logging.getLogger(__name__)

SELFTEST_VERSION = 1
TOLERANCE = 0.02  # relative RMS vs fp32; what the bf16 kernels reach is recorded in docs/FINDINGS.md


def suites() -> list[SelfTestSuite]:
    """The registered mixers' self-test suites."""
    return registry.selftests()


def suite_of(layout: Any) -> SelfTestSuite:
    """The suite whose layouts `layout` is one of."""
    for suite in suites():
        if isinstance(layout, suite.layout_type):
            return suite
    raise ValueError(f"no registered mixer's self-test has layouts of type {type(layout).__name__}")


@dataclass
class Verdict:
    kernel: str  # one of its suite's kernels (forward + backward)
    layout: Any  # one of its suite's layouts
    passed: bool | None  # None: not run (reason says why)
    errors: dict[str, float] = field(default_factory=dict)
    tolerance: float = TOLERANCE
    backend: str = ""
    device: str = ""
    fingerprint: str = ""
    cached: bool = False
    granted: bool = False
    guard_active: bool = False
    seconds: float = 0.0
    reason: str = ""
    fallback: str = ""  # what runs instead when this backend fails, for a suite with several (its `variant_fix`)

    @property
    def verdict(self) -> str:
        if self.passed is None:
            return f"not run: {self.reason}"
        worst = max(self.errors.values(), default=0.0)
        word = "pass" if self.passed else "FAIL"
        return f"{word} (max rel err {worst:.4f} <= {self.tolerance})" if self.passed else f"{word}: {self.reason}"

    @property
    def fix(self) -> str | None:
        if self.passed is not False:
            return None
        if self.fallback:
            return self.fallback
        if self.guard_active:
            return suite_of(self.layout).guard_fix
        return "report the failing layout; the torch reference path stays in use"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kernel": self.kernel,
            "layout": str(self.layout),
            "key": list(self.layout.key),
            "passed": self.passed,
            "verdict": self.verdict,
            "package": suite_of(self.layout).package,
            "errors": {k: round(v, 6) for k, v in self.errors.items()},
            "tolerance": self.tolerance,
            "backend": self.backend,
            "device": self.device,
            "cached": self.cached,
            "granted": self.granted,
            "guard_active": self.guard_active,
            "seconds": round(self.seconds, 3),
            "reason": self.reason,
            "fix": self.fix,
        }


# ----------------------------------------------------------------------------------------------------------
# Layouts from a config


def layouts_from_config(obj: Any, among: list[SelfTestSuite] | None = None) -> list[Any]:
    """The self-test layouts of a config (or a checkpoint directory), over the suites `among` (default: all);
    empty when none of its mixers has one."""
    if isinstance(obj, (str, os.PathLike)):
        if not os.path.exists(obj):
            return []  # a bare model_type has no head dims
        obj = read_config(Path(obj))
    if hasattr(obj, "config") and not hasattr(obj, "model_type"):
        obj = obj.config
    return [lay for suite in (suites() if among is None else among) for lay in suite.layouts(obj)]


# ----------------------------------------------------------------------------------------------------------
# Cache


def _cache_path() -> Path:
    return cache_dir() / f"selftest-v{SELFTEST_VERSION}.json"


def _load_cache() -> dict[str, Any]:
    try:
        data = json.loads(_cache_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _store(fingerprint: str, verdict: Verdict) -> None:
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load_cache()
        data[fingerprint] = {"passed": verdict.passed, "errors": verdict.errors, "reason": verdict.reason}
        atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True))
    except OSError as e:
        logger.warning("could not write the self-test cache %s: %s", path, e)


def fingerprint(kernel: str, layout: Any, device_index: int = 0, variant: str | None = None) -> str:
    import torch  # why here: `python -m hybridtune.kernels.selftest --help` and doctor load no torch for this

    suite = suite_of(layout)
    name = torch.cuda.get_device_name(device_index)
    cap = ".".join(map(str, torch.cuda.get_device_capability(device_index)))
    versions = "|".join(
        [f"torch {torch.__version__}", *(f"{k} {dist_version(d) or 'none'}" for k, d in suite.versions)]
    )
    # What else picks the kernels (a shipped autotuning table's digest, another backend's version): the suite's.
    shape, configs = suite.shape(kernel, layout), suite.configs_key(variant, name)
    return f"v{SELFTEST_VERSION}|{name}|sm{cap}|{versions}|{kernel}|{shape}|bf16|{configs}"


# ----------------------------------------------------------------------------------------------------------
# Running the suites


def verify(layouts: Iterable[Any], *, use_cache: bool = True, device_index: int | None = None) -> list[Verdict]:
    """Self-test every kernel of each layout's suite on CUDA device `device_index` (default: the current device, so
    each rank of a multi-GPU run tests its own GPU). A guarded kernel's layout that passes is granted by its suite;
    one that fails is revoked. Never raises for a kernel failure: the verdict carries it."""
    out: list[Verdict] = []
    layouts = set(layouts)
    for suite in suites():
        mine = sorted(lay for lay in layouts if isinstance(lay, suite.layout_type))
        if mine:
            out += _verify_suite(suite, mine, use_cache, device_index)
    return out


def _verify_suite(suite: SelfTestSuite, layouts: list, use_cache: bool, device_index: int | None) -> list[Verdict]:
    first = suite.kernels[0]
    try:
        import torch  # why here: see fingerprint; without torch nothing runs
    except ImportError:
        return [Verdict(first, lay, None, reason="torch is not importable") for lay in layouts]
    if not torch.cuda.is_available():
        return [Verdict(first, lay, None, reason="no CUDA device") for lay in layouts]
    if device_index is None:
        device_index = torch.cuda.current_device()
    device = torch.device("cuda", device_index)
    try:
        backend, why = suite.backend(device)
    except ImportError as e:
        return [Verdict(first, lay, None, reason=f"hybridtune's ops unavailable ({e})") for lay in layouts]
    dev_name = torch.cuda.get_device_name(device_index)
    guard = suite.guard_active()
    cache = _load_cache() if use_cache else {}
    out: list[Verdict] = []
    for kernel in suite.kernels:
        guarded = suite.guarded(kernel)
        for lay in layouts:
            if backend != suite.package:
                v = Verdict(kernel, lay, None, backend=backend, device=dev_name, guard_active=guard and guarded)
                v.reason = f"the ops run the torch reference here ({why}); nothing fast to verify"
                out.append(v)
                continue
            # A suite may test a kernel on several backends (the one its package would use, then its fallback)
            for variant, label in suite.variants(kernel, lay, device):
                out.append(_verify_one(suite, kernel, lay, variant, label, device, device_index, cache, guard))
    return out


def _verify_one(suite, kernel, lay, variant, label, device, device_index, cache, guard) -> Verdict:
    """One kernel of one layout on one backend (`variant`, None: the suite's only one): cached or run; a guarded
    kernel's grant kept on a pass and revoked on a failure, for that backend only."""
    import torch  # why here: see fingerprint

    guarded = suite.guarded(kernel)
    dev_name = torch.cuda.get_device_name(device_index)
    fallback = suite.variant_fix(variant)  # a non-default backend: what runs instead
    v = Verdict(kernel, lay, None, backend=label, device=dev_name, guard_active=guard and guarded and not fallback)
    v.fallback = fallback
    v.fingerprint = fingerprint(kernel, lay, device_index, variant)
    hit = cache.get(v.fingerprint)
    if hit is not None:
        v.passed, v.errors, v.reason, v.cached = (
            hit.get("passed"),
            hit.get("errors", {}),
            hit.get("reason", ""),
            True,
        )
    else:
        if guarded:  # the trial itself needs the guard lifted for this layout
            suite.grant(lay, f"kernels.selftest: trial on {dev_name}", variant)
        _run(suite, v, device, variant)
        if v.errors or v.passed is not None:
            _store(v.fingerprint, v)
    if guarded:
        if v.passed:
            worst = max(v.errors.values(), default=0.0)
            suite.grant(lay, f"kernels.selftest: max rel err {worst:.4f} on {dev_name}", variant)
            v.granted = True
        else:
            suite.revoke(lay, variant)
    if v.passed is False:
        logger.error(
            "kernel self-test FAILED: %s %s (%s) on %s: %s. Fix: %s", kernel, lay, label, dev_name, v.reason, v.fix
        )
    return v


def _run(suite: SelfTestSuite, v: Verdict, device, variant: str | None = None) -> None:
    """One check (on backend `variant` when the suite has several), timed, its errors and pass or fail into `v`."""
    t0 = time.perf_counter()
    try:
        v.errors = suite.check(v.kernel, v.layout, device, variant)
        bad = {n: e for n, e in v.errors.items() if not e <= TOLERANCE}
        v.passed = not bad
        v.reason = "" if v.passed else "rel err over tolerance: " + ", ".join(f"{n} {e:.4g}" for n, e in bad.items())
    except Exception as e:  # a kernel that raises is a failed kernel, not a crashed run
        v.passed, v.reason = False, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    v.seconds = time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------------------
# Command line (used by benchmarks/kernels.sh)


def _parse_layout(text: str) -> Any:
    """A layout of the first suite that reads `text` as one of its own."""
    errors = []
    for suite in suites():
        try:
            return suite.parse_layout(text)
        except ValueError as e:
            errors.append(str(e))
    raise argparse.ArgumentTypeError("; ".join(errors) or f"no mixer's self-test reads layout '{text}'")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridtune.kernels.selftest", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", action="append", default=[], help="preset name whose head layout to test")
    ap.add_argument("--layout", action="append", default=[], type=_parse_layout, help="a layout, e.g. H,HV,K,V[,W]")
    ap.add_argument("--no-cache", action="store_true", help="run even when a cached verdict exists")
    ap.add_argument("--json", metavar="FILE", help="write the verdicts (with versions and device) as JSON")
    args = ap.parse_args(argv)
    by_layout: dict[Any, list[str]] = {}
    for name in args.preset:
        for lay in layouts_from_config(preset_config(name, vocab_size=256)):
            by_layout.setdefault(lay, []).append(name)
    for lay in args.layout:
        by_layout.setdefault(lay, []).append("--layout")
    if not by_layout:
        ap.error("give at least one --preset or --layout")
    verdicts = verify(by_layout, use_cache=not args.no_cache)
    print(f"{'kernel':<14} {'layout':<26} {'presets':<34} {'verdict':<44} {'s':>7}")
    for v in verdicts:
        presets = ",".join(by_layout.get(v.layout, []))
        print(f"{v.kernel:<14} {str(v.layout):<26} {presets:<34} {v.verdict[:44]:<44} {v.seconds:7.2f}")
    if args.json:
        rows = [{**v.to_dict(), "presets": by_layout.get(v.layout, [])} for v in verdicts]
        Path(args.json).write_text(json.dumps({"environment": environment(), "verdicts": rows}, indent=1) + "\n")
    return 0 if all(v.passed is not False for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
