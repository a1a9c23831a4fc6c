"""Checking a loaded generated module against the classes it was generated from.

Generation reads source text; what runs is the class attribute. These checks tie the two together
after the generated text is executed: behind the plan's decoration, each generated function must
have the same decorator wrappers as the class attribute (same code objects, same order) and a body
that compiles to the same program as the original def. A mismatch in the wrappers means the class
attribute is not what its def and decorators make (a class decorator or a patch replaced it after
definition), so the class is left alone; a mismatch in the body is a bug of the generator.
"""

from __future__ import annotations

import os
import types
from typing import Any

from hybridtune.compiler.introspect import belongs_to, resolve_method, wrapper_chain
from hybridtune.compiler.standalone import GeneratedModule, GenerationError

_LAYOUT_OPS = {"NOP", "EXTENDED_ARG", "CACHE", "PUSH_NULL"}
# CPython calls `name.attr(...)` with LOAD_ATTR instead of LOAD_METHOD when `name` was bound by an
# import in the same file; the generated module imports what the original defined. Same call.
_SAME_OPS = {"LOAD_METHOD": "LOAD_ATTR"}


def _instructions(code: types.CodeType) -> list[tuple[str, Any]]:
    """The instructions of `code` without what depends on line layout only.

    The compiler keeps a NOP where a line number must be seen; the generated text lays lines out
    differently (one line per statement), so NOPs and the EXTENDED_ARGs of shifted offsets differ
    while the program does not. Jump targets are compared as indices into the kept instructions.
    """
    import dis

    kept = [i for i in dis.get_instructions(code) if i.opname not in _LAYOUT_OPS]
    offsets = [i.offset for i in kept]
    out: list[tuple[str, Any]] = []
    for i in kept:
        if i.opcode in dis.hasjrel or i.opcode in dis.hasjabs:
            target = next((k for k, off in enumerate(offsets) if off >= i.argval), len(offsets))
            out.append((i.opname, ("jump", target)))
        elif isinstance(i.argval, types.CodeType):
            out.append((i.opname, i.argval))
        else:
            op = _SAME_OPS.get(i.opname, i.opname)
            out.append((op, i.argval if i.opname != "RESUME" else None))
    return out


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    """Same program: instructions, names and constants, ignoring names of the function and lines."""
    fields = ("co_names", "co_varnames", "co_freevars", "co_cellvars", "co_argcount", "co_posonlyargcount")
    if any(getattr(a, f) != getattr(b, f) for f in fields) or a.co_kwonlyargcount != b.co_kwonlyargcount:
        return False
    if a.co_flags != b.co_flags:
        return False
    ia, ib = _instructions(a), _instructions(b)
    if len(ia) != len(ib):
        return False
    for (opa, arga), (opb, argb) in zip(ia, ib):
        if opa != opb:
            return False
        if isinstance(arga, types.CodeType) and isinstance(argb, types.CodeType):
            if not _same_code(arga, argb):
                return False
        elif type(arga) is not type(argb) or arga != argb:
            if not (isinstance(arga, float) and arga != arga and argb != argb):  # NaN constants
                return False
    return True


def verify(gm: GeneratedModule, mod: types.ModuleType) -> None:
    """Check each generated function against the class attribute it replaces.

    The wrapper chain of `C_forward` must be the plan decoration's torch-owned layers, then the same
    wrappers as the class attribute (same code objects, same order), then a def with the same
    bytecode: the real body, behind the real decorators, each exactly once. A class whose attribute
    is not what its def and decorators make (a class decorator or a patch replaced it) raises
    ChainMismatch: generating it would drop that replacement, so it must be left alone. Anything
    else raises GenerationError.
    """
    mismatched: dict[str, str] = {}
    for qualname, s in gm.sections.items():
        attr = vars(s.cls)[s.source.name]
        original = wrapper_chain(attr)
        generated = wrapper_chain(mod.__dict__[s.function_name])
        n = len(original)
        head, tail = generated[: len(generated) - n], generated[len(generated) - n :]
        if (
            len(generated) < n
            or not all(_torch_owned_code(f) for f in head)
            or any(o.__code__ is not g.__code__ for o, g in zip(original[:-1], tail[:-1]))
        ):
            mismatched[qualname] = (
                "its forward attribute is not what its def and decorators make "
                "(replaced after definition, e.g. by a class decorator)"
            )
            continue
        if bool(head) != (s.decoration.source() is not None):
            raise GenerationError(f"{qualname}: the plan decoration ({s.decoration.kind}) is not where it belongs")
        if not belongs_to(resolve_method(s.cls, s.source.name), s.cls):
            raise GenerationError(f"{qualname}: method no longer resolves")
        if not s.rewritten and not _same_code(s.source.func.__code__, tail[-1].__code__):
            raise GenerationError(f"{qualname}: generated body compiles to different bytecode than the original")
    if mismatched:
        raise ChainMismatch(mismatched)


class ChainMismatch(GenerationError):
    """Some classes' attributes differ from their definitions; they must be left alone."""

    def __init__(self, classes: dict[str, str]):
        super().__init__("; ".join(f"{k}: {v}" for k, v in classes.items()))
        self.classes = classes


def _torch_owned_code(func: types.FunctionType) -> bool:
    import torch

    root = os.path.dirname(os.path.abspath(torch.__file__))
    return os.path.abspath(func.__code__.co_filename).startswith(root + os.sep)
