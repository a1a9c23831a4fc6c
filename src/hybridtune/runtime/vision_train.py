"""What of a vision-language model's image side trains (config keys `freeze_vision_tower`, `freeze_multi_modal_projector`,
LLaMA-Factory's names): by default neither (the loaded model freezes everything outside the text model). An unfrozen
part is treated as the language model is: under `adapter: lora` a LoRA on each of its Linear layers (the same r,
alpha and dropout, in the run's one peft adapter, whose `target_modules` then names them too, so peft and an export
load it as saved), under `adapter: full` all its parameters, in the text model's dtype. The tower is `model.visual`
without its `merger` (the projector into the language model's width).
"""

from __future__ import annotations

import logging
import re
import warnings

import torch

from hybridtune.errors import ConfigError
from hybridtune.models.anatomy import unwrap
from hybridtune.runtime.adapter_kind import adapter_kind

logger = logging.getLogger(__name__)


def vision_parts(model: torch.nn.Module) -> tuple[str, torch.nn.Module | None, torch.nn.Module | None]:
    """(the tower's module name in `model`, the tower, its merger); the tower None for a text model."""
    base = unwrap(model)
    tower = getattr(getattr(base, "model", None), "visual", None)
    if tower is None:
        return "", None, None
    name = next(n for n, m in model.named_modules() if m is tower)
    return name, tower, getattr(tower, "merger", None)


def _unfrozen(cfg) -> tuple[bool, bool]:
    return not getattr(cfg, "freeze_vision_tower", True), not getattr(cfg, "freeze_multi_modal_projector", True)


def train_vision(model: torch.nn.Module, cfg) -> torch.nn.Module:
    """Unfreeze (full) or adapt (LoRA) the parts of the image side `cfg` asks to train; `model` as returned by
    `lora_from_config` under LoRA. A ConfigError when asked of a model without a vision tower."""
    tower_on, merger_on = _unfrozen(cfg)
    if not (tower_on or merger_on):
        return model
    name, tower, merger = vision_parts(model)
    if tower is None:
        keys = [k for k, on in (("freeze_vision_tower", tower_on), ("freeze_multi_modal_projector", merger_on)) if on]
        raise ConfigError(
            f"config key {keys[0]} = false: this model has no vision tower (a text-only checkpoint); remove the key"
        )
    parts = [(f"{name}.merger", merger)] if merger_on and merger is not None else []
    if tower_on:
        parts += [(f"{name}.{n}", m) for n, m in tower.named_children() if m is not merger]
    if any(p.is_meta for _, m in parts for p in m.parameters()):
        raise ConfigError(
            "training the vision tower or its merger needs the model built whole in memory (not distributed: fsdp, "
            "not load_in_4bit) for now; keep freeze_vision_tower and freeze_multi_modal_projector true there"
        )
    lora = adapter_kind(cfg).lora
    if lora:
        _adapt(model, cfg, parts)
    else:
        dtype = next(p.dtype for p in unwrap(model).get_input_embeddings().parameters())
        for _, module in parts:
            module.to(dtype)
            for p in module.parameters():
                p.requires_grad_(True)
    trained = sum(p.numel() for _, m in parts for p in m.parameters() if p.requires_grad)
    what = ", ".join(n for n, on in (("the vision tower", tower_on), ("its merger", merger_on)) if on)
    how = "LoRA" if lora else "full"
    logger.info("vision: %s trained (%s; %s trainable parameters there)", what, how, f"{trained:,}")
    return model


def _adapt(model: torch.nn.Module, cfg, parts: list[tuple[str, torch.nn.Module]]) -> None:
    """LoRA on every Linear layer of `parts`, injected into the run's adapter ('default')."""
    from peft import LoraConfig, inject_adapter_in_model

    names = [
        f"{prefix}.{n}" for prefix, module in parts for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)
    ]
    peft_cfg = getattr(model, "peft_config", {}).get("default")
    if peft_cfg is None or not names:
        return
    base = model.base_model.model
    inner = next(n for n, m in model.named_modules() if m is base) + "."
    local = [n.removeprefix(inner) for n in names]
    pattern = "|".join(re.escape(n) for n in local)
    extra = LoraConfig(
        r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, target_modules=pattern, bias="none"
    )
    with warnings.catch_warnings():  # ("Already found a `peft_config` attribute": the run's adapter, which this joins)
        warnings.filterwarnings("ignore", message="Already found a `peft_config`")
        inject_adapter_in_model(extra, base, adapter_name="default")
    # (the injection puts `extra` in the peft_config dict the run's adapter shares with the model: the run's config
    # goes back, its target_modules naming both, so the saved adapter_config.json loads every layer)
    for owner in (model, model.base_model, base):
        if isinstance(getattr(owner, "peft_config", None), dict):
            owner.peft_config["default"] = peft_cfg
    old = peft_cfg.target_modules
    if not isinstance(old, str):  # (a list: peft matches its names as the last parts of a module's name)
        old = rf"(?:.*\.)?(?:{'|'.join(re.escape(t) for t in sorted(old))})" if old else ""
    peft_cfg.target_modules = f"(?:{old})|(?:{pattern})" if old else pattern
    for n, p in model.named_parameters():  # (inject marks only its own adapters trainable: the text's stay so)
        if "lora_" in n:
            p.requires_grad_(True)
