"""The model of a run: its checkpoint or preset loaded (models/loading.py), the mixers patched, activation
checkpointing, LoRA, on the device, in the dtypes training holds it in. `assemble` is that sequence, once: training
builds through it (`build_model`) and so does reopening a run's checkpoint (infer/load.py).

A full fine-tune loads fp32 master weights whatever dtype the checkpoint was saved in. Under bf16 with `optim: adamw`
in one process or DDP the masters move into the optimizer's state and the model computes on bf16 weights
(runtime/masters.py); under FSDP2 they stay fp32 shards (bf16 autocast computes); `adamw_bf16_sr` holds bf16.
Under LoRA the frozen base is held in bf16 when bf16 computes (half the memory, no per-step casts), fp32 otherwise,
and peft keeps the adapters in fp32 (QLoRA: the base's linears in NF4, runtime/quant.py). Parameters outside the text
model (the vision tower, the merger) stay frozen as saved unless `freeze_vision_tower` / `freeze_multi_modal_projector`
are false (config/vision.py: then they train as the language model does).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hybridtune.config import TrainConfig
from hybridtune.models.anatomy import unwrap
from hybridtune.models.loading import LoadedModel, load_model
from hybridtune.models.patching import patch_model
from hybridtune.runtime.adapter_kind import adapter_kind
from hybridtune.runtime.distributed import ONE, Dist
from hybridtune.runtime.lora import hold_adapter, lora_from_config
from hybridtune.runtime.masters import split
from hybridtune.runtime.optim import model_dtype, uses_masters
from hybridtune.runtime.quant import check_supported, materialize_quantized
from hybridtune.runtime.vision_train import train_vision

logger = logging.getLogger(__name__)


def enable_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing on every decoder layer (peft-wrapped or not); non-reentrant
    needs no `enable_input_require_grads` hook for frozen embeddings, and traces under the compiled loop."""
    unwrap(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@dataclass
class RunModel:
    loaded: LoadedModel
    model: torch.nn.Module  # peft-wrapped under LoRA
    patch_report: object
    masters: bool = False  # the weights were split for fp32 masters in the optimizer (`uses_masters`, masters.py)


def assemble(
    cfg: TrainConfig,
    source,
    tokenizer,
    device: torch.device,
    dtype: torch.dtype,
    *,
    meta: bool = False,
    patched: bool = True,
    checkpointing: bool = False,
    say: bool = False,
) -> RunModel:
    """The one sequence that builds a run's model, for training (`build_model`) and for reopening a run's checkpoint
    (infer/load.py): load `source` in `dtype` (`meta`: on the meta device), the QLoRA base in NF4 (`load_in_4bit`),
    the mixers patched (`patched`), activation checkpointing (`checkpointing`), `cfg`'s LoRA, the vision tower or
    merger the run trains, on `device` when it holds its values. `say`: the patch report logged as it is made (train's
    log)."""
    loaded = load_model(source, tokenizer, seed=cfg.seed, dtype=dtype, meta=meta)
    if cfg.load_in_4bit:
        materialize_quantized(loaded, device, dtype)
    model = loaded.model
    report = patch_model(model) if patched else None
    if say:
        logger.info("%s", report)
    if checkpointing:
        enable_checkpointing(model)
    if adapter_kind(cfg).lora:
        model = lora_from_config(model, cfg)
        hold_adapter(loaded)
    model = train_vision(model, cfg)  # (a vision tower or merger the run trains: runtime/vision_train.py)
    if loaded.reader is None:  # (a checkpoint the meta path cannot name loads whole: models.loading says so)
        model.to(device)
    return RunModel(loaded, model, report)


def build_model(cfg: TrainConfig, source, tokenizer, device: torch.device, bf16: bool, dist: Dist = ONE) -> RunModel:
    """Load, patch the mixers, checkpointing (when set to true), LoRA, on `device`, in training mode (`assemble`).

    Under FSDP2 (`dist`) the model is built on the meta device and stays there: `engines.wrap` fills each rank's
    shards after `fully_shard`, so no rank holds the whole model. Under LoRA the adapter alone has values before
    that: peft draws it on the host as over a plain base (`lora.apply_lora`), and `lora.hold_adapter` keeps it for
    the fill."""
    if cfg.load_in_4bit:  # QLoRA: built on the meta device, each weight read then quantised (runtime/quant.py)
        check_supported(dist.world, dist.engine)
    meta = dist.engine == "fsdp" or cfg.load_in_4bit
    # (the optimizer's dtype where it asks for one, `optim.model_dtype`, else the kind's: see the module doc)
    dtype = model_dtype(cfg, bf16) or adapter_kind(cfg).held_dtype(bf16)
    checkpointing = cfg.gradient_checkpointing is True
    run = assemble(cfg, source, tokenizer, device, dtype, meta=meta, checkpointing=checkpointing, say=True)
    run.masters = uses_masters(cfg, bf16, dist)
    if run.masters:  # bf16 weights; their fp32 tensors go to the optimizer (masters.py)
        logger.info("master weights: %d fp32 tensors in the optimizer, bf16 in the model", split(run.model))
    run.model.train()
    return run
