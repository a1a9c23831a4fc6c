"""Which fast kernels an architecture needs, read from what its own modeling module asks for.

The signal is the one transformers itself uses to choose a fast path, never the model's name:

- gate-style releases (5.13 to 5.15): module-level `if is_flash_linear_attention_available(): from fla ...`
  blocks, `is_causal_conv1d_available()` / mamba gates, and `lazy_load_kernel("causal-conv1d")` calls;
- decorator-style releases (5.16+): `@use_kernel_func_from_hub_with_fallback("<kernel function>", "fla")`.

The modeling module is parsed (`ast`), not imported: importing it is what locks the choice in, so the answer
must come before it. Llama, Gemma and dense Qwen call none of these and need nothing. A checkpoint directory
is read through its config.json (`model_type`), so a renamed directory resolves exactly as the original.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hybridtune.errors import ModelError
from hybridtune.mixers import registry
from hybridtune.mixers.registry import KernelPackage
from hybridtune.models.trust import NO_CODE, refuse_custom_code

# Packages transformers' modeling code asks for that no registered mixer brings (the mixers' own, FLA among them,
# come from their specs: `registry.kernel_packages()`).
OTHER_KERNELS: dict[str, KernelPackage] = {
    "causal_conv1d": KernelPackage(
        name="causal_conv1d",
        distributions=(),  # source only on the registry (needs nvcc); FLA's Triton conv covers hybridtune's path
        check_code="import causal_conv1d",
        accelerates="depthwise causal conv of the mixer input (Dao's CUDA kernel)",
        fallback_cost=(
            "torch conv: a separate, slower kernel per layer (its share of the step is in docs/FINDINGS.md), and "
            "on the stock transformers path packed documents leak into each other (W-1 tokens with a W-tap conv)"
        ),
        fix="pip install causal-conv1d --no-build-isolation  (builds from source; or install FLA, whose Triton conv hybridtune uses)",
    ),
    "mamba_ssm": KernelPackage(
        name="mamba_ssm",
        distributions=(),  # source only on the registry
        check_code="import mamba_ssm",
        accelerates="selective scan / SSD chunk scan of Mamba-family mixers",
        fallback_cost="torch scan path: not measured by hybridtune; transformers calls its torch paths 'significantly slower'",
        fix="pip install mamba-ssm --no-build-isolation  (builds from source with nvcc)",
    ),
}


def kernels() -> dict[str, KernelPackage]:
    """Every known kernel package by name: the others, and the registered mixers' (theirs win). An other package
    that a mixer's package `covers` has it as its `substitute`."""
    mine = registry.kernel_packages()
    others = {}
    for name, package in OTHER_KERNELS.items():
        sub = next((m.name for m in mine.values() if name in m.covers), None)
        others[name] = package if sub is None else replace(package, substitute=sub)
    return {**others, **mine}


# transformers' availability gates of the packages no registered mixer brings (a mixer's: `KernelPackage.gates`).
OTHER_GATES: dict[str, str] = {
    "is_causal_conv1d_available": "causal_conv1d",
    "is_mamba_ssm_available": "mamba_ssm",
    "is_mamba_2_ssm_available": "mamba_ssm",
}
# transformers' availability gates (gate-style releases) and the kernel each one asks about: the registered mixers'
# packages' and the others'; filled from the registry, again whenever it changes (`registry.on_change`).
GATES: dict[str, str] = {}


def _fill_gates() -> None:
    mine = {gate: k.name for k in registry.kernel_packages().values() for gate in k.gates}
    GATES.clear()
    GATES.update({**mine, **{g: k for g, k in OTHER_GATES.items() if g not in mine}})


_fill_gates()

# Names transformers' hub-kernel loader uses for the same packages.
HUB_KERNEL_NAMES: dict[str, str] = {"causal-conv1d": "causal_conv1d", "mamba-ssm": "mamba_ssm"}


