"""How a config key is declared: `key(default, help, *bounds, **about)`, a dataclass field whose metadata holds its
help, its bounds (`Bound`: what the value must be, checked by `bounds.bound_problems`, the one walker) and what it
is (`path`: a file or directory, `not_empty`: what to give instead of an empty text); the pieces every config module
uses besides: a key's type as people read it (`type_name`), values shortened in messages (`SHOW`) and many problems
said as one error (`together`)."""

from __future__ import annotations

import copy
import reprlib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from hybridtune.errors import ConfigError

# torch, numpy and the run's JSON files hold an int key's value in 64 bits; past that (a count typed with a few hundred
# digits) a run failed deep inside with an OverflowError.
MAX_INT = 2**63 - 1
# Values in error messages are shortened: a long list or string is shown by its start.
SHOW = reprlib.Repr()
SHOW.maxstring, SHOW.maxother, SHOW.maxlist, SHOW.maxdict, SHOW.maxlevel = 80, 80, 6, 6, 3


@dataclass(frozen=True)
class Bound:
    """One bound on a key's value: `ok(value, cfg)` (the whole config, for a bound that reads another key) and what
    the value must be (`what`, text or a function of the config), said as `config key 'k' = v <what>`; `training`:
    checked only for a config about to train (not for a recorded run's, eval's)."""

    ok: Callable[[Any, Any], bool]
    what: str | Callable[[Any], str]
    training: bool = False

    def said(self, cfg: Any) -> str:
        return self.what(cfg) if callable(self.what) else self.what


def _number(value: Any) -> bool:
    """A number a bound applies to; `auto` and null are no numbers, and pass every numeric bound."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Every int key's value within 64 bits: the walker checks it after the key's own bounds, unless the key lists it.
INT64 = Bound(lambda v, cfg: not _number(v) or abs(v) <= MAX_INT, "must be at most 2**63 - 1 in size (a 64-bit int)")


def at_least(low: float, what: str | None = None) -> Bound:
    """value >= low (`auto` and null pass); said as `what`, by default 'must be at least <low>'."""
    return Bound(lambda v, cfg: not _number(v) or v >= low, what or f"must be at least {low}")


def positive(what: str = "must be positive") -> Bound:
    """value > 0 (`auto` and null pass)."""
    return Bound(lambda v, cfg: not _number(v) or v > 0, what)


def in_range(low: float, high: float, what: str) -> Bound:
    """low <= value < high (`auto` and null pass)."""
    return Bound(lambda v, cfg: not _number(v) or low <= v < high, what)


def key(default: Any, help: str, *bounds: Bound, **about: Any) -> Any:
    """A config key: its default (a list or dict copied for each config), one sentence of help, its bounds in the
    order they are checked (the first one failed is said) and what it is (`path=True`, `not_empty='give ...'`,
    `shown`: what `--help` says its values are, when its type does not say, as a function of the registries now)."""
    metadata = {"help": help, "bounds": bounds, **about}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: copy.deepcopy(d), metadata=metadata)
    return field(default=default, metadata=metadata)


def type_name(tp: Any) -> str:
    """A key's annotation as people read it: `list of str`, `'lora' | 'full'`, `int | null`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def together(problems: list[ConfigError]) -> ConfigError:
    """One error for all of `problems`: the error itself when it is one, else one line for each."""
    if len(problems) == 1:
        return problems[0]
    lines = "\n".join(f"  {p}" for p in problems)
    return ConfigError(f"{len(problems)} problems in the config (each below; fix them all, nothing was run):\n{lines}")
