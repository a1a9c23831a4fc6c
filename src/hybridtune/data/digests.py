"""What a run's data is, as digests: the local files a data path reads (`local_files`) and their sha256
(`data_digest`), which the run record (run/outdir.py) and the tokenisation cache key (`sources.Source.fingerprint`)
both take, so a start-up inside `one_read()` reads its data once for them."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import itertools
from collections.abc import Callable
from pathlib import Path


def visible_files(directory: Path) -> list[Path]:
    """The files under `directory` that a dataset directory is read from (hidden ones skipped), sorted."""
    return sorted(
        f
        for f in directory.rglob("*")
        if f.is_file() and not any(x.startswith(".") for x in f.relative_to(directory).parts)
    )


# Digests kept while `one_read()` is open (a run's start-up: its run record, then its tokenisation cache key, hash
# the same data): key -> hex. None: nothing is kept (each call reads its files).
_DIGESTS: dict[tuple, str] | None = None


@contextlib.contextmanager
def one_read():
    """Inside, each data digest below is computed once per file set and kept by the files' identities (path,
    device, inode, size, modification time, and the name given), so the data is read once however many parts of
    the start-up ask."""
    global _DIGESTS
    outer, _DIGESTS = _DIGESTS, {} if _DIGESTS is None else _DIGESTS
    try:
        yield
    finally:
        _DIGESTS = outer


def _kept(key: tuple, files: list[Path], compute: Callable[[], str]) -> str:
    if _DIGESTS is None:
        return compute()
    ids = []
    for f in files:
        st = f.stat()
        # the name as given too: a glob's digest hashes the names, and two names may resolve to one file
        ids.append((str(f), str(f.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    key = (*key, tuple(ids))
    if key not in _DIGESTS:
        _DIGESTS[key] = compute()
    return _DIGESTS[key]


def sha256_files(files: list[Path], root: Path | None = None) -> str:
    """sha256 over `files` in order: each one's name under `root` (empty without one) and a NUL, then its content."""

    def compute() -> str:
        h = hashlib.sha256()
        for f in files:
            h.update(str(f.relative_to(root) if root else "").encode() + b"\0")
            with f.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
        return h.hexdigest()

    return _kept(("files", str(root) if root else None), files, compute)


def file_sha256(path: Path) -> str:
    """The plain sha256 of one file's content, read now (run/integrity.py checks checkpoints with it)."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)  # releases the GIL: threads hash files in parallel
    return h.hexdigest()


def content_sha256(path: Path) -> str:
    """`file_sha256`, kept inside `one_read()`."""
    return _kept(("file",), [path], lambda: file_sha256(path))


def local_files(path: str) -> tuple[list[Path], Path | None]:
    """The local files a data path reads, as `open_source` reads them (the file itself, a directory's files bar
    hidden ones, a glob's matches; none for bundled data or a dataset id), and the folder their names are taken
    relative to (None: a single file, whose name does not count)."""
    p = Path(path).expanduser()
    if p.is_file():
        return [p], None
    if p.is_dir():
        return visible_files(p), p
    if glob.has_magic(path):
        root = Path(*[part for part in itertools.takewhile(lambda x: not glob.has_magic(x), p.parts)] or ["."])
        return sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file()), root
    return [], None


def data_digest(files: list[Path], root: Path | None) -> str:
    """What a run records of its local data (`local_files`): a single file's plain sha256, else `sha256_files`
    with the names under `root`. The tokenisation cache keys on the same digest, so a start-up reads its data once."""
    return sha256_files(files, root) if root is not None else content_sha256(files[0])