def _hub_kernel_package(name: str) -> str:
    """The package behind a `lazy_load_kernel` name: ours, else the repo transformers maps it to."""
    if name in HUB_KERNEL_NAMES:
        return HUB_KERNEL_NAMES[name]
    try:  # e.g. "falcon_mamba-ssm" -> kernels-community/mamba-ssm in 5.14
        from transformers.integrations.hub_kernels import _HUB_KERNEL_MAPPING

        repo = _HUB_KERNEL_MAPPING.get(name, {}).get("repo_id", "")
    except (ImportError, AttributeError):
        repo = ""
    base = repo.rsplit("/", 1)[-1] or name
    return HUB_KERNEL_NAMES.get(base, base.replace("-", "_"))


_FALLBACK_DECORATOR = "use_kernel_func_from_hub_with_fallback"
_LAZY_LOADER = "lazy_load_kernel"


def kernel_spec(name: str) -> KernelPackage:
    """The package of kernel `name`; an unknown one (a new architecture's) gets a generic entry."""
    known = kernels()
    if name in known:
        return known[name]
    dist = name.replace("_", "-")
    return KernelPackage(
        name=name,
        distributions=(),
        check_code=f"import {name}",
        accelerates=f"kernels the modeling module imports from `{name}`",
        fallback_cost="unknown: the modeling module's torch path",
        fix=f"pip install {dist}",
    )


@dataclass(frozen=True)
class KernelUse:
    """One place in a modeling module that asks for a kernel."""

    kernel: str
    via: str  # e.g. "is_flash_linear_attention_available()" or "use_kernel_func_from_hub_with_fallback('<f>', 'fla')"
    line: int
    symbols: tuple[str, ...] = ()  # module-level names bound to the kernel (or its torch fallback)


@dataclass
class ArchitectureNeeds:
    """What one architecture asks for. `needs` is the set `hybridtune.kernels.needs` returns."""

    model_type: str | None
    modeling_module: str | None
    style: str  # "gates" (5.13-5.15), "decorators" (5.16+), "none" (asks for nothing), "unknown"
    uses: list[KernelUse] = field(default_factory=list)
    mixer_classes: dict[str, tuple[str, ...]] = field(default_factory=dict)  # class name -> kernels it uses
    reason: str = ""

    @property
    def needs(self) -> set[str]:
        return {u.kernel for u in self.uses}

    def symbols(self, kernel: str) -> set[str]:
        return {s for u in self.uses if u.kernel == kernel for s in u.symbols}

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_type": self.model_type,
            "modeling_module": self.modeling_module,
            "style": self.style,
            "needs": sorted(self.needs),
            "uses": [{"kernel": u.kernel, "via": u.via, "line": u.line} for u in self.uses],
            "mixer_classes": {k: list(v) for k, v in sorted(self.mixer_classes.items())},
            "reason": self.reason,
        }


def needs(config_or_model_type: Any) -> set[str]:
    """The fast kernels an architecture asks for, e.g. `{"fla", "causal_conv1d"}`; empty for Llama-like models.

    Accepts a transformers config, a model (its `.config`), a `model_type` string, a config dict, or the path
    of a local checkpoint directory (or its config.json). Never downloads; never imports the modeling module.
    """
    return analyze(config_or_model_type).needs


def analyze(config_or_model_type: Any) -> ArchitectureNeeds:
    """Like `needs`, with where each need comes from and which classes use it."""
    model_type, module_name = resolve_modeling_module(config_or_model_type)
    if module_name is None:
        return ArchitectureNeeds(model_type, None, "unknown", reason="no modeling module found for this config")
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return ArchitectureNeeds(model_type, module_name, "unknown", reason=f"{module_name} has no source file")
    path = spec.origin
    uses, mixers = _analyze_source(path, os.path.getmtime(path))
    if not uses:
        style = "none"
    elif any(u.via.startswith(_FALLBACK_DECORATOR) for u in uses):
        style = "decorators"
    else:
        style = "gates"
    return ArchitectureNeeds(model_type, module_name, style, list(uses), dict(mixers), reason=f"parsed {path}")


