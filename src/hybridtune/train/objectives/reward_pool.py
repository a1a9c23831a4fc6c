"""`reward_processes: N`: the user's reward functions run in N spawned worker processes, each call limited to
`reward_timeout` seconds. A worker runs the very bytes the training process read and hashed (never the file again,
which may have changed since), each call inside reward_fence.py's fence there too; what a call raises comes back as
its one line (`Type: message`), never as a pickled exception. A call past its timeout ends the run in one line naming
the function (the workers are stopped: one may be stuck). Built-in rewards stay in the training process.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hybridtune.train.objectives.reward_fence import Failed, RaisedInWorker, call, raised_line, user_function

_FUNCS: dict[int, Callable] = {}  # in a worker: the user's functions by their index in reward_funcs


class Pool:
    """The worker processes; `proxy(i, name)` is the callable the training process calls for user function i."""

    def __init__(self, files: Sequence[tuple[int, Path, str, str, bytes]], processes: int, timeout: float):
        self.timeout = timeout
        self.executor = concurrent.futures.ProcessPoolExecutor(
            processes, mp_context=multiprocessing.get_context("spawn"), initializer=_load, initargs=(list(files),)
        )
        weakref.finalize(self, self.executor.shutdown, wait=False, cancel_futures=True)
        try:  # the workers started (torch imported, the files run) before any call's timeout counts
            list(self.executor.map(_ready, range(processes)))
        except Exception as e:  # noqa: BLE001 - a worker that cannot start: one line
            self.stop()
            raise RaisedInWorker(f"a worker process did not start ({raised_line(e)})") from None

    def proxy(self, index: int, name: str) -> Callable[..., Any]:
        def reward(**kwargs):
            future = self.executor.submit(_run, index, name, kwargs)
            try:
                kind, value = future.result(timeout=self.timeout)
            except concurrent.futures.TimeoutError:
                self.stop()
                raise TimedOut(name, self.timeout) from None
            except Exception as e:  # noqa: BLE001 - a worker that died, rewards that do not pickle: one line
                raise RaisedInWorker(f"{type(e).__name__} in a reward worker process: {raised_line(e)}") from None
            if kind == "raised":
                raise RaisedInWorker(value)
            return value

        reward.__name__ = name
        return reward

    def stop(self) -> None:
        """Every worker ended now (a stuck call included), the pool shut."""
        for p in list(getattr(self.executor, "_processes", {}).values()):
            p.terminate()
        self.executor.shutdown(wait=False, cancel_futures=True)


class TimedOut(Exception):
    """A call ran past reward_timeout (said as one line by rewards.score, never retried row by row)."""

    def __init__(self, name: str, timeout: float):
        super().__init__(name, timeout)
        self.name, self.timeout = name, timeout


def _load(files: list[tuple[int, Path, str, str, bytes]]) -> None:
    """A worker's start: each user function from the bytes the training process read."""
    for index, path, name, spec, source in files:
        _FUNCS[index] = user_function(path, name, spec, source)


def _ready(_: int) -> bool:
    return True


def _run(index: int, name: str, kwargs: dict) -> tuple[str, Any]:
    """("ok", the function's rewards) or ("raised", its one line), run in a worker."""
    try:
        return "ok", call(name, _FUNCS[index], **kwargs)
    except Failed as e:
        return "raised", raised_line(e.raised)
