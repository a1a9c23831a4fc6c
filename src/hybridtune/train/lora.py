"""LoRA through peft: target resolution, wrapping, and what gets trained."""

from __future__ import annotations

import logging

import torch

from hybridtune.errors import ConfigError

logger = logging.getLogger(__name__)


def present_targets(model: torch.nn.Module, wanted: list[str]) -> tuple[list[str], list[str]]:
    """Split `wanted` module names into those the model has (as a Linear's last name part) and those it lacks."""
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    found = [w for w in wanted if w in names]
    missing = [w for w in wanted if w not in names]
    return found, missing


def apply_lora(model: torch.nn.Module, r: int, alpha: int, dropout: float, targets: list[str]):
    """Wrap `model` with a peft LoRA adapter on the named Linear modules; everything else is frozen."""
    from peft import LoraConfig, get_peft_model

    found, missing = present_targets(model, targets)
    if not found:
        raise ConfigError(
            f"none of lora_target_modules {targets} names a Linear layer of this model; "
            f"e.g. {sorted(present_targets(model, ['q_proj', 'in_proj_qkv', 'out_proj', 'gate_proj'])[0])}"
        )
    if missing:
        logger.info("LoRA targets not in this model (skipped): %s", ", ".join(missing))
    cfg = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=found, task_type="CAUSAL_LM", bias="none"
    )
    peft_model = get_peft_model(model, cfg)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    logger.info(
        "LoRA r=%d alpha=%d on %s: %s trainable of %s parameters",
        r,
        alpha,
        ",".join(found),
        f"{trainable:,}",
        f"{total:,}",
    )
    return peft_model
