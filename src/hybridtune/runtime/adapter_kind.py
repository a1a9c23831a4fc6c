"""An adapter kind as one object: what a full fine-tune, LoRA and QLoRA (LoRA on a 4-bit NF4 base) each mean for the
model's dtype, the optimizer's fp32 masters, the default engine, what a checkpoint and the final export hold.

`adapter_kind(cfg)` is the run's kind (the config's `adapter: lora` with `load_in_4bit: true` is QLoRA). The config
keeps its own checks on the `adapter` value (config/); this is what train, infer, bench and run/ ask of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdapterKind:
    name: str  # as a user writes it: 'lora', 'qlora' or 'full' (messages)
    adapter: str  # the config's `adapter` value ('lora' for QLoRA too), as hybridtune.json records it
    lora: bool  # a peft LoRA adapter trained on a frozen base; else every weight of the text model trains
    nf4_base: bool  # the frozen base's linear and expert weights held in 4-bit NF4 (runtime/quant.py)
    default_engine: str  # `distributed: auto`: DDP for LoRA (small gradients, the whole model fits), FSDP2 for full

    @property
    def trainable_only(self) -> bool:
        """Whether a checkpoint holds the trained values alone (LoRA's adapter): the frozen base is remade from its
        source on resume and when a checkpoint is reopened; a full fine-tune's checkpoint holds every weight."""
        return self.lora

    def held_dtype(self, bf16: bool) -> torch.dtype:
        """The dtype the text model loads in: a frozen base in bf16 when bf16 computes (LoRA's adapters stay fp32,
        as peft makes them); a full fine-tune's weights fp32 whatever the checkpoint's dtype (its masters)."""
        return torch.bfloat16 if bf16 and self.lora else torch.float32

    def uses_masters(self, optim: str, bf16: bool, engine: str | None) -> bool:
        """Whether the model computes on bf16 weights with fp32 masters in `MasterAdamW` (masters.py): a full
        fine-tune under bf16 with plain AdamW in one process or DDP (FSDP2 keeps fp32 shards under bf16 autocast)."""
        return not self.lora and bf16 and optim == "adamw" and engine != "fsdp"


FULL = AdapterKind("full", "full", lora=False, nf4_base=False, default_engine="fsdp")
LORA = AdapterKind("lora", "lora", lora=True, nf4_base=False, default_engine="ddp")
QLORA = AdapterKind("qlora", "lora", lora=True, nf4_base=True, default_engine="ddp")


def adapter_kind(cfg) -> AdapterKind:
    """The kind of `cfg` (a TrainConfig, or a run's recorded one): its `adapter`, QLoRA where `load_in_4bit`."""
    if cfg.adapter == "full":
        return FULL
    return QLORA if cfg.load_in_4bit else LORA
