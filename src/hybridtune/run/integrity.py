"""What makes a checkpoint safe to resume: checksums and loading that runs no code (room on the disk: `disk.py`).

- Checksums. `checkpoint.json` lists every other file of the checkpoint with its size and sha256, written at
  save once every file is complete and before the atomic rename. `verify` checks them all (split over the ranks)
  before anything of the checkpoint is read; a missing, truncated, changed, added or linked file fails it.
- No code runs on load. `trainer_state.pt` and `rng-<rank>.pt` hold only tensors and plain values and load with
  `torch.load(weights_only=True)`. DCP's `state/.metadata` is a pickle: it is read only after its checksum
  matched, and then by an unpickler that builds DCP's own metadata classes and nothing else (`SafeReader`);
  DCP's non-tensor entries (the optimizer's hyperparameters) load with `weights_only=True` (`SafePlanner`).
  A checkpoint from someone else can therefore fail to load, but cannot run code when it is loaded, even with a
  forged `checkpoint.json`.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from hybridtune.data.digests import file_sha256  # (the threads below hash files in parallel)
from hybridtune.errors import UserError
from hybridtune.files import read_regular_text
from hybridtune.runtime import distributed
from hybridtune.runtime.distributed import ONE, Dist

FORMAT = 2  # checkpoint.json "format": 2 lists "files" with their checksums


class CheckpointError(UserError):
    """A checkpoint is incomplete, corrupt, changed since it was saved, or holds something unsafe to load."""


# -- checksums ---------------------------------------------------------------------------------------------


def hash_files(root: Path, rels: list[str]) -> dict[str, dict]:
    """`{rel: {"bytes": n, "sha256": hex}}` for the files `rels` under `root`."""

    def one(rel: str) -> tuple[str, dict]:
        p = root / rel
        return rel, {"bytes": p.stat().st_size, "sha256": file_sha256(p)}

    if not rels:
        return {}
    with ThreadPoolExecutor(max_workers=min(len(rels), os.cpu_count() or 1, 8)) as pool:
        return dict(pool.map(one, rels))


def _walk(root: Path) -> tuple[list[str], list[str]]:
    """Every regular file under `root` (relative, sorted) and every entry that is not one (links, devices)."""
    files, odd = [], []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            mode = os.lstat(p).st_mode
            rel = p.relative_to(root).as_posix()
            if stat.S_ISREG(mode):
                files.append(rel)
            elif not stat.S_ISDIR(mode):
                odd.append(rel)
    return sorted(files), sorted(odd)


def manifest(root: Path, exclude: set[str], d: Dist = ONE) -> dict[str, dict]:
    """Checksums of every file under `root` but `exclude`, each rank hashing its share; a collective."""
    files = [f for f in _walk(root)[0] if f not in exclude]
    mine = hash_files(root, distributed.my_share(d, files))
    out: dict[str, dict] = {}
    for part in distributed.gather_objects(mine, d):
        out.update(part)
    return dict(sorted(out.items()))


def file_problem(root: Path, rel: str, want: dict) -> str | None:
    """Why file `rel` under `root` is not the one `want` ({bytes, sha256}) describes, or None."""
    p = root / rel
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return f"{rel} is missing"
    if not stat.S_ISREG(st.st_mode):
        return f"{rel} is not a regular file (a checkpoint holds only regular files)"
    if st.st_size != want.get("bytes"):
        return f"{rel} is {st.st_size} bytes, checkpoint.json says {want.get('bytes')} (truncated or changed)"
    if file_sha256(p) != want.get("sha256"):
        return f"{rel} does not match its sha256 in checkpoint.json (corrupt, or changed since it was saved)"
    return None


def check(path: Path, meta_file: str, required: tuple[str, ...], d: Dist = ONE) -> str | None:
    """Why checkpoint `path` must not be loaded, or None when every file matches `meta_file`'s checksums and its
    DCP metadata (state/.metadata) is DCP's own.

    A collective: each rank hashes its share of the files and every rank returns the same answer.
    """
    path = Path(path)
    try:
        meta = _read_meta(path / meta_file, meta_file)
        files = meta.get("files")
        if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
            raise CheckpointError(
                f"{meta_file} lists no checksums: written by an older hybridtune, so it cannot be verified, and "
                "loading its pickled files unverified could run code; resume it with the hybridtune that wrote "
                "it, or start a new run"
            )
        for rel in files:
            if Path(rel).is_absolute() or ".." in Path(rel).parts:
                raise CheckpointError(f"{meta_file} lists '{rel}', a path outside the checkpoint")
        for rel in required:
            if rel not in files:
                raise CheckpointError(f"{meta_file} does not list {rel}")
        present, odd = _walk(path)
        extra = [f for f in present if f not in files and f != meta_file]
        if odd:
            raise CheckpointError(f"{odd[0]} is not a regular file (a checkpoint holds only regular files)")
        if extra:
            raise CheckpointError(f"{extra[0]} is not listed in {meta_file} (added after the save)")
        local = None
    except CheckpointError as e:
        local = str(e)
    except OSError as e:
        local = f"cannot be read: {e}"
    first = distributed.gather_objects(local, d)[0] if d.enabled else local
    if first is not None:
        return first
    names = sorted(files)
    mine = [(rel, file_problem(path, rel, files[rel])) for rel in distributed.my_share(d, names)]
    found = [why for part in distributed.gather_objects(mine, d) for _, why in part if why]
    if found:
        return sorted(found)[0]
    # Checksums prove only that the files are the ones checkpoint.json lists, which whoever wrote it chose: DCP's
    # metadata must also be DCP's (every rank reads the same file, so every rank answers the same).
    listed = set(files)
    return _metadata_problem(path / DCP_METADATA, listed) if DCP_METADATA in files else None


DCP_METADATA = "state/.metadata"


def _metadata_problem(p: Path, listed: set[str]) -> str | None:
    try:
        confine_storage(read_dcp_metadata(p.read_bytes()), lambda name: f"state/{name}" in listed)
    except CheckpointError as e:
        return str(e)
    except OSError as e:
        return f"{DCP_METADATA} cannot be read: {e}"
    return None


def confine_storage(md, allowed: Callable[[str], bool]) -> None:
    """Refuse DCP metadata that would read a file other than the checkpoint's own: every storage entry's
    `relative_path` must be a plain file name (no directory part, not absolute) that `allowed` accepts."""
    # Many storage entries share a file: each distinct name is checked (and, at read time, stat'ed) once.
    for name in {getattr(info, "relative_path", None) for info in getattr(md, "storage_data", {}).values()}:
        if not isinstance(name, str) or not name or name in (".", "..") or Path(name).name != name or "\\" in name:
            raise CheckpointError(
                f"{DCP_METADATA} points a read at {str(name)[:200]!r}, which is not a file of the checkpoint's state/; "
                "refused (a checkpoint reads only its own files)"
            )
        if not allowed(name):
            raise CheckpointError(
                f"{DCP_METADATA} points a read at '{name}', which checkpoint.json does not list; refused (a checkpoint "
                "reads only its own files)"
            )


def meta_problem(p: Path) -> str | None:
    """Why a checkpoint's checkpoint.json `p` cannot be read as the JSON object a save writes, or None (cheap: no
    checksum is checked)."""
    try:
        _read_meta(p, p.name)
    except CheckpointError as e:
        return str(e)
    except OSError as e:
        return f"{p.name} cannot be read ({e.strerror or e})"
    return None


def _read_meta(p: Path, name: str) -> dict:
    import json

    try:
        meta = json.loads(read_regular_text(p))
    except FileNotFoundError:
        raise CheckpointError(f"{name} is missing (the checkpoint is incomplete)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{name} is not valid JSON ({e})") from None
    except RecursionError:  # (arrays or objects nested past Python's recursion limit: never what a save writes)
        raise CheckpointError(f"{name} is not the JSON a save writes (nested too deeply to read)") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{name} is not a JSON object")
    return meta


# -- loading without running code -----------------------------------------------------------------------------


def load_plain(path: Path):
    """A `.pt` file of tensors and plain values; anything else (a pickled object) is refused, never run."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path.name} holds objects other than tensors and plain values; refused, since loading it could run "
            f"code ({str(e).splitlines()[0]})"
        ) from None
    except (OSError, RuntimeError, EOFError) as e:
        raise CheckpointError(f"{path.name} cannot be read ({str(e).splitlines()[0]})") from None


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP_METADATA, n)
    for n in (
        "Metadata",
        "MetadataIndex",
        "ChunkStorageMetadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata dataclasses, torch.Size, dtypes and paths; any other global is refused."""

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not part of DCP's metadata")


def read_dcp_metadata(data: bytes):
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:
        raise CheckpointError(f"state/.metadata is refused: {e} (loading it could run code)") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"state/.metadata holds a {type(md).__name__}, not DCP metadata")
    return md


