"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM (`kill`, `docker stop`, a scheduler's preemption).

The first signal asks the run to stop at the end of the step in flight: the step completes, every rank agrees on
the same last step (the request travels with the step's own all-reduce), a checkpoint is written, and the process
exits with 130. A second Ctrl-C abandons the step in flight (raised as KeyboardInterrupt, the step's gradients are
never applied, and the checkpoint holds the last complete step) unless the run is inside an update or a save,
which always finish: a signal there is deferred and said so. A Ctrl-C in a terminal reaches every process of its
group, and torchrun's launcher passes it on to its ranks (or follows it with a SIGTERM): a repeat within
`SAME_PRESS_S` of the first, or a SIGTERM after it, is the same request, not a second one.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time

logger = logging.getLogger(__name__)

SIGNALS = ("SIGINT", "SIGTERM")
SAME_PRESS_S = 2.0


class StopRequest:
    """Installed as the SIGINT/SIGTERM handler for the duration of `installed()` (main thread only)."""

    def __init__(self) -> None:
        self.requested: str | None = None  # the signal's name once one arrived
        self.critical = 0  # > 0 inside an update or a save
        self.at = 0.0  # when the request arrived (time.monotonic)
        self._old: dict = {}

    def __call__(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is None:
            self.requested, self.at = name, time.monotonic()
            logger.warning(
                "%s: stopping after the step in flight and saving a checkpoint (Ctrl-C again abandons the step)", name
            )
            return
        if name != "SIGINT" or self.requested != "SIGINT" or time.monotonic() - self.at < SAME_PRESS_S:
            return  # the same press passed on by torchrun, its SIGTERM, or a repeated SIGTERM: the stop goes on
        if self.critical:
            logger.warning("SIGINT again: a checkpoint or an optimizer update is being written; it finishes first")
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield self  # signal handlers can only be set from the main thread (an embedding program's thread)
            return
        for name in SIGNALS:
            sig = getattr(signal, name)
            self._old[sig] = signal.signal(sig, self)
        try:
            yield self
        finally:
            for sig, old in self._old.items():
                signal.signal(sig, old)
            self._old.clear()

    @contextlib.contextmanager
    def hold(self):
        """A section that a second Ctrl-C must not cut (an optimizer update, a checkpoint)."""
        self.critical += 1
        try:
            yield
        finally:
            self.critical -= 1


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@contextlib.contextmanager
def _handled(names: tuple[str, ...], handler):
    """`handler` for each signal in `names` (those this platform has) inside the block; main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = [getattr(signal, n) for n in names if hasattr(signal, n)]
    old = {sig: signal.signal(sig, handler) for sig in sigs}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def interrupting(*names: str):
    """Each signal named raises KeyboardInterrupt inside the block, as SIGINT does by default (`sigterm_interrupts`,
    and `hybridtune bench`'s modes, where a SIGHUP from a dropped terminal must stop the worker too)."""
    return _handled(names, _interrupt)


def sigterm_interrupts():
    """SIGTERM raises KeyboardInterrupt inside the block (as SIGINT does by default): setup stops at once and cleans
    up after itself, instead of dying with nothing said and its lock left behind."""
    return interrupting("SIGTERM")


class Deferred:
    """What `deferring` saw: the first signal's name, or None."""

    received: str | None = None


@contextlib.contextmanager
def deferring(*names: str, why: str = "finishing the files being written first"):
    """The signals named are noted, not acted on, inside the block (records being written, a child being stopped:
    they finish first); the caller reads `.received` during or after it and stops then."""
    seen = Deferred()

    def note(signum, frame):
        if seen.received is None:
            seen.received = signal.Signals(signum).name
            logger.warning("%s: %s", seen.received, why)

    with _handled(names, note):
        yield seen
