"""The plan per module class: compile (fullgraph where safe), eager, routed to hybridtune ops, or left.

Decided from the module's structure and identity, never from the model's name:

- routed: instances patched by hybridtune (`_hybridtune_original_forward` or `_hybridtune_routed` on the instance);
- left: no forward of its own, a decorated forward whose method is not certain, a torch.nn built-in, or anything
  `source.method_source` refuses;
- eager: a top-level `PreTrainedModel`, or a forward that calls something kept out of graphs, syncs with the host,
  loops a run-time number of times or iterates over its submodules (generated behind
  `torch.compiler.disable(recursive=False)`);
- compile: everything else; `fullgraph=True` only when nothing in the forward is in doubt and every child module it
  calls is a torch.nn built-in or itself planned fullgraph.

`overrides` (from the run config) map a class name to "compile", "fullgraph", "eager" or "off".
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

from hybridtune.compiler.introspect import is_decorated
from hybridtune.compiler.modules.analyze import Findings, scan_callable, scan_class
from hybridtune.compiler.modules.decoration import Decoration, NotGeneratable
from hybridtune.models.anatomy import PATCHED_FORWARD_ATTR

DECISIONS = ("compile", "eager", "routed", "left")
OVERRIDES = ("compile", "fullgraph", "eager", "off")
ROUTED_ATTR = "_hybridtune_routed"
# models/patching.py keeps the upstream forward of each mixer it routes under this instance key.
PATCHED_KEY = PATCHED_FORWARD_ATTR


def is_routed(module: Any) -> bool:
    """True when hybridtune routed this module instance to its own ops (`patch_model`)."""
    return bool(getattr(module, ROUTED_ATTR, False)) or PATCHED_KEY in getattr(module, "__dict__", {})


def has_foreign_forward(module: Any) -> bool:
    """True when something other than the module compiler replaced this instance's forward
    (accelerate's offload hooks, another library): installing over it would bypass that code."""
    fwd = getattr(module, "__dict__", {}).get("forward")
    return fwd is not None and not getattr(fwd, "_hybridtune_modules", False)


@dataclass
class ClassPlan:
    """What the compiler does with one module class, and why."""

    cls: type
    decision: str  # one of DECISIONS
    reason: str = ""
    fullgraph: bool = False
    decorated: bool = False  # forward sits behind at least one decorator
    instances: int = 0
    routed_instances: int = 0
    foreign_instances: int = 0  # instances whose forward something else replaced: not touched
    overridden: bool = False
    findings: Findings | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.cls.__qualname__

    def decoration(self, backend: str = "inductor", dynamic: bool | None = None, mode: str | None = None) -> Decoration:
        """The decoration the generated forward carries under this plan."""
        if self.decision == "compile":
            return Decoration("compile", self.fullgraph, backend, dynamic, mode, self.reason)
        if self.decision == "eager":
            return Decoration("eager", reason=self.reason)
        raise ValueError(f"{self.name} is planned '{self.decision}': nothing is generated for it")

    def label(self) -> str:
        if self.decision == "compile" and self.fullgraph:
            return "compile (fullgraph)"
        return self.decision

    def to_dict(self) -> dict[str, Any]:
        return {
            "class": self.name,
            "module": self.cls.__module__,
            "decision": self.decision,
            "fullgraph": self.fullgraph,
            "reason": self.reason,
            "decorated": self.decorated,
            "instances": self.instances,
            "routed_instances": self.routed_instances,
            "foreign_instances": self.foreign_instances,
            "overridden": self.overridden,
        }

    def __str__(self) -> str:
        count = f" x{self.instances}" if self.instances else ""
        reason = f"  ({self.reason})" if self.reason else ""
        return f"{self.name}{count}: {self.label()}{reason}"


def _is_pretrained_model(cls: type) -> bool:
    try:
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:  # transformers is a dependency; this only guards a partial install
        return False
    return issubclass(cls, PreTrainedModel)


def _is_adapter_layer(cls: type) -> bool:
    # peft's tuner layers (LoRA Linear, ...) wrap a base layer; peft writes their forward to be traced
    # by torch.compile, so a compiled parent traces into them rather than around them.
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # peft is a dependency; this only guards a partial install
        return False
    return issubclass(cls, BaseTunerLayer)


def _is_torch_builtin(cls: type) -> bool:
    return cls.__module__ == "torch" or cls.__module__.startswith("torch.")


def plan_class(cls: type) -> ClassPlan:
    """The plan for a class read on its own (no instances: fullgraph only for leaf forwards)."""
    decorated = "forward" in vars(cls) and is_decorated(cls)
    if _is_torch_builtin(cls):
        return ClassPlan(cls, "left", "torch.nn built-in module", decorated=decorated)
    if _is_adapter_layer(cls):
        return ClassPlan(cls, "left", "peft adapter layer: traced as part of its compiled parent", decorated=decorated)
    try:
        findings = scan_class(cls)
    except NotGeneratable as e:
        return ClassPlan(cls, "left", str(e), decorated=decorated)
    if _is_pretrained_model(cls):
        return ClassPlan(
            cls,
            "eager",
            "top-level model: masks, cache and output capture break graphs; its layers are planned instead",
            decorated=decorated,
            findings=findings,
        )
    if findings.eager:
        return ClassPlan(cls, "eager", findings.eager[0], decorated=decorated, findings=findings)
    fullgraph = not findings.doubts and not findings.child_calls
    if findings.doubts:
        reason = f"not fullgraph: {findings.doubts[0]}"
    elif findings.child_calls:
        reason = "fullgraph: decided on a model, from its child modules"
    else:
        reason = ""
    return ClassPlan(cls, "compile", reason, fullgraph=fullgraph, decorated=decorated, findings=findings)


def _apply_override(plan: ClassPlan, value: str) -> ClassPlan:
    if value not in OVERRIDES:
        raise ValueError(f"compile override for {plan.name} is {value!r}; expected one of {', '.join(OVERRIDES)}")
    if plan.decision in ("left", "routed") and value != "off":
        return plan  # nothing can be generated for it; the override cannot change that
    plan.overridden = True
    if value == "off":
        plan.decision, plan.fullgraph, plan.reason = "left", False, "override: off"
    elif value == "eager":
        plan.decision, plan.fullgraph, plan.reason = "eager", False, "override: eager"
    else:
        plan.decision, plan.fullgraph, plan.reason = "compile", value == "fullgraph", f"override: {value}"
    return plan


def _override_for(cls: type, overrides: dict[str, str]) -> str | None:
    for key in (f"{cls.__module__}.{cls.__qualname__}", cls.__qualname__, cls.__name__):
        if key in overrides:
            return overrides[key]
    return None


def _wraps_a_model(module: Any) -> bool:
    return any(_is_pretrained_model(type(m)) for m in module.modules() if m is not module)


def plan_model(model: Any, overrides: dict[str, str] | None = None) -> list[ClassPlan]:
    """One plan per module class found in `model`, in order of first appearance.

    Refines `plan_class` with what only the instances tell: which instances hybridtune routed, and
    whether the child modules a forward calls allow fullgraph. Printable (`str(plan)`) and
    serialisable (`plan.to_dict()`); `hybridtune doctor` shows it.
    """
    import torch.nn as nn

    overrides = dict(overrides or {})
    plans: dict[type, ClassPlan] = {}
    instances: dict[type, list[nn.Module]] = {}
    for module in model.modules():
        cls = type(module)
        instances.setdefault(cls, []).append(module)
    for cls, mods in instances.items():
        if _is_torch_builtin(cls):
            continue
        plan = plan_class(cls)
        plan.instances = len(mods)
        plan.routed_instances = sum(1 for m in mods if is_routed(m))
        plan.foreign_instances = sum(1 for m in mods if not is_routed(m) and has_foreign_forward(m))
        if plan.decision == "compile" and any(_wraps_a_model(m) for m in mods):
            plan.decision, plan.fullgraph = "eager", False
            plan.reason = "wraps a whole model (e.g. peft's PeftModel): its layers are planned instead"
        if plan.routed_instances == plan.instances:
            plan.decision, plan.fullgraph = "routed", False
            plan.reason = "patched by hybridtune: runs hybridtune ops"
        plans[cls] = plan
    for cls, plan in plans.items():
        if plan.decision == "compile" and plan.findings is not None:
            _refine_with_instance_callables(plan, instances[cls])
    for cls, plan in plans.items():
        value = _override_for(cls, overrides)
        if value is not None:
            _apply_override(plan, value)
    memo: dict[type, bool] = {}
    for cls, plan in plans.items():
        if plan.decision == "compile" and plan.fullgraph is False and not plan.overridden:
            plan.fullgraph = _fullgraph_safe(cls, plans, instances, memo, set())
            if plan.reason.startswith("fullgraph: decided on a model"):
                plan.reason = "" if plan.fullgraph else "not fullgraph: a child module it calls is not fullgraph-safe"
    return list(plans.values())


def _refine_with_instance_callables(plan: ClassPlan, mods: list[Any]) -> None:
    """Judge `self.<attr>(...)` calls that are functions stored on the instances, not child modules.

    transformers 5.14 picks kernels in `__init__` (`self.chunk_gated_delta_rule = ...`): what runs is
    only known from the instance.
    """
    import torch.nn as nn

    assert plan.findings is not None
    for attr in sorted(plan.findings.child_calls):
        seen: set[int] = set()
        for inst in mods:
            if attr in inst._modules:
                continue
            value = getattr(inst, attr, None)
            if value is None or isinstance(value, nn.Module) or id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, types.MethodType) and value.__self__ is inst:
                continue  # a method of the class: already scanned with the forward
            found = scan_callable(value, f"self.{attr}")
            plan.findings.eager += [r for r in found.eager if r not in plan.findings.eager]
            plan.findings.doubts += [r for r in found.doubts if r not in plan.findings.doubts]
    if plan.findings.eager:
        plan.decision, plan.fullgraph, plan.reason = "eager", False, plan.findings.eager[0]