# ----------------------------------------------------------------------------------------------------------
# Which modeling module


def read_config(path: Path) -> Any:
    """The transformers config of a checkpoint directory (or its config.json), read locally; ModelError if not."""
    cfg_file = path / "config.json" if path.is_dir() else path
    if not cfg_file.is_file():
        raise ModelError(
            f"'{path}' is not a checkpoint directory: no config.json there. Pass a directory with config.json or a preset name."
        )
    try:
        from transformers import AutoConfig
    except ImportError as e:
        raise ModelError(f"reading '{cfg_file}' needs transformers, which is not importable ({e}).") from e
    try:
        refuse_custom_code(cfg_file.parent)
        return AutoConfig.from_pretrained(str(cfg_file.parent), local_files_only=True, **NO_CODE)
    except (ValueError, KeyError, OSError) as e:
        raise ModelError(f"cannot read '{cfg_file}': {str(e).splitlines()[0]}") from e


def resolve_modeling_module(obj: Any) -> tuple[str | None, str | None]:
    """(model_type, dotted name of the modeling module) for a config, model, model_type, dict or local path."""
    if hasattr(obj, "config") and not isinstance(obj, (str, dict)) and hasattr(obj.config, "model_type"):
        obj = obj.config  # a model
    if isinstance(obj, os.PathLike) or (
        isinstance(obj, str) and (os.sep in obj or os.path.isdir(obj) or obj.endswith("config.json"))
    ):
        obj = read_config(Path(obj))
    if isinstance(obj, dict):
        if "model_type" not in obj:
            raise ModelError("config dict has no 'model_type'; pass a transformers config or a checkpoint directory.")
        obj = str(obj["model_type"])
    if isinstance(obj, str):
        return obj, _module_for_model_type(obj)
    model_type = getattr(obj, "model_type", None)
    cls_module = type(obj).__module__
    head, _, last = cls_module.rpartition(".")
    if last.startswith("configuration_"):
        # The config class lives next to its modeling module, in transformers and in remote code alike.
        return model_type, f"{head}.modeling_{last[len('configuration_') :]}"
    if model_type:
        return model_type, _module_for_model_type(model_type)
    return None, None


def _module_for_model_type(model_type: str) -> str:
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name
    except ImportError as e:
        raise ModelError(
            f"resolving model_type '{model_type}' needs transformers, which is not importable ({e})."
        ) from e
    if model_type not in CONFIG_MAPPING_NAMES:
        import transformers

        raise ModelError(
            f"model_type '{model_type}' is unknown to transformers {transformers.__version__}; "
            "upgrade transformers or pass a config/checkpoint of a supported architecture."
        )
    folder = model_type_to_module_name(model_type)
    return f"transformers.models.{folder}.modeling_{folder}"


# ----------------------------------------------------------------------------------------------------------
# Reading the modeling source


def _call_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _const_str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _gate_calls(node: ast.AST, aliases: dict[str, str]) -> list[tuple[str, str]]:
    """(gate name, kernel) of every gate called inside `node`."""
    found = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            name = _call_name(sub)
            gate = aliases.get(name or "")
            if gate:
                found.append((gate, GATES[gate]))
    return found


