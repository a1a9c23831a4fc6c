"""Reading a method's `def` from its file: the AST node, located by the code object, never by name alone.

The function is the one `introspect.definition` identified (behind any decorators); its file is that
function's own file (never a decorator's), parsed once and cached while linecache holds the same
lines; the node is the def in that class's body whose first line is the code object's first line.
Anything not found exactly once raises NotGeneratable: the class is then left alone.
"""

from __future__ import annotations

import ast
import linecache
import sys
import types
from dataclasses import dataclass

from hybridtune.compiler.introspect import definition
from hybridtune.compiler.modules.decoration import NotGeneratable

_FUTURE_ANNOTATIONS = "annotations"


@dataclass
class MethodSource:
    """The `def` of one class's method, as written in its file."""

    cls: type
    name: str
    func: types.FunctionType  # the function whose code object is that def
    node: ast.FunctionDef
    module: types.ModuleType
    filename: str
    future_annotations: bool


# filename -> (the linecache line list it was parsed from, tree). linecache hands back the same list
# object until the file changes, so identity of that list is the cheap validity check.
_AST_CACHE: dict[str, tuple[list[str], ast.Module]] = {}


def _parse_file(filename: str, module: types.ModuleType, fresh: bool = False) -> ast.Module:
    """The AST of a source file: shared and read-only, or a `fresh` one the caller may change."""
    lines = linecache.getlines(filename, module.__dict__)
    if not lines:
        raise NotGeneratable(f"source file {filename} cannot be read")
    cached = _AST_CACHE.get(filename)
    if cached is not None and cached[0] is lines and not fresh:
        return cached[1]
    tree = ast.parse("".join(lines), filename=filename)
    if not fresh:
        _AST_CACHE[filename] = (lines, tree)
    return tree


def _has_future_annotations(tree: ast.Module) -> bool:
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__":
            if any(a.name == _FUTURE_ANNOTATIONS for a in stmt.names):
                return True
    return False


def _first_line(node: ast.FunctionDef) -> int:
    # A decorated function's code object starts at its first decorator line.
    return node.decorator_list[0].lineno if node.decorator_list else node.lineno


def method_source(cls: type, name: str = "forward", tree: ast.Module | None = None) -> MethodSource:
    """Locate the `def` of `cls.<name>` in its file; raises NotGeneratable when it is not certain.

    `tree` is the parsed file to find it in (default: the shared cached parse, not to be changed).
    """
    if name not in vars(cls):
        raise NotGeneratable(f"{name} is inherited, not defined in {cls.__qualname__}")
    func = definition(cls, name)
    if func is None:
        attr = vars(cls)[name]
        if not isinstance(attr, types.FunctionType):
            raise NotGeneratable(f"{name} is a {type(attr).__name__}, not a function")
        raise NotGeneratable(f"{name} is behind a decorator whose wrapped method cannot be identified with certainty")
    if "<locals>" in cls.__qualname__:
        raise NotGeneratable(f"{cls.__qualname__} is defined inside a function")
    module = sys.modules.get(cls.__module__)
    if module is None:
        raise NotGeneratable(f"module {cls.__module__} is not importable by name")
    filename = func.__code__.co_filename
    tree = tree if tree is not None else _parse_file(filename, module)
    line = func.__code__.co_firstlineno
    scope: list[ast.stmt] = tree.body
    for part in cls.__qualname__.split("."):
        # The class whose span holds the def's first line (a class may be defined under an `if`).
        found = [n for n in _class_defs(scope) if n.name == part and n.lineno <= line <= (n.end_lineno or n.lineno)]
        if len(found) != 1:
            raise NotGeneratable(f"class {cls.__qualname__} not found exactly once in {filename}")
        scope = found[0].body
    nodes = [n for n in scope if isinstance(n, ast.FunctionDef) and n.name == func.__name__ and _first_line(n) == line]
    if len(nodes) != 1:
        raise NotGeneratable(f"def {func.__name__} of {cls.__qualname__} not found at line {line}")
    return MethodSource(cls, name, func, nodes[0], module, filename, _has_future_annotations(tree))


def _class_defs(stmts: list[ast.stmt]) -> list[ast.ClassDef]:
    out: list[ast.ClassDef] = []
    for n in stmts:
        if isinstance(n, ast.ClassDef):
            out.append(n)
        elif isinstance(n, ast.If | ast.Try):
            for block in (n.body, n.orelse, getattr(n, "finalbody", []), *[h.body for h in getattr(n, "handlers", [])]):
                out.extend(_class_defs(block))
    return out
