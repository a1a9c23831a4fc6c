"""Static reading of a forward: what in it breaks graphs, recompiles per length, or cannot be known.

The plan (`plan.py`) decides compile / eager from these findings. Everything is decided from the
code and the identity of what it calls (a function marked by `torch.compiler.disable`, a torch
function, a Python loop whose trip count is only known at run time), never from a class or model
name. A finding is either a reason to keep the class eager, or a doubt that only rules out
`fullgraph=True` (the compiled region may then break into several graphs, which is still correct).
"""

from __future__ import annotations

import ast
import builtins
import types
from dataclasses import dataclass, field
from typing import Any

from hybridtune.compiler.introspect import resolve_method, wrapper_chain
from hybridtune.compiler.modules.decoration import NotGeneratable
from hybridtune.compiler.modules.source import method_source

# Tensor methods that copy a value to the host or give a data-dependent shape: a graph break and,
# for .item()/.tolist(), a recompile per value.
_HOST_SYNC_METHODS = {"item", "tolist", "numpy", "nonzero", "unique", "unique_consecutive"}
# Builtins that dynamo handles inside a graph.
_PURE_BUILTINS = {
    "isinstance",
    "issubclass",
    "len",
    "getattr",
    "hasattr",
    "int",
    "float",
    "bool",
    "tuple",
    "list",
    "dict",
    "min",
    "max",
    "abs",
    "range",
    "enumerate",
    "zip",
    "sum",
    "any",
    "all",
    "str",
    "type",
    "slice",
    "reversed",
    "divmod",
    "round",
    "set",
}
_MAX_DEPTH = 3


@dataclass
class Findings:
    """What a forward (and what it calls, a few levels deep) does that matters to the compiler."""

    eager: list[str] = field(default_factory=list)  # reasons to keep it out of graphs
    doubts: list[str] = field(default_factory=list)  # reasons fullgraph=True is not safe
    child_calls: set[str] = field(default_factory=set)  # attributes of self called: self.<x>(...)

    def merge(self, other: Findings, via: str) -> None:
        self.eager += [f"{r} (via {via})" for r in other.eager if f"{r} (via {via})" not in self.eager]
        self.doubts += [f"{r} (via {via})" for r in other.doubts if f"{r} (via {via})" not in self.doubts]


def _root_and_path(node: ast.expr) -> tuple[str | None, list[str]]:
    """`a.b.c` -> ("a", ["b", "c"]); anything else -> (None, [])."""
    path: list[str] = []
    while isinstance(node, ast.Attribute):
        path.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return node.id, path[::-1]
    return None, []


def _is_torch_owned(obj: Any) -> bool:
    mod = getattr(obj, "__module__", None) or ""
    if isinstance(obj, types.ModuleType):
        mod = obj.__name__
    return mod == "torch" or mod.startswith(("torch.", "torch._")) or type(obj).__module__.startswith("torch")


def _disabled(obj: Any) -> bool:
    # torch.compiler.disable marks what it returns; FLA's public ops and `@dispatch` carry it.
    return bool(getattr(obj, "_torchdynamo_disable", False))


def _runtime_trip_count(iter_node: ast.expr, self_name: str) -> bool:
    """True for `range(...)` whose bounds are not constants or attributes of self (config sizes)."""
    if not (isinstance(iter_node, ast.Call) and isinstance(iter_node.func, ast.Name) and iter_node.func.id == "range"):
        return False
    for arg in iter_node.args:
        for n in ast.walk(arg):
            if isinstance(n, ast.Name) and n.id != self_name and not isinstance(n.ctx, ast.Store):
                return True
            if isinstance(n, ast.Call):
                return True
    return False


