"""A write the system refused, said in one line: no space (disk.DiskFullError), and every other refusal a save,
an export or a merge can meet (a file larger than `ulimit -f` or the filesystem allows, an I/O error, a read-only
filesystem, no permission). torch.save says only "unexpected pos" and safetensors "os error 27"; `failure` names
the errno and what to do. `guard` wraps the write of an atomic directory, whose caller then removes the partial
temporary directory: nothing half-written is left. Anything that is not a refused write (a bug) passes unchanged.
"""

from __future__ import annotations

import errno
import os
import re
import resource
from collections.abc import Callable
from pathlib import Path

from hybridtune.run import disk
from hybridtune.run.disk import DiskFullError

# What to do about each errno a write can be refused with (ENOSPC and EDQUOT are DiskFullError's).
HINTS = {
    errno.EFBIG: "raise the file-size limit (ulimit -f) or write to a filesystem that holds larger files (FAT32 and "
    "exFAT stop at 4 GiB)",
    errno.EIO: "the disk failed the write: check it (dmesg) or write to another disk",
    errno.EROFS: "the filesystem is read-only: write to a writable one",
    errno.EACCES: "no permission to write there: write to a directory you own",
    errno.EPERM: "no permission to write there: write to a directory you own",
    errno.ENAMETOOLONG: "a name is too long for this filesystem: write to a shorter path",
    errno.ENOTDIR: "a part of the path is a file, not a directory: give another path",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n)",
    errno.ENFILE: "too many open files on this machine: close some and run again",
}
_CODE = re.compile(r"(?:os error|code:?)\s*(\d+)", re.IGNORECASE)  # safetensors' "(os error 27)", "Os { code: 27"
_SHORT = ("unexpected pos", "failed writing", "file write failed")  # torch.save's zip writer: a short write


class WriteError(DiskFullError):
    """A write the system refused (see the module doc); a DiskFullError, so that the trainer treats a last checkpoint
    it cannot write as one that does not fit (final/ is written anyway). `why`: the reason with its errno."""

    def __init__(self, message: str, why: str = "") -> None:
        super().__init__(message)
        self.why = why


def _said(code: int) -> str:
    name = errno.errorcode.get(code, str(code))
    hint = HINTS.get(code, "check the disk, or write elsewhere")
    return f"{os.strerror(code)} ({name}); {hint}"


def file_size_limit() -> int | None:
    """This process's file-size limit in bytes (`ulimit -f`), or None when there is none."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def failure(exc: BaseException) -> str | None:
    """Why a write failed, with its errno and what to do, when `exc` (or a cause) is a write the system refused; None
    for anything else. A short write that names no errno is EFBIG under a file-size limit, else said as it is."""
    from safetensors import SafetensorError

    short = None
    for e in disk.causes(exc):
        if isinstance(e, OSError) and e.errno is not None and e.errno not in (errno.ENOENT, errno.EEXIST):
            return _said(e.errno)
        text = str(e)
        if isinstance(e, SafetensorError) and (m := _CODE.search(text)):
            return _said(int(m.group(1)))
        if isinstance(e, RuntimeError) and any(s in text.lower() for s in _SHORT):
            short = short or text.strip().splitlines()[0][:200]
    if short is None:
        return None
    limit = file_size_limit()
    if limit is not None:
        return f"{_said(errno.EFBIG)} (a file reached this process's limit of {disk.gib(limit)})"
    return f"a write stopped short ({short}); check the disk, or write elsewhere"


def guard(
    write: Callable[[Path], None],
    need: int,
    message: Callable[[int | None], str],
    failed: Callable[[str], str],
) -> Callable[[Path], None]:
    """`write(tmp)` with a failure for lack of space turned into DiskFullError(message(None)) and any other write the
    system refused into WriteError(failed(why)); the caller's atomic write then removes the partial temporary
    directory. Interrupts and other errors pass through unchanged."""

    def run(tmp: Path) -> None:
        try:
            write(tmp)
        except (KeyboardInterrupt, SystemExit):
            raise
        except DiskFullError:
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if disk.is_disk_full(e, tmp.parent, need):  # asked while the partial write is still there
                raise DiskFullError(message(None), need) from None
            why = failure(e)
            if why is None:
                raise
            raise WriteError(failed(why), why) from None

    return run