def _safe_reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        """DCP's file reader, whose metadata comes from `read_dcp_metadata` instead of `pickle.load`."""

        def read_metadata(self, *args, **kwargs):
            if kwargs.get("rank") is not None:
                raise CheckpointError("state/ has per-rank metadata, which hybridtune never writes")
            with self.fs.create_stream(self.fs.concat_path(self.path, ".metadata"), "rb") as f:
                md = read_dcp_metadata(f.read())
            # Only regular files of this state/ directory (never a FIFO, a link out, or a path elsewhere).
            root = Path(self.path)
            confine_storage(md, lambda name: (root / name).is_file() and not (root / name).is_symlink())
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return SafeReader


def _safe_planner_class():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        """DCP's load planner, whose non-tensor entries must load with weights_only=True first."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                torch.load(value, weights_only=True)
            except pickle.UnpicklingError:
                raise CheckpointError(
                    f"state/ entry '{read_item.dest_index.fqn}' holds a pickled object; refused, since loading it "
                    "could run code"
                ) from None
            value.seek(0)
            super().load_bytes(read_item, value)

    return SafePlanner


def safe_dcp_load(state: dict, state_dir: Path) -> None:
    """`dcp.load(state)` from `state_dir` through `SafeReader` and `SafePlanner`; DCP's failures come back as
    the CheckpointError that caused them, or one CheckpointError naming the first rank's failure."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=_safe_reader_class()(str(state_dir)), planner=_safe_planner_class()())
    except CheckpointException as e:
        causes = [exc for exc, _ in e.failures.values()]
        ours = [c for c in causes if isinstance(c, CheckpointError)]
        if ours:
            raise ours[0] from None
        first = causes[0] if causes else e
        reason = str(first).strip() or _NO_REASON.get(type(first), "no reason given")
        raise CheckpointError(f"state/ cannot be loaded: {type(first).__name__}: {reason}") from None


# What a DCP read failure that gives no text of its own means (an EOFError: a read past the end of a file).
_NO_REASON = {
    EOFError: "a read ran past the end of a file of state/ (its metadata names an offset or length beyond the file: "
    "edited or truncated after the save); resume from another checkpoint"
}