def _iterates_self(iter_node: ast.expr, self_name: str) -> bool:
    """`for x in self.layers`, `self.layers[:n]`, `zip(self.a, ...)`, `enumerate(self.b)`."""
    targets = [iter_node]
    if (
        isinstance(iter_node, ast.Call)
        and isinstance(iter_node.func, ast.Name)
        and iter_node.func.id in ("zip", "enumerate")
    ):
        targets = list(iter_node.args)
    for t in targets:
        if isinstance(t, ast.Subscript):
            t = t.value
        root, path = _root_and_path(t)
        if root == self_name and len(path) == 1:
            return True
    return False


def scan_function(
    node: ast.FunctionDef,
    globals_: dict[str, Any],
    cls: type | None,
    depth: int = 0,
    seen: set[int] | None = None,
) -> Findings:
    """Findings for one function body; follows module-level Python functions and methods of `cls`."""
    seen = set() if seen is None else seen
    f = Findings()
    params = node.args.posonlyargs + node.args.args
    self_name = params[0].arg if params and cls is not None else None
    # Only the body: decorators ran at definition time; their wrappers are scanned as layers.
    for n in (sub for stmt in node.body for sub in ast.walk(stmt)):
        if isinstance(n, ast.While):
            f.eager.append("Python while loop (trip count known only at run time; recompiles or breaks)")
        elif isinstance(n, ast.For | ast.AsyncFor):
            if self_name and _iterates_self(n.iter, self_name):
                f.eager.append("iterates over its submodules (a layer container: its children are planned instead)")
            elif _runtime_trip_count(n.iter, self_name or ""):
                f.eager.append("Python loop with a run-time trip count (unrolled and recompiled per length)")
            else:
                f.doubts.append("Python loop")
        elif isinstance(n, ast.Try):
            f.doubts.append("try/except")
        elif isinstance(n, ast.Yield | ast.YieldFrom | ast.Await):
            f.eager.append("generator or coroutine")
        elif isinstance(n, ast.Call):
            _scan_call(n, globals_, cls, self_name, f, depth, seen)
    f.eager = list(dict.fromkeys(f.eager))
    f.doubts = list(dict.fromkeys(f.doubts))
    return f


def _scan_call(
    call: ast.Call,
    globals_: dict[str, Any],
    cls: type | None,
    self_name: str | None,
    f: Findings,
    depth: int,
    seen: set[int],
) -> None:
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr in _HOST_SYNC_METHODS:
        root, _ = _root_and_path(func)
        obj = _lookup(root, globals_) if root is not None else None
        if obj is None or not isinstance(obj, types.ModuleType) or _is_torch_owned(obj):
            f.eager.append(f"calls .{func.attr}() (host sync or data-dependent shape)")
            return
    root, path = _root_and_path(func)
    if root is None:
        if isinstance(func, ast.Attribute):
            return  # a method of a computed value (x.pow(2).mean): a tensor method, judged above
        f.doubts.append(f"calls a computed callable ({ast.unparse(func)[:40]})")
        return
    if root == self_name:
        if len(path) == 1:
            _scan_self_call(path[0], cls, globals_, f, depth, seen)
        # self.<param or buffer>.<method>(...): a tensor method, judged above
        return
    obj = _lookup(root, globals_)
    if obj is _MISSING:
        return  # a local variable: a tensor method, a callable argument; judged where it was made
    for part in path:
        obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            f.doubts.append(f"calls {root}.{'.'.join(path)}, which cannot be resolved")
            return
    label = ".".join([root, *path])
    if _disabled(obj):
        f.eager.append(f"calls {label}, which torch.compiler.disable keeps out of graphs")
    elif obj is getattr(builtins, root, None) and not path:
        if root not in _PURE_BUILTINS and not (isinstance(obj, type) and issubclass(obj, BaseException)):
            f.doubts.append(f"calls builtin {root}")
    elif _is_torch_owned(obj):
        if root == "torch" and path[-1:] in (["nonzero"], ["unique"]):
            f.eager.append(f"calls {label} (data-dependent shape)")
        elif path[-1:] == ["where"] and len(call.args) == 1:
            f.eager.append(f"calls {label} with one argument (data-dependent shape)")
    elif isinstance(obj, types.FunctionType):
        _scan_python_function(obj, label, f, depth, seen)
    elif isinstance(obj, type) and issubclass(obj, BaseException):
        pass  # built only to be raised; the branch that raises is not traced
    else:
        f.doubts.append(f"calls {label} ({type(obj).__name__})")


