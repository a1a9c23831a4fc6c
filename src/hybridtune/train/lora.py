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
    check_rank(model, r, found)
    cfg = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=found, task_type="CAUSAL_LM", bias="none"
    )
    peft_model = get_peft_model(model, cfg)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    applied, params = applied_targets(peft_model)
    logger.info(
        "LoRA r=%d alpha=%d on %s: %s trainable of %s parameters",
        r,
        alpha,
        ",".join(applied + [f"{p} (expert parameter)" for p in params]),
        f"{trainable:,}",
        f"{total:,}",
    )
    rewritten = [t for t in found if t not in applied]
    if rewritten:
        # peft maps MLP names onto the fused 3-D expert weights of MoE models (e.g. Qwen3-Next) and then no
        # longer targets the Linear layers of those names (the shared expert's): say so, never silently.
        logger.warning(
            "peft adapted %s as expert parameters %s, not as the Linear layers of those names (e.g. a shared "
            "expert's MLP gets no LoRA); name the modules in lora_target_modules to adapt them",
            ",".join(rewritten),
            ",".join(params) or "(none)",
        )
    return peft_model


def check_rank(model: torch.nn.Module, r: int, targets: list[str]) -> None:
    """Refuse a rank above min(in, out) of the smallest targeted Linear: such a rank adds nothing a full-rank
    update would not give, and a huge one would try to allocate its A and B matrices before failing."""
    name, layer = min(
        (
            (n, m)
            for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in targets
        ),
        key=lambda nm: min(nm[1].in_features, nm[1].out_features),
    )
    largest = min(layer.in_features, layer.out_features)
    if r > largest:
        raise ConfigError(
            f"config key 'lora_r' = {r} is larger than the largest sensible rank {largest}: the targeted layer "
            f"'{name}' is {layer.in_features} -> {layer.out_features}, and a rank above min(in, out) adds nothing "
            f"a full-rank update would not give; set lora_r to at most {largest}"
        )


def applied_targets(peft_model) -> tuple[list[str], list[str]]:
    """(module names, parameter names) the adapter really targets, as peft recorded them."""
    cfg = peft_model.peft_config["default"]
    modules = cfg.target_modules
    modules = sorted(modules) if isinstance(modules, (set, list, tuple)) else [str(modules)]
    params = sorted(getattr(cfg, "target_parameters", None) or [])
    return modules, params
