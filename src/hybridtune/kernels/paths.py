"""Which path each mixer of a built model takes: hybridtune op, the kernel package, or the torch reference.

A mixer is a module whose class its modeling module wires to a kernel (see `needs.analyze`: the class
references a symbol bound under a gate, a `use_kernel_func_from_hub_with_fallback` function, or calls
`lazy_load_kernel`). For each kernel symbol the report reads what transformers actually bound: the instance
attribute (5.13-5.15 set `self.chunk_gated_delta_rule = chunk_gated_delta_rule or torch_...`), else the module
global; a 5.16+ fallback wrapper is opened to the implementation it closed over at decoration time.
"""

from __future__ import annotations

import inspect
import sys
import types
from dataclasses import dataclass, field
from typing import Any

from hybridtune.kernels.needs import HUB_KERNEL_NAMES, analyze, kernel_spec
from hybridtune.mixers import MIXERS, registry


@dataclass
class MixerPath:
    name: str  # qualified module name inside the model
    cls: str
    kernels: tuple[str, ...]  # what its class asks for
    path: str  # one line: where its work runs
    fast: bool
    symbols: dict[str, str] = field(default_factory=dict)  # kernel symbol -> package it resolves to, or "torch"
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(self).items()}


@dataclass
class PathReport:
    model_type: str | None
    modeling_module: str | None
    needs: list[str]
    mixers: list[MixerPath]

    @property
    def fast(self) -> bool:
        return all(m.fast for m in self.mixers)

    def grouped(self) -> list[dict[str, Any]]:
        """Mixers with the same class and path, collapsed to one row with a count."""
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        for m in self.mixers:
            row = rows.setdefault(
                (m.cls, m.path), {"cls": m.cls, "path": m.path, "fast": m.fast, "count": 0, "first": m.name}
            )
            row["count"] += 1
        return list(rows.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_type": self.model_type,
            "modeling_module": self.modeling_module,
            "needs": self.needs,
            "fast": self.fast,
            "mixers": self.grouped(),
        }

    def summary(self) -> str:
        lines = [f"{self.model_type}: {len(self.mixers)} kernel-backed mixers"]
        lines += [f"  {r['count']} x {r['cls']}: {r['path']}" for r in self.grouped()]
        return "\n".join(lines)


def _closure(fn: Any) -> dict[str, Any]:
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    out = {}
    for name, cell in zip(code.co_freevars, cells):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # empty cell
            continue
    return out


def _implementation(obj: Any, depth: int = 0) -> Any:
    """The callable behind transformers' fallback wrappers (5.16+ close over `implementation`)."""
    if depth > 4:
        return obj
    cl = _closure(obj)
    if "implementation" in cl:
        return cl["implementation"]
    for key in ("wrapped", "func", "fn"):
        if callable(cl.get(key)):
            return _implementation(cl[key], depth + 1)
    return obj


def classify(obj: Any) -> str:
    """'torch' for transformers' own torch path or None, else the top-level package of the kernel."""
    if obj is None:
        return "torch"
    if isinstance(obj, types.ModuleType):
        return obj.__name__.split(".")[0]
    impl = _implementation(obj)
    mod = getattr(impl, "__module__", None) or getattr(inspect.getmodule(impl), "__name__", "") or ""
    top = mod.split(".")[0]
    return "torch" if top in ("transformers", "torch", "") else top


def _hybridtune_owned(module: Any) -> bool:
    fwd = module.__dict__.get("forward", None) or type(module).forward
    mod = getattr(fwd, "__module__", "") or ""
    return mod.startswith("hybridtune.") or type(module).__module__.startswith("hybridtune.")


def _hybridtune_plan(module: Any) -> str | None:
    """What `patch_model` would route this mixer through (a registered family matches it by structure), if anything."""
    try:
        # why here: a family's routing imports its ops, which register on import; a torch that cannot is reported
        route = registry.route_for(module)
    except ImportError:
        return None
    if route is None:
        return None
    _, family = route
    return None if family.unsupported(module) else family.name


