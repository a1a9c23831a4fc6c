"""The model of a run: its checkpoint or preset loaded (models/loading.py), the mixers patched, activation
checkpointing, LoRA, on the device, in the dtypes training holds it in.

A full fine-tune holds fp32 master weights whatever dtype the checkpoint was saved in (bf16 autocast computes;
parameters, gradients and AdamW moments are fp32). Under LoRA the frozen base is held in bf16 when bf16 computes
(half the memory, no per-step casts), fp32 otherwise, and peft keeps the adapters in fp32. Parameters outside the
text model (a vision tower) are frozen and stay as saved.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridtune.config import TrainConfig
from hybridtune.models.anatomy import unwrap
from hybridtune.models.loading import LoadedModel, load_model
from hybridtune.models.patching import patch_model
from hybridtune.models.presets import PRESET_DRAW, PRESETS
from hybridtune.train import checkpoint as ckpt
from hybridtune.train.checkpoint import CheckpointError
from hybridtune.train.distributed import ONE, Dist
from hybridtune.train.lora import hold_adapter, lora_from_config

logger = logging.getLogger(__name__)


def enable_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing on every decoder layer (peft-wrapped or not); non-reentrant
    needs no `enable_input_require_grads` hook for frozen embeddings, and traces under the compiled loop."""
    unwrap(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def master_dtype(adapter: str, bf16: bool) -> torch.dtype:
    """The dtype the trained model's text part is held in (see the module doc)."""
    return torch.bfloat16 if bf16 and adapter == "lora" else torch.float32


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
    if resume_at is not None and cfg.adapter == "lora" and cfg.base_model in PRESETS:
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


@dataclass
class RunModel:
    loaded: LoadedModel
    model: torch.nn.Module  # peft-wrapped under LoRA
    patch_report: object


def build_model(cfg: TrainConfig, source, tokenizer, device: torch.device, bf16: bool, dist: Dist = ONE) -> RunModel:
    """Load, patch the mixers, checkpointing (when set to true), LoRA, on `device`, in training mode.

    Under FSDP2 (`dist`) the model is built on the meta device and stays there: `distributed.wrap` fills each rank's
    shards after `fully_shard`, so no rank holds the whole model. Under LoRA the adapter alone has values before
    that: peft draws it on the host as over a plain base (`lora.apply_lora`), and `lora.hold_adapter` keeps it for
    the fill."""
    meta = dist.engine == "fsdp"
    loaded = load_model(source, tokenizer, seed=cfg.seed, dtype=master_dtype(cfg.adapter, bf16), meta=meta)
    model = loaded.model
    report = patch_model(model)
    logger.info("%s", report)
    if cfg.gradient_checkpointing is True:
        enable_checkpointing(model)
    if cfg.adapter == "lora":
        model = lora_from_config(model, cfg)
        hold_adapter(loaded)
    if loaded.reader is None:  # (a checkpoint the meta path cannot name loads whole: models.loading says so)
        model.to(device)
    model.train()
    return RunModel(loaded, model, report)
