"""The guarded writes of every command that writes a model (export, merge; the trainer's final model through export).

- Atomic. A directory is written by `atomic_dir`: a `.tmp-<name>-*` beside the target carrying hybridtune's marker
  (`checkpoint.make_tmp_dir`), fsynced, renamed; files by `files.atomic_write` (O_EXCL | O_NOFOLLOW, renamed).
  Modes follow the umask (safetensors writes 0600).
- Finite. `refuse_non_finite` checks every floating tensor before the first byte is written: a NaN or Inf is one
  line (exit 2), nothing written.
- Room. The write's real size is checked against the free space first; a disk that fills midway is one line
  (DiskFullError) and the partial directory is removed.
- Signals. Inside `interruptible()` SIGTERM stops the command as Ctrl-C does, so every atomic write removes its
  temporary directory; a repeated signal does not cut that cleanup short.
- Stale. A temporary directory whose writer died (SIGKILL, power) is removed by the next write to the same target
  (`sweep_stale`): only ours (the marker, tagged by `atomic_dir`, never a link), only when no live process holds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import socket
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch

from hybridtune.errors import ModelError, OutputDirError
from hybridtune.files import honour_umask_tree
from hybridtune.run import checkpoint as ckpt
from hybridtune.run import disk, write_errors

logger = logging.getLogger(__name__)

WRITER_TAG = "atomic_dir pid"  # what atomic_dir writes into its temporary directory's marker
_CHUNK = 1 << 24  # elements checked at a time: a bounded temporary, whatever the tensor's size


class NonFiniteError(ModelError):
    """Weights about to be written hold NaN or Inf: refused before anything is written."""


def refuse_non_finite(state: Mapping[str, object], what: str, out: Path) -> None:
    """NonFiniteError (one line: the first tensor with NaN/Inf, how many values, what to do) unless every floating
    tensor of `state` is finite; tensors on the meta device and non-tensors are skipped."""
    bad, first, count = 0, None, 0
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.device.type == "meta" or not (local.is_floating_point() or local.is_complex()):
            continue
        flat = local.detach().reshape(-1)
        n = sum(int((~torch.isfinite(c)).sum()) for c in flat.split(_CHUNK))
        if n:
            bad += 1
            count += n
            first = first or (name, n, flat.numel())
    if first is not None:
        name, n, numel = first
        raise NonFiniteError(
            f"refusing to write {what} to '{out}': {bad} tensor(s) hold NaN or Inf ({count} values; first {name}: "
            f"{n} of {numel}); nothing was written. Export an earlier checkpoint, or check the adapter and its base"
        )


def free_space_at(where: Path) -> Path:
    """The nearest existing directory at or above `where` (what `shutil.disk_usage` can ask about)."""
    where = Path(where).absolute()
    while not where.exists() and where.parent != where:
        where = where.parent
    return where


def check_space(where: Path, need: int, message: Callable[[int | None], str]) -> None:
    """DiskFullError(message(free)) before anything is written, when `need` bytes do not fit at `where`."""
    disk.check_free_space(free_space_at(where), need, message)


def _state(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.lstat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


@contextlib.contextmanager
def full_disk_said(what: str, out: Path, names: Iterable[str], again: str) -> Iterator[None]:
    """A full disk inside the block (DiskFullError, or an out-of-space OSError) said in one line for a command's
    user: what `what` needed against the free space of `out`'s disk, and whether any of `out`/`names` changed (each
    compared with what it was when the block began; `again`: what to do once there is room). Any other write the
    system refused (WriteError, an OSError such as EFBIG or EIO) is one line too, saying the same of what changed."""
    out = Path(out)
    before = {name: _state(out / name) for name in names}
    try:
        yield
    except write_errors.WriteError as e:
        raise write_errors.WriteError(_failed_line(what, out, before, again, e.why), e.why) from None
    except disk.DiskFullError as e:
        raise disk.DiskFullError(_full_disk_line(what, out, before, again, e.need, e.free), e.need) from None
    except OSError as e:
        if disk.is_disk_full(e, out, 0):
            raise disk.DiskFullError(_full_disk_line(what, out, before, again, None, None)) from None
        why = write_errors.failure(e)
        if why is None:
            raise
        raise write_errors.WriteError(_failed_line(what, out, before, again, why), why) from None


def _changed(out: Path, before: dict) -> str:
    changed = [f"{n}/" if (out / n).is_dir() else n for n, was in before.items() if _state(out / n) != was]
    if changed:
        return f"only {', '.join(changed)} in '{out}' changed (written before the write failed), nothing else"
    return "nothing was changed"


def _failed_line(what: str, out: Path, before: dict, again: str, why: str) -> str:
    return f"{what} failed: a write in '{out}' was refused: {why}; {_changed(out, before)}. Then {again}"


def _full_disk_line(what: str, out: Path, before: dict, again: str, need: int | None, free: int | None) -> str:
    where = free_space_at(out)
    size = f"about {disk.gib(need)}" if need is not None else "more room"
    if free is not None:  # refused before writing
        room = f"{what} needs {size} and '{where}' has {disk.gib(free)} free"
    else:
        try:
            now = f"{disk.gib(shutil.disk_usage(where).free)} free now"
        except OSError:
            now = "no space left"
        room = f"{what} ran out of space while writing ({size} was estimated; '{where}' has {now})"
    done = _changed(out, before).replace("the write failed", "the disk filled")
    return f"disk full: {room}; {done}. Free some space (or write to a larger disk) and {again}"


def write_failed(target: Path, why: str) -> str:
    """The line of a write of `target` the system refused (`why`: write_errors.failure's reason)."""
    return f"cannot write '{target}': {why}; nothing of it was kept (its partial temporary directory was removed)"


def _tag_and_hold(tmp: Path) -> int:
    """Lock the marker of temporary directory `tmp` for this process's lifetime of the write (the OS releases it
    when the process ends, however it ends), then tag it: only a tagged, unlocked marker is stale."""
    fd = os.open(tmp / ckpt.MARKER, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, f"{WRITER_TAG} {os.getpid()} on {socket.gethostname()}\n".encode("ascii", "replace"), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def atomic_dir(
    target: Path,
    write: Callable[[Path], None],
    need: int,
    message: Callable[[int | None], str],
    failed: Callable[[str], str] | None = None,
) -> Path:
    """Directory `target` written by `write(tmp)`: stale temporaries of `target` removed, `need` bytes checked
    against the free space, the write guarded for a full disk, modes per the umask, then renamed into place. An
    existing target is replaced only once the new one is complete, and only when hybridtune wrote it (or it is
    empty): OutputDirError otherwise. A full disk is DiskFullError; another write the system refused (file too
    large, I/O error) WriteError(failed(why)) (default: `write_failed`); all one line, the partial directory removed."""
    target = Path(target)
    if target.exists() and not ckpt.is_ours(target) and (not target.is_dir() or any(target.iterdir())):
        raise OutputDirError(
            f"'{target}' exists and was not written by hybridtune (no {ckpt.MARKER} marker); it is never replaced: "
            "move it away or write elsewhere"
        )
    sweep_stale(target.parent, target.name)
    check_space(target.parent, need, message)
    held: list[int] = []

    def held_write(tmp: Path) -> None:
        held.append(_tag_and_hold(tmp))
        write(tmp)
        honour_umask_tree(tmp)

    said = failed or (lambda why: write_failed(target, why))
    try:
        return ckpt.atomic_dir(target, write_errors.guard(held_write, need, message, said))
    except OSError as e:  # around the write: its temporary directory made (a read-only disk), the commit's renames
        if disk.is_disk_full(e, target.parent, need):
            raise disk.DiskFullError(message(None), need) from None
        if (why := write_errors.failure(e)) is None:
            raise
        raise write_errors.WriteError(said(why), why) from None
    finally:
        for fd in held:
            os.close(fd)


def _held_by_a_live_writer(marker: Path) -> bool:
    try:
        fd = os.open(marker, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return True  # cannot tell: leave it
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode) or not os.pread(fd, 64, 0).startswith(WRITER_TAG.encode()):
            return True  # untagged: a write that has not taken its lock yet, or not atomic_dir's
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        return False
    finally:
        os.close(fd)


def sweep_stale(parent: Path, name: str) -> list[str]:
    """Remove the `.tmp-<name>-*` directories in `parent` that `atomic_dir` made and whose writer is gone (a process
    killed mid-write); never a link, never a directory without our tagged marker, never one a live process holds.
    Returns the names removed (and says so)."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    removed = []
    for p in sorted(parent.glob(f"{ckpt.TMP_PREFIX}{name}-*")):
        if p.is_symlink() or not p.is_dir() or not (p / ckpt.MARKER).is_file():
            continue
        if _held_by_a_live_writer(p / ckpt.MARKER):
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p.name)
    if removed:
        logger.info("removed %d stale temporary dir(s) of an interrupted write in %s: %s", len(removed), parent,
                    ", ".join(removed))  # fmt: skip
    return removed


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """SIGTERM (and SIGINT) raise KeyboardInterrupt inside the block, once: the atomic writes in flight remove their
    temporary directories on the way out; a repeated signal during that cleanup is noted, not acted on. Main thread
    only (elsewhere the block runs unchanged)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[str] = []

    def handler(signum, frame) -> None:
        if fired:
            logger.warning("%s: removing the temporary files first", signal.Signals(signum).name)
            return
        fired.append(signal.Signals(signum).name)
        raise KeyboardInterrupt

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
