"""Writing files so that nothing half-written is ever read, no planted link is ever followed, and modes follow the
umask.   [leaf]

The one place for a file's atomic write: checkpoints and run records (run), the tokenisation cache (data), bench
results, and the kernels' caches and tables (kernels) all use it, so it sits below every layer. A temporary file is
always new (O_CREAT | O_EXCL | O_NOFOLLOW, a random name in the target's directory), fsynced, then renamed over the
target: a link planted at any name is never written through, and the rename replaces a link at the target itself,
not what it points at. `open_regular` reads a file only when it is a regular file (never a link, FIFO or device).
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TMP_SUFFIX = ".tmp"
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_READ = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def umask() -> int:
    """This process's umask (read without changing it where /proc tells it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(path: Path, directory: bool) -> None:
    """Give `path` (made 0700/0600 by tempfile) the mode a plain mkdir/open would have given it."""
    os.chmod(path, (0o777 if directory else 0o666) & ~umask())


def honour_umask_tree(root: Path) -> None:
    """Give every directory and regular file under `root` (and `root`) the mode the umask gives a plain
    mkdir/open (safetensors writes 0600); links are left alone (chmod would follow them)."""
    root = Path(root)
    honour_umask(root, directory=True)
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            mode = os.lstat(p).st_mode
            if stat.S_ISDIR(mode) or stat.S_ISREG(mode):
                honour_umask(p, directory=stat.S_ISDIR(mode))


def create_new(path: Path) -> int:
    """A file descriptor (write only) of a file created at `path` now: never an existing file nor a link's target
    (FileExistsError, or OSError ELOOP for a link). Its mode is what a plain open gives under the umask."""
    return os.open(path, _NEW, 0o666)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse a directory fsync: the rename is still atomic
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write file `path` through `write(f)` (a binary file object) so that a reader sees the old content or the new,
    never half a file: a new temporary `.<name>.<random>.tmp` beside it (`create_new`), fsynced, renamed over it.
    The temporary is removed when `write` fails or the process is interrupted."""
    path = Path(path)
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}{TMP_SUFFIX}"
        try:
            fd = create_new(tmp)
            break
        except FileExistsError:  # a name someone else holds (or planted): take another
            continue
    else:
        raise FileExistsError(f"cannot create a temporary file beside '{path}'")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: Path, text: str) -> None:
    """Write a small text file (UTF-8) atomically; see `atomic_write`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading when it is a regular file; OSError otherwise: a link (never followed), a FIFO (it
    would block for ever), a device or a directory."""
    fd = os.open(path, _READ)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"'{path}' is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular_text(path: Path) -> str:
    """The UTF-8 text of `path` when it is a regular file (`open_regular`: never a FIFO, which would block for ever,
    a device or a link); OSError otherwise, UnicodeDecodeError for bytes that are not UTF-8."""
    with open_regular(path) as f:
        return f.read().decode("utf-8")
