"""The user's reward code: its file run as a module (`user_function`, once per path and content) and each call of a
reward function inside a fence, so that its code cannot change what the run trains or where it writes (the same
file is safe in TRL, which builds fresh lists for every call):

- every argument is a fresh deep copy: a reward that edits `completion_ids`, `prompts` or a column in place changes
  its own copy, never the tokens the policy trains on nor the rows the next call is given;
- the working directory is put back after the call and after the file's import (an `os.chdir` into a sandbox would
  otherwise move every later checkpoint, `final/` and `base_model/`), said once per function;
- whatever it raises, BaseException subclasses included (GeneratorExit, a class of its own, sys.exit's SystemExit),
  comes back as `Failed`, which the caller turns into one line naming the function and the row (`raised_line`);
  only Ctrl-C's KeyboardInterrupt passes, to stop the run as Ctrl-C does.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hybridtune.errors import ConfigError, did_you_mean

logger = logging.getLogger(__name__)

_said: set[str] = set()  # the code already said to have moved the working directory


class RaisedInWorker(Exception):
    """What a reward raised in a worker process (reward_pool.py), as its one line (`line`)."""

    def __init__(self, line: str):
        super().__init__(line)
        self.line = line


class Failed(Exception):
    """A reward function raised `raised` (any BaseException but KeyboardInterrupt)."""

    def __init__(self, raised: BaseException):
        super().__init__(str(raised))
        self.raised = raised


def call(name: str, fn: Callable[..., Any], **kwargs) -> Any:
    """`fn(**kwargs)`, each argument deep-copied, the working directory put back after it; raises `Failed`."""
    args = copy.deepcopy(kwargs)
    with kept_directory(f"reward function '{name}'"):
        try:
            return fn(**args)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - the user's code: every failure is one line (the module doc)
            raise Failed(e) from e


@contextlib.contextmanager
def kept_directory(who: str) -> Iterator[None]:
    """The working directory as it was before the block, whatever the block did (`who`: whose code, to say so)."""
    try:
        here: int | str = os.open(".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))  # (found again if renamed)
    except OSError:  # a directory this user may enter but not read: by its path
        here = os.getcwd()
    try:
        yield
    finally:
        _come_back(who, here)


def _come_back(who: str, here: int | str) -> None:
    """Back into the directory `here` (an open descriptor, closed here; or its path) when the call left another."""
    try:
        try:
            moved = not os.path.samestat(os.fstat(here) if isinstance(here, int) else os.stat(here), os.stat("."))
        except OSError:  # the directory the call left us in is gone
            moved = True
        if not moved:
            return
        try:
            now = os.getcwd()
        except OSError:
            now = "a directory that no longer exists"
        if isinstance(here, int):
            os.fchdir(here)
        else:
            os.chdir(here)
        if who not in _said:
            _said.add(who)
            logger.warning(
                "%s changed the working directory (to %s); hybridtune changes it back after each call, so the run's "
                "paths keep their meaning (give a subprocess its own directory with cwd=)", who, now,
            )  # fmt: skip
    finally:
        if isinstance(here, int):
            os.close(here)


def user_function(path: Path, name: str, spec: str, source: bytes) -> Callable:
    """`name` of the file at `path` whose bytes were read once (`source`, which a reward worker runs too): the module
    runs those bytes (one module per path and content)."""
    digest = hashlib.sha256(f"{path.resolve()}\0".encode() + source).hexdigest()[:24]
    module_name = f"hybridtune_rewards_{digest}"
    module = sys.modules.get(module_name)
    if module is None:
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(module_name, path))
        # As an import runs it: in sys.modules while it runs (dataclasses, pickling and typing look it up there),
        # compiled with its own __future__ flags only, not this module's (string annotations break a ClassVar).
        sys.modules[module_name] = module
        try:
            code = compile(source, str(path), "exec", dont_inherit=True)
            with kept_directory(f"importing {path} (reward_funcs)"):  # (it may chdir as its calls may)
                exec(code, vars(module))  # (the user's own reward code, as named)
        except BaseException as e:  # no half-run module stays; what the user's file raised, in one line
            sys.modules.pop(module_name, None)
            if not isinstance(e, KeyboardInterrupt):  # (Ctrl-C passes)
                raise ConfigError(f"config key 'reward_funcs': importing {path} raised {raised_line(e)}") from e
            raise
    fn = getattr(module, name, None)
    if not callable(fn):
        have = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        raise ConfigError(
            f"config key 'reward_funcs' entry '{spec}': {path} defines no function '{name}'{did_you_mean(name, have)}"
        )
    return fn


def raised_line(e: BaseException) -> str:
    """`Type: first line` of an exception; sys.exit(code) as itself."""
    if isinstance(e, RaisedInWorker):
        return e.line
    if isinstance(e, SystemExit):
        return f"SystemExit (sys.exit({e.code!r}) would end the run as if it had finished)"
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