def _fullgraph_safe(
    cls: type,
    plans: dict[type, ClassPlan],
    instances: dict[type, list[Any]],
    memo: dict[type, bool],
    stack: set[type],
) -> bool:
    """True when cls's forward and every child module it calls can trace as one graph."""
    import torch.nn as nn

    if cls in memo:
        return memo[cls]
    if cls in stack:
        return False
    plan = plans.get(cls)
    if plan is None:
        ok = _is_torch_builtin(cls) and not issubclass(cls, nn.ModuleList | nn.ModuleDict)
        memo[cls] = ok
        return ok
    if plan.decision != "compile" or plan.findings is None or plan.findings.doubts:
        memo[cls] = plan.decision == "compile" and plan.fullgraph
        return memo[cls]
    stack.add(cls)
    ok = True
    for attr in sorted(plan.findings.child_calls):
        for inst in instances.get(cls, []):
            child = inst._modules.get(attr) if isinstance(inst, nn.Module) else None
            if child is None:
                value = getattr(inst, attr, None)
                # A plain function stored on the instance is unknown code; a bound method was scanned.
                ok = isinstance(value, types.MethodType) and value.__self__ is inst
            elif is_routed(child):
                ok = False  # hybridtune ops are traceable, but the plan does not vouch for the adapter code
            else:
                ok = _fullgraph_safe(type(child), plans, instances, memo, stack)
            if not ok:
                break
        if not ok:
            break
    stack.discard(cls)
    memo[cls] = ok
    return ok


def format_plan(plans: list[ClassPlan]) -> str:
    """A plain-text table of plans, one class per line."""
    if not plans:
        return "(no module classes)"
    width = max(len(p.name) for p in plans)
    lines = [f"{'class':<{width}}  {'n':>3}  {'plan':<19}  reason"]
    for p in plans:
        count = str(p.instances) if p.instances else "-"  # "-": planned from the class alone
        lines.append(f"{p.name:<{width}}  {count:>3}  {p.label():<19}  {p.reason}")
    return "\n".join(lines)