def _op_backend(module: Any) -> tuple[str, bool]:
    """(description, fast) of the routed mixer's op backend, from its registry entry."""
    spec = MIXERS.get(getattr(module, registry.MIXER_ATTR, ""))
    if spec is None or spec.path is None:
        return "hybridtune op", True
    try:
        return spec.path(module)
    except ImportError as e:  # importing the ops registers them; a torch that cannot is reported, not raised
        return f"hybridtune ops unavailable ({e})", False


def report(model: Any) -> PathReport:
    """Per-mixer path of a built transformers model (patched by hybridtune or not)."""
    config = getattr(model, "config", None)
    arch = analyze(config if config is not None else model)
    modeling = sys.modules.get(arch.modeling_module or "")
    mixers: list[MixerPath] = []
    for qual, module in model.named_modules():
        cls = type(module).__name__
        owned = _hybridtune_owned(module)
        kernels = arch.mixer_classes.get(cls)
        if kernels is None:
            # A hybridtune-patched class, or a subclass of a mixer (remote code): match by the class hierarchy.
            kernels = next(
                (arch.mixer_classes[b.__name__] for b in type(module).__mro__[1:] if b.__name__ in arch.mixer_classes),
                None,
            )
        kind = module.__dict__.get(registry.MIXER_ATTR)
        if kernels is None and kind is None:
            continue
        if owned or kind is not None:
            backend, fast = _op_backend(module)
            note = f"mixer {kind}" if kind else ""
            mixers.append(MixerPath(qual, cls, kernels or (), f"hybridtune op -> {backend}", fast, note=note))
            continue
        mod_globals = vars(sys.modules.get(type(module).__module__, modeling) or modeling or types.ModuleType("x"))
        symbols: dict[str, str] = {}
        fast_kernels = []
        for kernel in kernels:
            resolved = []
            for sym in sorted(arch.symbols(kernel)):
                if sym in module.__dict__:
                    value = module.__dict__[sym]
                elif sym in mod_globals:
                    value = mod_globals[sym]
                else:
                    continue
                if isinstance(value, bool) or (isinstance(value, tuple) and not callable(value)):
                    continue  # derived flags (is_fast_path_available), not kernels
                symbols[sym] = classify(value)
                resolved.append(symbols[sym])
            if not resolved:  # lazy_load_kernel style: look at transformers' loaded-kernel cache
                hub = sys.modules.get("transformers.integrations.hub_kernels")
                loaded = getattr(hub, "_KERNEL_MODULE_MAPPING", {}) or {}
                for hub_name, value in loaded.items():
                    if HUB_KERNEL_NAMES.get(hub_name, hub_name.replace("-", "_")) == kernel:
                        symbols[f"lazy_load_kernel({hub_name!r})"] = classify(value)
                        resolved.append(classify(value))
            if resolved and all(r == kernel for r in resolved):
                fast_kernels.append(kernel)
        slow = [k for k in kernels if k not in fast_kernels]
        if not slow:
            path = "transformers -> " + " + ".join(kernels)
        elif not fast_kernels:
            path = "transformers -> torch reference (" + ", ".join(f"no {k}" for k in slow) + ")"
        else:
            path = "transformers -> " + " + ".join(fast_kernels) + ", torch for " + ", ".join(slow)
        plan = _hybridtune_plan(module)
        note = f"hybridtune routes it through its ops ({plan}) once patched" if plan else "not routed by hybridtune"
        costs = "; ".join(f"{k}: {kernel_spec(k).fallback_cost}" for k in slow)
        mixers.append(
            MixerPath(qual, cls, kernels, path, not slow, symbols, note + (f". Slow: {costs}" if costs else ""))
        )
    return PathReport(arch.model_type, arch.modeling_module, sorted(arch.needs), mixers)
