"""Generate every nn.Module class of every modeling module of the installed transformers.

A check that the compiler is right on families nobody wrote an adapter for: each generated module
must compile, name nothing undefined, load, and match its originals (bytecode of the body, the
decorator wrappers layer by layer; see `loader.check_against_originals`). A class the compiler leaves alone (no
forward of its own, a method that cannot be identified with certainty, a name its module does not
define) is counted with its reason, not as a failure: leaving it alone is the correct answer.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import time
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hybridtune.compiler.introspect import belongs_to, is_decorated
from hybridtune.compiler.modules.decoration import Decoration, GenerationError
from hybridtune.compiler.modules.loader import GeneratedModule
from hybridtune.compiler.modules.plan import plan_class
from hybridtune.compiler.modules.standalone import generate_loaded

# The families the issue names; the sweep fails if any of them is missing from the installed
# transformers, so a silent rename upstream cannot shrink what is checked.
REQUIRED_FAMILIES = (
    "llama qwen2 qwen3 qwen3_moe mistral mixtral gemma gemma2 gemma3 phi3 qwen3_5 qwen3_5_moe qwen3_next "
    "olmo_hybrid kimi_linear bamba falcon_h1 falcon_mamba granitemoehybrid jamba lfm2 mamba mamba2 nemotron_h zamba2"
).split()


@dataclass
class ModuleResult:
    """The sweep's result for one modeling module."""

    family: str
    module: str
    classes: int = 0  # nn.Module classes defined in the module
    generated: int = 0
    decorated: list[str] = field(default_factory=list)  # classes whose forward sits behind a decorator
    bare_closure: list[str] = field(default_factory=list)  # ... behind one that hides the method's name
    bare_closure_generated: list[str] = field(default_factory=list)  # ... and generated all the same
    left: dict[str, str] = field(default_factory=dict)  # class -> reason it is left alone
    unbound: dict[str, list[str]] = field(default_factory=dict)  # class -> names its module lacks too
    failures: dict[str, str] = field(default_factory=dict)  # class (or "<module>") -> reason
    import_error: str = ""
    generated_module: GeneratedModule | None = field(default=None, repr=False)


def family_modules(family: str) -> list[str]:
    """Import names of the `modeling_*.py` files of one transformers family."""
    import transformers.models as models

    path = os.path.join(models.__path__[0], family)
    if not os.path.isdir(path):
        return []
    return [
        f"transformers.models.{family}.{f[:-3]}"
        for f in sorted(os.listdir(path))
        if f.startswith("modeling_") and f.endswith(".py")
    ]


def all_families() -> list[str]:
    import transformers.models as models

    return sorted(m.name for m in pkgutil.iter_modules(models.__path__) if m.ispkg)


def module_classes(mod: types.ModuleType) -> list[type]:
    """nn.Module classes defined in `mod` itself (not imported into it), in definition order."""
    import torch.nn as nn

    return [
        obj
        for obj in vars(mod).values()
        if isinstance(obj, type) and issubclass(obj, nn.Module) and obj.__module__ == mod.__name__
    ]