_MISSING = object()


def _lookup(name: str | None, globals_: dict[str, Any]) -> Any:
    if name is None:
        return _MISSING
    if name in globals_:
        return globals_[name]
    return getattr(builtins, name, _MISSING)


def _scan_python_function(obj: types.FunctionType, label: str, f: Findings, depth: int, seen: set[int]) -> None:
    # Every layer of a decorated function runs: the wrappers and, at the end, the real def.
    for layer in wrapper_chain(obj):
        if _disabled(layer):
            f.eager.append(f"calls {label}, which torch.compiler.disable keeps out of graphs")
            return
        if id(layer.__code__) in seen:
            continue
        seen.add(id(layer.__code__))
        if depth >= _MAX_DEPTH:
            f.doubts.append(f"calls {label} (not followed deeper)")
            return
        node = _function_node(layer)
        if node is None:
            f.doubts.append(f"calls {label}, whose source cannot be read")
            return
        f.merge(scan_function(node, layer.__globals__, None, depth + 1, seen), label)


def _scan_self_call(
    attr: str, cls: type | None, globals_: dict[str, Any], f: Findings, depth: int, seen: set[int]
) -> None:
    static = getattr(cls, attr, None) if cls is not None else None
    if isinstance(static, types.FunctionType) or callable(getattr(static, "__func__", None)):
        if _disabled(static):
            f.eager.append(f"calls self.{attr}, which torch.compiler.disable keeps out of graphs")
            return
        method = resolve_method(_owner(cls, attr), attr) if cls is not None else static
        if isinstance(method, types.FunctionType) and id(method.__code__) not in seen and depth < _MAX_DEPTH:
            seen.add(id(method.__code__))
            node = _function_node(method)
            if node is None:
                f.doubts.append(f"calls self.{attr}, whose source cannot be read")
            else:
                f.merge(scan_function(node, method.__globals__, cls, depth + 1, seen), f"self.{attr}")
        return
    f.child_calls.add(attr)


def _owner(cls: type, attr: str) -> type:
    for base in cls.__mro__:
        if attr in vars(base):
            return base
    return cls


_NODE_CACHE: dict[int, ast.FunctionDef | None] = {}


def _function_node(func: types.FunctionType) -> ast.FunctionDef | None:
    """The AST of a function's def, read from its file (None when it cannot be read)."""
    import inspect
    import textwrap

    key = id(func.__code__)
    if key in _NODE_CACHE:
        return _NODE_CACHE[key]
    node = None
    try:
        src = textwrap.dedent(inspect.getsource(func.__code__))
        tree = ast.parse(src)
        if tree.body and isinstance(tree.body[0], ast.FunctionDef):
            node = tree.body[0]
    except (OSError, TypeError, SyntaxError, IndentationError):
        node = None
    _NODE_CACHE[key] = node
    return node


def scan_callable(obj: Any, label: str) -> Findings:
    """Findings for a callable found at run time (a function stored on a module instance)."""
    f = Findings()
    if _disabled(obj):
        f.eager.append(f"calls {label}, which torch.compiler.disable keeps out of graphs")
    elif isinstance(obj, types.FunctionType):
        _scan_python_function(obj, label, f, 0, set())
    elif not _is_torch_owned(obj):
        f.doubts.append(f"calls {label} ({type(obj).__name__})")
    return f


def scan_class(cls: type, name: str = "forward") -> Findings:
    """Findings for `cls.<name>`, read from the real def (raises NotGeneratable when not certain)."""
    ms = method_source(cls, name)
    return scan_function(ms.node, ms.func.__globals__, cls)


__all__ = ["Findings", "NotGeneratable", "scan_class", "scan_function"]
