"""Each call of a user's reward function inside a fence, so that its code cannot change what the run trains or where
it writes (the same file is safe in TRL, which builds fresh lists for every call):

- every argument is a fresh deep copy: a reward that edits `completion_ids`, `prompts` or a column in place changes
  its own copy, never the tokens the policy trains on nor the rows the next call is given;
- the working directory is put back after the call (a reward that `os.chdir`s into a sandbox would otherwise move
  every later checkpoint, `final/` and `base_model/`), said once per function;
- whatever it raises, BaseException subclasses included (GeneratorExit, a class of its own, sys.exit's SystemExit),
  comes back as `Failed`, which the caller turns into one line naming the function and the row; only Ctrl-C's
  KeyboardInterrupt passes, to stop the run as Ctrl-C does.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

_said: set[str] = set()  # the code already said to have moved the working directory


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