def _bound_names(stmts: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for stmt in stmts:
        for sub in ast.walk(stmt):
            if isinstance(sub, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in sub.names)
            elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                names.add(sub.id)
    return names


def _loaded_names(node: ast.AST) -> set[str]:
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
            names.add(sub.id)
        elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
            names.add(sub.attr)  # `self.<kernel function>` set from the module-level name of the same name
    return names


@functools.lru_cache(maxsize=256)
def _analyze_source(path: str, mtime: float) -> tuple[tuple[KernelUse, ...], tuple[tuple[str, tuple[str, ...]], ...]]:
    del mtime  # part of the cache key only: a changed file is parsed again
    tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)
    aliases = {g: g for g in GATES}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                if a.name in GATES:
                    aliases[a.asname or a.name] = a.name

    uses: list[KernelUse] = []
    kernel_symbols: dict[str, set[str]] = {}
    gate_if_lines: set[int] = set()
    # 1. module-level `if gate(): from pkg import f else: f = None` blocks bind kernel symbols.
    for node in tree.body:
        if isinstance(node, ast.If):
            for gate, kernel in _gate_calls(node.test, aliases):
                syms = _bound_names(node.body) | _bound_names(node.orelse)
                uses.append(KernelUse(kernel, f"{gate}()", node.lineno, tuple(sorted(syms))))
                kernel_symbols.setdefault(kernel, set()).update(syms)
                gate_if_lines.add(node.lineno)
    # 2. decorators naming a package (5.16+).
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and _call_name(dec) == _FALLBACK_DECORATOR:
                    func = _const_str(dec.args[0]) if dec.args else None
                    pkg = _const_str(dec.args[1]) if len(dec.args) > 1 else None
                    for kw in dec.keywords:
                        if kw.arg == "package":
                            pkg = _const_str(kw.value)
                        elif kw.arg == "func_name":
                            func = _const_str(kw.value)
                    if pkg:
                        kernel = HUB_KERNEL_NAMES.get(pkg, pkg.split(".")[0].replace("-", "_"))
                        via = f"{_FALLBACK_DECORATOR}({func!r}, {pkg!r})"
                        uses.append(KernelUse(kernel, via, node.lineno, (node.name,)))
                        kernel_symbols.setdefault(kernel, set()).add(node.name)
    # 3. gate and lazy-loader calls anywhere else (inside mixer __init__ in mamba-style modules).
    class_of_line: list[tuple[int, int, str]] = [
        (c.lineno, c.end_lineno or c.lineno, c.name) for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
    ]
    direct_class_kernels: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _call_name(node)
        kernel = None
        if name == _LAZY_LOADER:
            arg = _const_str(node.args[0]) if node.args else None
            if arg:
                kernel = _hub_kernel_package(arg)
                via = f"{_LAZY_LOADER}({arg!r})"
        elif name in aliases and not any(
            isinstance(n, ast.If) and n.lineno in gate_if_lines and n.test is not None and node in ast.walk(n.test)
            for n in tree.body
        ):
            kernel = GATES[aliases[name]]
            via = f"{aliases[name]}()"
        if kernel is None:
            continue
        uses.append(KernelUse(kernel, via, node.lineno))
        for start, end, cname in class_of_line:
            if start <= node.lineno <= end:
                direct_class_kernels.setdefault(cname, set()).add(kernel)
    # 4. module-level names derived from kernel symbols (`is_fast_path_available = all(kernel_modules)`).
    changed = True
    while changed:
        changed = False
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = _bound_names([node])
                used = _loaded_names(node.value) if node.value is not None else set()
                for syms in kernel_symbols.values():
                    if used & syms and not targets <= syms:
                        syms.update(targets)
                        changed = True
    # 5. mixer classes: classes whose body or decorators reference a kernel symbol.
    mixers: dict[str, set[str]] = {k: set(v) for k, v in direct_class_kernels.items()}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            refs = _loaded_names(node)
            for kernel, syms in kernel_symbols.items():
                if refs & syms:
                    mixers.setdefault(node.name, set()).add(kernel)
    uses.sort(key=lambda u: (u.line, u.kernel))
    return tuple(uses), tuple(sorted((k, tuple(sorted(v))) for k, v in mixers.items()))


def _registry_changed() -> None:
    """A mixer registered or removed: its packages' gates join or leave GATES; what was read with the old ones goes."""
    _fill_gates()
    _analyze_source.cache_clear()


registry.on_change(_registry_changed)
