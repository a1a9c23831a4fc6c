"""Loading generated code: execute it in memory, check it against the classes it came from, cache it by hash.

`GeneratedModule` is what `standalone.generate` produced for one modeling module (the text, its hash,
one `ClassSection` per class); `load()` executes the text as a fresh module registered under a pseudo
file name in `linecache` (so tracebacks and `inspect.getsource` show generated lines), once per hash.

Generation reads source text; what runs is the class attribute. `check_against_originals` ties the two
together after the text is executed: behind the plan's decoration, each generated function must have the
same decorator wrappers as the class attribute (same code objects, same order) and a body that compiles
to the same program as the original def. A mismatch in the wrappers means the class attribute is not what
its def and decorators make (a class decorator or a patch replaced it after definition), so the class is
left alone (`ChainMismatch`); a mismatch in the body is a bug of the generator (`GenerationError`).
"""

from __future__ import annotations

import dis
import hashlib
import linecache
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any

from hybridtune.compiler.introspect import belongs_to, resolve_method, wrapper_chain
from hybridtune.compiler.modules.decoration import ChainMismatch, Decoration, GenerationError
from hybridtune.compiler.modules.source import MethodSource


@dataclass
class ClassSection:
    """The generated statements for one class, before imports are added."""

    cls: type
    function_name: str
    holder_name: str
    decoration: Decoration
    text: str
    rewritten: bool  # super()/__class__ rewritten: bytecode differs from the original by design
    decorators: list[str]  # the real decorators, as source text
    source: MethodSource
    unbound: list[str] = field(default_factory=list)  # names its own module does not define either


@dataclass
class GeneratedModule:
    """One generated module: the text, its hash, and what each class became."""

    source_module: str
    text: str
    sha256: str
    filename: str
    sections: dict[str, ClassSection] = field(default_factory=dict)  # class qualname -> section
    skipped: dict[str, str] = field(default_factory=dict)  # class qualname -> reason left alone
    _module: types.ModuleType | None = None
    _code: types.CodeType | None = None  # compiled once by `generate`

    @property
    def basename(self) -> str:
        return self.source_module.rsplit(".", 1)[-1] + "_hybridtune.py"

    def load(self) -> types.ModuleType:
        """Compile and execute the text in memory (once), then check it against the originals."""
        if self._module is None:
            cached = _LOADED.get(self.sha256)
            if cached is None:
                cached = exec_text(self.text, self.filename, self.sha256, self._code)
                try:
                    check_against_originals(self, cached)
                except GenerationError:
                    sys.modules.pop(cached.__name__, None)
                    raise
                _LOADED[self.sha256] = cached
            self._module = cached
        return self._module

    def forward_for(self, cls: type) -> types.FunctionType:
        """The `forward` to bind to instances of `cls`."""
        section = self.sections[cls.__qualname__]
        return vars(getattr(self.load(), section.holder_name))["forward"]


_LOADED: dict[str, types.ModuleType] = {}


def exec_text(text: str, filename: str, sha256: str, code: types.CodeType | None = None) -> types.ModuleType:
    """Execute generated text as a fresh module whose lines tracebacks can show."""
    # mtime None: linecache.checkcache never evicts it (there is no file to compare against).
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    if code is None:
        code = compile(text, filename, "exec", dont_inherit=True)
    mod = types.ModuleType(f"hybridtune.compiler._generated_{sha256[:12]}")
    mod.__file__ = filename
    mod.__dict__["__hybridtune_sha256__"] = sha256
    # Registered by name: dynamo imports a traced function's module by its __name__.
    sys.modules[mod.__name__] = mod
    try:
        exec(code, mod.__dict__)
    except BaseException:
        del sys.modules[mod.__name__]
        raise
    return mod


def verify_text(text: str, sha256: str) -> bool:
    """True when `text` hashes to `sha256` (the hash of what was generated)."""
    return hashlib.sha256(text.encode()).hexdigest() == sha256


def loaded_module(sha256: str) -> Any:
    return _LOADED.get(sha256)


# ---------------------------------------------------------------------------------------------
# Checking a loaded module against the originals

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


def check_against_originals(gm: GeneratedModule, mod: types.ModuleType) -> None:
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


def _torch_owned_code(func: types.FunctionType) -> bool:
    import torch

    root = os.path.dirname(os.path.abspath(torch.__file__))
    return os.path.abspath(func.__code__.co_filename).startswith(root + os.sep)