def sweep_module(family: str, modname: str, backend: str = "eager") -> ModuleResult:
    """Plan, generate, load and verify every nn.Module class of one modeling module."""
    res = ModuleResult(family, modname)
    try:
        mod = importlib.import_module(modname)
    except Exception as e:  # an optional dependency of that family is missing: not ours to judge
        res.import_error = f"{type(e).__name__}: {e}".splitlines()[0][:160]
        return res
    classes = module_classes(mod)
    res.classes = len(classes)
    decorations: dict[type, Decoration] = {}
    for cls in classes:
        if "forward" in vars(cls) and is_decorated(cls):
            res.decorated.append(cls.__qualname__)
            attr = vars(cls)["forward"]
            if isinstance(attr, types.FunctionType) and not belongs_to(attr, cls):
                res.bare_closure.append(cls.__qualname__)
        try:
            plan = plan_class(cls)
        except Exception as e:  # a bug in the analysis: report it, keep sweeping
            res.failures[cls.__qualname__] = f"plan: {type(e).__name__}: {e}"
            continue
        if plan.decision == "left":
            res.left[cls.__qualname__] = plan.reason
            continue
        decorations[cls] = plan.decoration(backend)
    if not decorations:
        return res
    try:
        gm = generate_loaded(mod, decorations)
    except Exception as e:
        # Attribute the failure: generate each class on its own.
        for cls, deco in decorations.items():
            try:
                generate_loaded(mod, {cls: deco})
            except Exception as e1:
                res.failures[cls.__qualname__] = f"{type(e1).__name__}: {e1}".splitlines()[0][:300]
        if not res.failures:
            res.failures["<module>"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        return res
    res.left.update(gm.skipped)
    res.generated = len(gm.sections)
    res.bare_closure_generated = [c for c in res.bare_closure if c in gm.sections]
    res.unbound = {q: sec.unbound for q, sec in gm.sections.items() if sec.unbound}
    res.generated_module = gm
    return res


@dataclass
class SweepReport:
    results: list[ModuleResult]
    seconds: float
    transformers_version: str
    missing_required: list[str]

    def totals(self) -> dict[str, Any]:
        ok = [r for r in self.results if not r.import_error]
        return {
            "transformers": self.transformers_version,
            "families": len({r.family for r in ok}),
            "modules": len(ok),
            "modules_not_importable": len(self.results) - len(ok),
            "classes": sum(r.classes for r in ok),
            "generated": sum(r.generated for r in ok),
            "left_alone": sum(len(r.left) for r in ok),
            "generated_with_names_unbound_in_source_too": sum(len(r.unbound) for r in ok),
            "decorated_forwards": sum(len(r.decorated) for r in ok),
            "bare_closure_forwards": sum(len(r.bare_closure) for r in ok),
            "bare_closure_generated": sum(len(r.bare_closure_generated) for r in ok),
            "failures": sum(len(r.failures) for r in ok),
            "required_families_absent": self.missing_required,
            "seconds": round(self.seconds, 1),
        }

    def failures(self) -> list[tuple[str, str, str]]:
        out = []
        for r in self.results:
            out += [(r.module, cls, why) for cls, why in r.failures.items()]
        return out

    def left_reasons(self) -> Counter:
        c: Counter = Counter()
        for r in self.results:
            for why in r.left.values():
                c[_reason_kind(why)] += 1
        return c

    def to_dict(self) -> dict[str, Any]:
        return {
            "totals": self.totals(),
            "failures": [{"module": m, "class": c, "reason": w} for m, c, w in self.failures()],
            "not_importable": {r.module: r.import_error for r in self.results if r.import_error},
            "bare_closure_forwards": sorted(f"{r.module}.{c}" for r in self.results for c in r.bare_closure),
            "left_alone_reasons": dict(self.left_reasons().most_common()),
        }


def _reason_kind(reason: str) -> str:
    # Group reasons for the summary: drop the names that differ from class to class.
    for marker in (" is inherited", "is behind a decorator", "which ", " is a ", "uses super()", "class-private"):
        if marker in reason:
            return {
                " is inherited": "forward inherited, not defined in the class",
                "is behind a decorator": "decorated forward: method not identifiable with certainty",
                "which ": "reads a name its module does not define (optional dependency missing)",
                " is a ": "forward is not a plain function",
                "uses super()": "super() in a class that is not a top-level name",
                "class-private": "uses class-private (mangled) names",
            }[marker]
    return reason[:80]


def _sweep_families(families: list[str], backend: str) -> list[ModuleResult]:
    out = []
    for family in families:
        for modname in family_modules(family):
            res = sweep_module(family, modname, backend)
            res.generated_module = None  # results cross a process boundary; the module stays here
            out.append(res)
    return out


def run_sweep(families: list[str] | None = None, backend: str = "eager", jobs: int = 1) -> SweepReport:
    """Sweep the given families (default: every family of the installed transformers).

    `jobs` > 1 splits the families over forked worker processes (each imports its own share of
    the ~500 modeling modules, which is most of the time). `backend` only changes the literal in
    the generated `torch.compile(...)` decoration; nothing is compiled by torch here.
    """
    import transformers

    start = time.perf_counter()
    available = all_families()
    names = available if families is None else families
    missing = [f for f in REQUIRED_FAMILIES if f not in available] if families is None else []
    if jobs <= 1 or len(names) < 2:
        results = _sweep_families(names, backend)
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        import torch  # noqa: F401  (imported once before forking, shared by the workers)

        shares = [names[i::jobs] for i in range(jobs)]
        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("fork")) as pool:
            parts = list(pool.map(_sweep_families, shares, [backend] * jobs))
        order = {f: i for i, f in enumerate(names)}
        results = sorted((r for part in parts for r in part), key=lambda r: (order[r.family], r.module))
    return SweepReport(results, time.perf_counter() - start, transformers.__version__, missing)


def format_report(report: SweepReport, verbose: bool = False) -> str:
    t = report.totals()
    rows = [
        ("transformers", t["transformers"]),
        ("families", t["families"]),
        ("modeling modules", t["modules"]),
        ("modules not importable", t["modules_not_importable"]),
        ("nn.Module classes", t["classes"]),
        ("generated", t["generated"]),
        ("left alone (with reason)", t["left_alone"]),
        ("names unbound in source too", t["generated_with_names_unbound_in_source_too"]),
        ("decorated forwards found", t["decorated_forwards"]),
        ("  behind a bare closure", t["bare_closure_forwards"]),
        ("  ... of which generated", t["bare_closure_generated"]),
        ("failures", t["failures"]),
        ("seconds", t["seconds"]),
    ]
    if report.missing_required:
        rows.insert(1, ("required families absent", ", ".join(report.missing_required)))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    fails = report.failures()
    if fails:
        lines.append("")
        lines.append("failures:")
        lines += [f"  {m} {c}: {w}" for m, c, w in fails]
    if verbose:
        lines.append("")
        lines.append("left alone, by reason:")
        lines += [f"  {n:>5}  {why}" for why, n in report.left_reasons().most_common()]
        lines.append("generated, reading names their own module does not define either (optional kernels):")
        lines += [f"  {r.module}.{c}: {', '.join(n)}" for r in report.results for c, n in r.unbound.items()]
        lines.append("forwards behind a bare closure:")
        lines += [f"  {r.module}.{c}" for r in report.results for c in r.bare_closure]
        lines.append("modules not importable:")
        lines += [f"  {r.module}: {r.import_error}" for r in report.results if r.import_error]
    return "\n".join(lines)


__all__ = ["GenerationError", "REQUIRED_FAMILIES", "SweepReport", "format_report", "run_sweep", "sweep_module"]
