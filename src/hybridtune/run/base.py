"""The base a run trains on, as its checkpoints record it: the name, a hub id's commit, a preset's draw; and
the revision a resume loads (the commit the checkpoint trained on, not where a branch points now)."""

from __future__ import annotations

import logging
from pathlib import Path

from hybridtune.config import TrainConfig
from hybridtune.models.loading import LoadedModel
from hybridtune.models.presets import PRESET_DRAW, PRESETS
from hybridtune.run import checkpoint as ckpt
from hybridtune.run.checkpoint import CheckpointError
from hybridtune.runtime.adapter_kind import adapter_kind

logger = logging.getLogger(__name__)


def base_identity(loaded: LoadedModel) -> dict:
    """What a checkpoint records of the base it trained on: the name, a hub id's commit, a preset's draw."""
    return {
        "base_model": loaded.name,
        "base_revision": loaded.revision,
        "preset_draw": PRESET_DRAW if loaded.random_init else None,
    }


def base_revision(cfg: TrainConfig, resume_at: Path | None) -> str | None:
    """`revision`; on resume, the commit of a hub id the checkpoint trained on, where it recorded one. A LoRA
    checkpoint of a preset drawn otherwise than this code draws it is refused: its adapter would continue on other
    random base weights (a full fine-tune's checkpoint holds every weight, so any draw resumes)."""
    meta = ckpt.meta_of(resume_at) if resume_at is not None else {}
    if resume_at is not None and adapter_kind(cfg).trainable_only and cfg.base_model in PRESETS:
        draw = meta.get("preset_draw", 1)
        if draw != PRESET_DRAW:
            raise CheckpointError(
                f"{resume_at}: its LoRA adapter trained on preset '{cfg.base_model}' as drawn by an earlier hybridtune "
                f"(draw {draw}; this one makes draw {PRESET_DRAW}), whose random base weights cannot be made again; "
                "start a new run (or export and keep using that checkpoint's final/ with its base_model/)"
            )
    pinned = meta.get("base_revision")
    if not isinstance(pinned, str) or not pinned or pinned == cfg.revision:
        return cfg.revision
    logger.info("base_model %s: at commit %s, the one %s trained on", cfg.base_model, pinned, resume_at.name)
    return pinned
