"""Find the real method behind a class attribute, whatever decorators stand in front of it.

Reading a method through its class attribute is only right when nothing wraps it. A decorator built
with `functools.wraps` copies `__qualname__` and sets `__wrapped__`, so `inspect` can still follow it;
a decorator that returns a bare closure (transformers 5.13 to 5.15 `force_accelerate_hooks`) leaves
an attribute whose name, signature and source are the wrapper's. Code generated from that wrapper
names variables that exist only inside the decorator (`NameError: name 'args' is not defined`).

`resolve_method` walks `__wrapped__` links and closure cells that hold exactly one function, and
accepts a candidate only when its `__qualname__` and `__module__` say it was defined in the class
itself. Anything it cannot be sure of comes back unchanged, so no other shape of decorator changes
behaviour.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

# Deeper stacks than this are not seen in practice; the bound only guards against cycles we miss.
_MAX_DEPTH = 32


def belongs_to(func: Any, cls: type) -> bool:
    """True when `func` was defined directly in the body of `cls` (by qualified name and module)."""
    if not isinstance(func, types.FunctionType):
        return False
    owner, _, leaf = func.__qualname__.rpartition(".")
    return bool(leaf) and owner == cls.__qualname__ and func.__module__ == cls.__module__


def _single_closure_function(func: types.FunctionType) -> types.FunctionType | None:
    """The one function held in `func`'s closure cells, or None if there are none or several."""
    found: list[types.FunctionType] = []
    for cell in func.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell: a variable bound later or never
            continue
        if isinstance(value, types.FunctionType) and all(value is not f for f in found):
            found.append(value)
    return found[0] if len(found) == 1 else None


def wrapper_chain(func: Any) -> list[types.FunctionType]:
    """Every function reached from `func` by `__wrapped__` links or single-function closures.

    The chain starts at `func` itself and stops where neither link leads to a new function (or at
    a cycle). It does not decide which element is the method; `resolve_method` does.
    """
    chain: list[types.FunctionType] = []
    current = func
    while isinstance(current, types.FunctionType) and len(chain) < _MAX_DEPTH:
        if any(current is f for f in chain):
            break
        chain.append(current)
        nxt = getattr(current, "__wrapped__", None)
        current = nxt if isinstance(nxt, types.FunctionType) else _single_closure_function(current)
    return chain


def resolve_method(cls: type, name: str = "forward") -> Any:
    """The function named `name` defined in `cls` itself, found behind any stack of decorators.

    Returns the class attribute at once when it already belongs to `cls` (an undecorated method, or
    one behind `functools.wraps`, which copies the qualified name; `inspect` follows its
    `__wrapped__`). Otherwise walks `__wrapped__` links and closure cells holding exactly one
    function and returns the first candidate whose `__qualname__` is `<cls qualname>.<leaf>` and
    whose module is the class's. Returns the attribute unchanged when `cls` does not define `name`
    itself (inherited), when the attribute is not a plain function, when a closure holds several
    functions, or when what it reaches belongs to another class: in those cases there is no
    certain answer and guessing is what broke other compilers.
    """
    if name not in vars(cls):
        return getattr(cls, name)
    attr = vars(cls)[name]
    if not isinstance(attr, types.FunctionType):
        return attr
    for candidate in wrapper_chain(attr):
        if belongs_to(candidate, cls):
            return candidate
    return attr


def is_decorated(cls: type, name: str = "forward") -> bool:
    """True when the attribute `cls.<name>` is some wrapper rather than the function written there."""
    attr = vars(cls).get(name)
    if not isinstance(attr, types.FunctionType):
        return False
    return attr is not resolve_method(cls, name) or inspect.unwrap(attr) is not attr


def definition(cls: type, name: str = "forward") -> types.FunctionType | None:
    """The function object whose code is the `def` written in `cls`, or None if it is not certain.

    `resolve_method` may return a `functools.wraps` wrapper (it carries the method's name); the code
    object of the `def` itself sits at the end of that wrapper's `__wrapped__` links. Accepted only
    when that code object's name is the method's name, so a wrapper that merely copied the name is
    never read as the method.
    """
    resolved = resolve_method(cls, name)
    if not belongs_to(resolved, cls):
        return None
    chain = wrapper_chain(resolved)
    # Follow only __wrapped__ links from here: the method is what `functools.wraps` pointed at.
    func = resolved
    for nxt in chain[1:]:
        if getattr(func, "__wrapped__", None) is not nxt:
            break
        func = nxt
    code_qualname = getattr(func.__code__, "co_qualname", None)  # Python >= 3.11
    if code_qualname is not None and code_qualname != resolved.__qualname__:
        return None
    if func.__code__.co_name != resolved.__name__:
        return None
    return func
