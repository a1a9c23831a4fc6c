"""Writing files so that nothing half-written is ever read and modes follow the umask.   [leaf]

The one place for a small atomic write: checkpoints and run records (train), bench results, and the kernels' caches
and tables (kernels) all use it, so it sits below every layer.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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


def atomic_write_text(path: Path, text: str) -> None:
    """Write a small file so that a reader sees the old content or the new, never a half-written file.

    The temporary file is new (O_EXCL, a unique name beside `path`), so a link planted at any name is never
    followed; the rename replaces a link at `path` itself, not its target. The mode follows the umask.
    """
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        honour_umask(Path(name), directory=False)
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
