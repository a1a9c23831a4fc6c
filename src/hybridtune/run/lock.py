"""The output directory's lock: one hybridtune run in a directory at a time (an exclusive `flock`, released by the
operating system however the process ends), and a refused run leaves nothing of the lock behind."""

from __future__ import annotations

import fcntl
import os
import socket
import stat
from pathlib import Path

from hybridtune.errors import OutputDirError

LOCK_FILE = ".hybridtune.lock"


class OutputLock:
    """An exclusive lock on the output directory for the whole run (rank 0): a second run into the same directory
    is refused while this one lives. The operating system releases it when the process ends, however it ends.
    `release(discard=True)` (a run refused or failed before writing anything) also removes the lock file and the
    directories that taking the lock created, so a refused run leaves nothing behind."""

    def __init__(self, out: Path):
        self.fd = None
        self.made: list[Path] = []  # directories created here, deepest first
        probe = out
        while not probe.exists() and probe.parent != probe:
            self.made.append(probe)
            probe = probe.parent
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / LOCK_FILE
        self.made_file = not self.path.exists()
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)  # never through a planted link
        try:
            self.fd = os.open(self.path, flags, 0o666)
        except OSError as e:
            self.release(discard=True)
            raise OutputDirError(
                f"output_dir '{out}': cannot create its lock file {self.path} ({e.strerror})"
            ) from None
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):
            self.made_file = False
            self.release()
            raise OutputDirError(f"output_dir '{out}': its lock file {self.path} is not a plain file; move it away")
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self.fd, 200, 0).decode("ascii", "replace").strip() or "another process"
            self.made_file = False  # the holder's
            self.release()
            raise OutputDirError(
                f"output_dir '{out}' is in use by another hybridtune run ({holder}); wait for it to end, or choose "
                "another --output_dir"
            ) from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()}".encode("ascii", "replace"), 0)

    def release(self, discard: bool = False) -> None:
        if getattr(self, "fd", None) is not None:
            if discard and self.made_file:
                self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None
        if discard:
            for d in self.made:
                try:
                    d.rmdir()  # only when empty: nothing else was written
                except OSError:
                    break
            self.made = []

    def __del__(self) -> None:  # a trainer set up and dropped without training lets go too
        self.release()
