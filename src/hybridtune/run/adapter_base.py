"""The base of a LoRA adapter: what an export records in adapter_config.json, and which base a load or merge uses.

Recorded: a hub id as named (with the commit it resolved to); a preset's `base_model/`, written beside `final/`,
relative to the adapter (`../base_model`), so that a copied, moved or archived run keeps pointing at its own base;
a local checkpoint directory of the user's, absolute (it does not travel with the run).
Used (`adapter_base`): the `base_model/` shipped inside or beside the adapter first, with one warning line when the
record names something else; else the record, a relative path read against the adapter directory (then the
working directory, as peft reads it), a hub id or a preset name. Both `hybridtune merge` and the loader of
generate, chat, eval and export go through it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from hybridtune.errors import ModelError
from hybridtune.models.loading import LoadedModel

logger = logging.getLogger(__name__)

BASE_DIR = "base_model"  # a preset's base weights, written beside final/ (run/export.py)


def record(loaded: LoadedModel, base_dir: Path | None, adapter_dir: Path) -> tuple[str, str | None]:
    """(base_model_name_or_path, revision) for the adapter written to `adapter_dir`: `base_dir` (the base saved
    beside it) relative to `adapter_dir`; a hub id as named with its commit; a local directory made absolute."""
    if base_dir is not None:
        return Path(os.path.relpath(base_dir.absolute(), adapter_dir.absolute())).as_posix(), None
    if loaded.revision is not None:  # a hub id
        return loaded.name, loaded.revision
    return str(Path(loaded.name).expanduser().absolute()), None


def shipped(adapter_dir: Path) -> Path | None:
    """The `base_model/` inside the adapter directory or beside it (a run's output directory), when it holds one."""
    for d in (adapter_dir / BASE_DIR, adapter_dir.parent / BASE_DIR):
        if (d / "config.json").is_file():
            return d
    return None


def recorded_dir(adapter_dir: Path, recorded) -> Path | None:
    """The local directory `recorded` names: an absolute path; a relative one against the adapter directory, else
    against the working directory (where peft, and adapters written by other tools, read it). None otherwise."""
    if not isinstance(recorded, str) or not recorded:
        return None
    p = Path(recorded).expanduser()
    for candidate in [p] if p.is_absolute() else [adapter_dir / p, p]:
        if candidate.is_dir():
            return candidate
    return None


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def adapter_base(adapter_dir: Path, recorded, config_file: Path) -> str:
    """The base to load the adapter of `adapter_dir` onto (see the module docstring): a local directory, or a
    preset or hub id as recorded (which the caller resolves). `recorded`: its `base_model_name_or_path`. A
    ModelError (one line) when there is none."""
    beside = shipped(adapter_dir)
    local = recorded_dir(adapter_dir, recorded)
    if beside is not None:
        if local is not None and not _same(local, beside):
            logger.warning(
                "the adapter %s records base %r, another directory than the %s/ shipped beside it: using %s (edit "
                "base_model_name_or_path in %s to choose the other)", adapter_dir, recorded, BASE_DIR, beside,
                config_file,
            )  # fmt: skip
        elif local is None and isinstance(recorded, str) and recorded:
            logger.warning(
                "the adapter %s records base %r, which is not a directory here; using the %s/ shipped beside it (%s)",
                adapter_dir, recorded, BASE_DIR, beside,
            )  # fmt: skip
        return str(beside)
    if local is not None:
        return str(local)
    if isinstance(recorded, str) and recorded and not Path(recorded).expanduser().is_absolute():
        if not recorded.startswith((".", "~")):
            return recorded  # a preset or hub id: the caller's loader says whether it exists
    raise ModelError(
        f"the adapter's base model {recorded!r} is not a local directory and no {BASE_DIR}/ lies beside "
        f"'{adapter_dir}'; edit base_model_name_or_path in {config_file}"
    )
