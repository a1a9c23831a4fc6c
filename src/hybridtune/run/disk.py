"""Room on the disk for a save: its size estimated, the write refused before it starts when it cannot fit, and a
failed write told apart as a full disk, each said in one line.

`state_bytes` sizes what a DCP save writes over the ranks; `check_free_space` refuses a save that cannot fit before
anything is written; `is_disk_full` tells a failed write from other errors (ENOSPC anywhere in its causes, or a short
write on a disk now too small), so that the save reports the full disk in one line (`DiskFullError`);
`disk_full_message` and `write_failed_message` say what was kept and what to do.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from hybridtune.errors import UserError
from hybridtune.runtime import distributed
from hybridtune.runtime.distributed import ONE, Dist

SLACK_BYTES = 256 * 2**10  # per rank, beyond the tensors: RNG and trainer state, JSON, file headers
ENTRY_BYTES = 1024  # per tensor or value saved: its entry in DCP's metadata (about 350 bytes each)


class DiskFullError(UserError):
    """A save does not fit on the output directory's disk; the previous checkpoint is intact. `need`: the bytes the
    write was estimated at; `free`: the free bytes when it was refused before writing (None: it failed midway)."""

    def __init__(self, message: str, need: int | None = None, free: int | None = None) -> None:
        super().__init__(message)
        self.need, self.free = need, free


def state_bytes(*states, d: Dist = ONE) -> int:
    """The bytes a DCP save of `states` writes over all ranks, estimated from their tensors (plus slack).

    Sharded (FSDP2) ranks each write their own shard: summed. Replicated (DDP, one process) state is written once.
    """
    mine = 0

    def visit(x) -> None:
        nonlocal mine
        mine += ENTRY_BYTES
        if isinstance(x, torch.Tensor):
            local = x.to_local() if hasattr(x, "to_local") else x
            mine += local.numel() * local.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    for s in states:
        visit(s)
    if d.enabled:
        total = distributed.all_sum([float(mine)], d)[0] if d.engine == "fsdp" else distributed.all_max(mine, d)
        return int(total) + SLACK_BYTES * d.world
    return mine + SLACK_BYTES


def gib(n: float) -> str:
    if n >= 2**28:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{int(n)} bytes"


def _kept_then(previous: Path | None) -> tuple[str, str]:
    if previous is not None:
        return f"the previous checkpoint {previous.name} is intact", "continue with --resume_from_checkpoint latest"
    return "no earlier checkpoint exists, so the run starts again", "run again"


def disk_full_message(target: Path, need: int, free: int | None, previous: Path | None) -> str:
    where = Path(target).parent
    has = f"{gib(free)} free" if free is not None else "no space left"
    kept, then = _kept_then(previous)
    return (
        f"disk full: saving {Path(target).name} needs about {gib(need)} and '{where}' has {has}; {kept}. Free "
        f"some space (or lower save_total_limit, or use an output_dir on a larger disk) and {then}"
    )


def write_failed_message(target: Path, why: str, previous: Path | None) -> str:
    """A save the system refused for another reason than space (run/write_errors.py: `why` names the errno)."""
    kept, then = _kept_then(previous)
    return (
        f"cannot write {Path(target).name} in '{Path(target).parent}': {why}; nothing of it was kept and {kept}; {then}"
    )


def check_free_space(where: Path, need: int, message: Callable[[int | None], str]) -> None:
    """Refuse a write of about `need` bytes into directory `where` before anything is written, when it cannot fit:
    DiskFullError(message(free bytes))."""
    free = shutil.disk_usage(where).free
    if free < need:
        raise DiskFullError(message(free), need, free)


_WRITE_FAILED = ("unexpected pos", "failed writing", "file write failed", "no space left")


# The text of an out-of-space error where it comes as a plain Exception (safetensors: `IoError(Os { code: 28, kind:
# StorageFull, ... })`) rather than an OSError with its errno.
_NO_SPACE = ("no space left on device", "storagefull", "disk quota exceeded", "os error 28", "code: 28")


def is_disk_full(exc: BaseException, where: Path, need: int) -> bool:
    """Whether a save failed for lack of space; call it while the partial save is still on the disk.

    ENOSPC or EDQUOT anywhere in the causes (DCP wraps every rank's failure), its text in an error that carries no
    errno (safetensors), or a short write (torch.save's
    zip writer says 'unexpected pos') on a disk that now has less room than the whole save needs.
    """
    for e in causes(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(s in str(e).lower() for s in _NO_SPACE):
            return True
        if isinstance(e, (RuntimeError, OSError)) and any(s in str(e).lower() for s in _WRITE_FAILED):
            try:
                if shutil.disk_usage(where).free < need:
                    return True
            except OSError:
                pass
    return False


def causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and every exception behind it, each once: causes, contexts and each rank's failure DCP wraps."""
    from torch.distributed.checkpoint.api import CheckpointException

    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, CheckpointException):
            todo += [f[0] for f in e.failures.values()]
        todo += [e.__cause__, e.__context__]
