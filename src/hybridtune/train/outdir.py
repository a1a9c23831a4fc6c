"""The output directory's policy: which run a directory holds, when a new run may start in it, and the run file
that says what computed its contents."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import hybridtune
from hybridtune.config import TrainConfig, to_dict
from hybridtune.errors import OutputDirError
from hybridtune.train import checkpoint as ckpt

logger = logging.getLogger(__name__)

RUN_FILE = "hybridtune_run.json"
# Keys that do not change what a run computes: a run may continue or resume under other values.
NON_IDENTITY_KEYS = (
    "overwrite",
    "resume_from_checkpoint",
    "max_steps",
    "eval_steps",
    "save_steps",
    "logging_steps",
    "profile_steps",
    "num_threads",
    "distributed",
    "fsdp_units",
)


def identity(config: dict) -> dict:
    """What a run computes: its config (as a dict) without the keys that do not change it."""
    return {k: v for k, v in config.items() if k not in NON_IDENTITY_KEYS}


def check_output_dir(cfg: TrainConfig) -> bool:
    """Refuse an output_dir that holds a different run. Returns True when metrics should start fresh."""
    out = Path(cfg.output_dir)
    if cfg.resume_from_checkpoint:
        return False
    if not out.exists() or not any(out.iterdir()):
        return True
    run_file = out / RUN_FILE
    if run_file.is_file():
        try:
            held = json.loads(run_file.read_text()).get("config", {})
        except json.JSONDecodeError:
            held = None
        if held is not None and identity(held) == identity(to_dict(cfg)):
            if not cfg.overwrite:
                ckpt.check_restart(out)  # an unfinished run's checkpoints: resume it, or --overwrite
            logger.info("output_dir %s holds an earlier run of the same config; starting it again", out)
            return True
    if cfg.overwrite:
        logger.warning("output_dir %s holds another run; --overwrite given, its files will be replaced", out)
        return True
    what = "another hybridtune run" if run_file.is_file() else "files that are not from this run"
    raise OutputDirError(
        f"output_dir '{out}' already holds {what}; choose another --output_dir, resume with "
        f"--resume_from_checkpoint latest, or pass --overwrite"
    )


def claim_output_dir(cfg: TrainConfig) -> bool:
    """`check_output_dir`, then remove what earlier processes left there that would mislead this run (rank 0)."""
    fresh = check_output_dir(cfg)
    done = ckpt.tidy_output_dir(Path(cfg.output_dir), fresh, cfg.resume_from_checkpoint, cfg.overwrite)
    if done:
        logger.info("%s", done)
    return fresh


def write_run_file(out: Path, cfg: TrainConfig) -> None:
    """The run's config and hybridtune version, which a later run in the same directory compares itself with."""
    data = {"config": to_dict(cfg), "hybridtune_version": hybridtune.__version__}
    ckpt.atomic_write_text(out / RUN_FILE, json.dumps(data, indent=2))
