"""What the plan chose for one class, and the ways generation says no.

A leaf of the compiler: `plan.py` decides a `Decoration` per class, `standalone.py` writes it into the
generated text, `loader.py` checks what runs. None of them needs another to name these types.

- `Decoration`: compile (with options), eager, or nothing, as the source text of the outermost decorator.
- `NotGeneratable`: the class is left alone (its transformers forward stays); generating it would be a guess.
- `GenerationError`: generation was attempted and produced something wrong (a bug, reported by the sweep).
- `ChainMismatch`: some classes' attributes are not what their definitions make; they are left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

# The name generated code binds torch to (never shadowing a name of the modeling module).
TORCH_ALIAS = "_hybridtune_torch"


class NotGeneratable(Exception):
    """The class is left alone (its transformers forward stays): generating it would be a guess."""


class GenerationError(Exception):
    """Generation was attempted and produced something wrong: a bug, reported by the sweep."""


class ChainMismatch(GenerationError):
    """Some classes' attributes differ from their definitions; they must be left alone."""

    def __init__(self, classes: dict[str, str]):
        super().__init__("; ".join(f"{k}: {v}" for k, v in classes.items()))
        self.classes = classes


@dataclass(frozen=True)
class Decoration:
    """What the plan chose for one class: compile (with options), eager, or nothing (tests)."""

    kind: str  # "compile" | "eager" | "none"
    fullgraph: bool = False
    backend: str = "inductor"
    dynamic: bool | None = None
    mode: str | None = None
    reason: str = ""

    def source(self) -> str | None:
        if self.kind == "compile":
            opts = [f"fullgraph={self.fullgraph!r}", f"dynamic={self.dynamic!r}", f"backend={self.backend!r}"]
            if self.mode is not None:
                opts.append(f"mode={self.mode!r}")
            return f"{TORCH_ALIAS}.compile({', '.join(opts)})"
        if self.kind == "eager":
            # recursive=False: the frame itself is never traced, but what it calls still may be
            # compiled (child modules with their own compiled forwards).
            return f"{TORCH_ALIAS}.compiler.disable(recursive=False)"
        if self.kind == "none":
            return None
        raise ValueError(f"unknown decoration kind {self.kind!r}; expected compile, eager or none")
