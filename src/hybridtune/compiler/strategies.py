"""`compile_model(model, strategy)`: how a built model gets compiled.

- "loop": the whole decoder loop as one graph (`hybridtune.compiler.loop.compile_loop`, for the
  architectures whose mixers hybridtune routes to its own ops).
- "modules": per class, the generated standalone forwards (`standalone.py`) under the plan
  (`plan.py`), bound to this model's module instances only. The transformers classes are not
  modified, so another model of the same class in the process keeps its own forwards, and
  `handle.undo()` puts this one back.
- "off": nothing compiled; undoes an earlier "modules" compile of this model.
"""

from __future__ import annotations

import logging
import sys
import types
from dataclasses import dataclass, field
from typing import Any

from hybridtune.compiler.loop import compile_loop
from hybridtune.compiler.modules.decoration import Decoration
from hybridtune.compiler.modules.loader import GeneratedModule
from hybridtune.compiler.modules.plan import ClassPlan, has_foreign_forward, is_routed, plan_model
from hybridtune.compiler.modules.standalone import generate_loaded
from hybridtune.errors import UserError

logger = logging.getLogger(__name__)

STRATEGIES = ("loop", "modules", "off")
HANDLE_ATTR = "_hybridtune_compiled"


class CompileStrategyError(UserError, ValueError):
    """An unknown strategy, or one this installation cannot run."""


@dataclass
class ModulesHandle:
    """What `compile_model(model, "modules")` installed, and how to take it back."""

    plans: list[ClassPlan]
    generated: dict[str, GeneratedModule] = field(default_factory=dict)  # source module -> generated
    installed: list[tuple[Any, Any, Any]] = field(default_factory=list)  # (module, our bound forward, previous)
    strategy: str = "modules"
    model: Any = field(default=None, repr=False)

    def undo(self) -> int:
        """Restore every forward this handle installed; returns how many were restored."""
        restored = 0
        for module, ours, previous in reversed(self.installed):
            current = module.__dict__.get("forward")
            if current is not ours:
                logger.warning(
                    "not restoring %s.forward: it was replaced after hybridtune installed its own",
                    type(module).__qualname__,
                )
                continue
            if previous is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = previous
            restored += 1
        self.installed.clear()
        if self.model is not None and self.model.__dict__.get(HANDLE_ATTR) is self:
            _forget(self.model)
        return restored

    def summary(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for p in self.plans:
            counts[p.label()] = counts.get(p.label(), 0) + 1
        counts["installed_forwards"] = len(self.installed)
        return counts


def compile_model(model: Any, strategy: str = "loop", **opts: Any) -> Any:
    """Compile `model` with `strategy` ("loop", "modules" or "off") and return a handle.

    "modules" options: `backend` ("inductor"), `dynamic` (None), `mode` (None), `overrides`
    (class name -> "compile" | "fullgraph" | "eager" | "off"), `compile` (False installs the
    generated forwards without torch.compile, for checking the generated code alone).
    """
    if strategy not in STRATEGIES:
        raise CompileStrategyError(f"unknown compile strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    previous = getattr(model, HANDLE_ATTR, None)
    if strategy == "off":
        if previous is not None:
            previous.undo()
            _forget(model)
        return None
    if previous is not None:
        raise CompileStrategyError(
            f"this model is already compiled with strategy {previous.strategy!r}; "
            "call compile_model(model, 'off') (or handle.undo()) first"
        )
    if strategy == "loop":
        return compile_loop(model, **opts)
    return _compile_modules(model, **opts)


def is_compiled(model: Any) -> bool:
    """Whether `compile_model` compiled `model` (the loop or per-class forwards): its compiled code is guarded on
    grad mode, so a forward without gradients compiles a graph of its own."""
    from hybridtune.compiler.loop import HANDLE_ATTR as LOOP_ATTR

    return getattr(model, HANDLE_ATTR, None) is not None or getattr(model, LOOP_ATTR, None) is not None


def _forget(model: Any) -> None:
    if HANDLE_ATTR in model.__dict__:
        del model.__dict__[HANDLE_ATTR]


def _compile_modules(
    model: Any,
    backend: str = "inductor",
    dynamic: bool | None = None,
    mode: str | None = None,
    overrides: dict[str, str] | None = None,
    compile: bool = True,
) -> ModulesHandle:
    plans = plan_model(model, overrides)
    by_class = {p.cls: p for p in plans}
    handle = ModulesHandle(plans, model=model)

    # An eager class needs its generated forward (with torch.compiler.disable) only where a compiled
    # ancestor would otherwise trace into it.
    wanted: dict[int, Any] = {}
    compiled_ancestor: set[int] = set()
    for name, module in model.named_modules():
        plan = by_class.get(type(module))
        parent = name.rpartition(".")[0] if name else None
        under_compiled = parent is not None and _parent_id(model, parent) in compiled_ancestor
        if plan is not None and plan.decision == "compile":
            compiled_ancestor.add(id(module))
        elif under_compiled:
            compiled_ancestor.add(id(module))
        if plan is None or is_routed(module):
            continue
        if has_foreign_forward(module):
            logger.info(
                "module compiler leaves %s alone: its forward was replaced by %r", name or "<root>", module.forward
            )
            continue
        if plan.decision == "compile" or (plan.decision == "eager" and under_compiled):
            wanted[id(module)] = module

    decorations: dict[str, dict[type, Decoration]] = {}
    for module in wanted.values():
        plan = by_class[type(module)]
        deco = plan.decoration(backend, dynamic, mode)
        if not compile and deco.kind == "compile":
            deco = Decoration("none", reason=deco.reason)
        decorations.setdefault(type(module).__module__, {})[type(module)] = deco
    for modname, decos in decorations.items():
        gm = generate_loaded(sys.modules[modname], decos)
        for qualname, reason in gm.skipped.items():
            logger.warning("module compiler leaves %s as transformers wrote it: %s", qualname, reason)
        handle.generated[modname] = gm

    for module in wanted.values():
        cls = type(module)
        gm = handle.generated[cls.__module__]
        if cls.__qualname__ not in gm.sections:
            continue
        func = gm.forward_for(cls)
        func._hybridtune_modules = True  # lets has_foreign_forward tell our forwards from others'
        ours = types.MethodType(func, module)
        handle.installed.append((module, ours, module.__dict__.get("forward")))
        module.__dict__["forward"] = ours
    model.__dict__[HANDLE_ATTR] = handle
    return handle


def _parent_id(model: Any, name: str) -> int:
    return id(model.get_submodule(name)) if name else id(model)
