"""Where a command may write: never a filesystem root or the home directory, never into a checkpoint or a run's
final/ or base_model/; checked by train (run/outdir.py), export and merge before anything is written, even under
--overwrite."""

from __future__ import annotations

from pathlib import Path

from hybridtune.errors import OutputDirError
from hybridtune.run import checkpoint as ckpt
from hybridtune.run.export import BASE_DIR, FINAL_DIR

RUN_FILE = "hybridtune_run.json"  # a run's record in its output directory (run/outdir.py)


def refuse_system_dir(out: Path, what: str) -> None:
    """A filesystem root or the home directory is never a run's output directory (train, export, merge), not even with
    --overwrite: a run writes checkpoint-N/, final/, its record and lock beside whatever is there."""
    try:
        target, home = Path(out).expanduser().resolve(), Path.home().resolve()
    except (OSError, RuntimeError):  # a link loop: the caller's own checks say what it is
        return
    if target.parent == target or target == home:
        kind = "the root directory" if target.parent == target else "your home directory"
        raise OutputDirError(
            f"{what} '{out}' is {kind}; a run, export or merge writes its own files there (final/, checkpoints, its "
            "record and lock), so it is refused even with --overwrite: give a directory of its own, e.g. "
            f"'{target / 'runs' / 'x'}'"
        )


def refuse_run_part(out: Path, what: str) -> None:
    """A directory that is, or lies inside, a checkpoint or a run's final/ or base_model/ is never written into (train,
    export, merge), not even with --overwrite: files added there fail the checkpoint's checksums or replace the run's
    model. Checked before anything is written."""
    target = Path(out).expanduser().absolute()
    try:
        real = target.resolve()  # (a link named otherwise to a checkpoint or final/ is what it points at)
    except (OSError, RuntimeError):
        real = target
    for d in dict.fromkeys((target, *target.parents, real, *real.parents)):
        if (d / ckpt.META_FILE).is_file():
            kind = "a training checkpoint"
        elif d.name in (FINAL_DIR, BASE_DIR) and (d.parent / RUN_FILE).is_file():
            kind = f"a run's {d.name}/"
        else:
            continue
        where = "is" if d == target else f"lies inside '{d}',"
        raise OutputDirError(
            f"{what} '{out}' {where} {kind}, which a write there would damage (refused even with --overwrite); give "
            "a directory of its own"
        )
