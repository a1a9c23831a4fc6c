"""The facts a run's choices read, measured once: the device and the processes before the model loads; with the model,
its size, router loss and the fused loss's blockers, the whole-model FSDP2 unit's share of the GPU, the least free
GPU memory over the ranks, the bytes the run allocates beside the model (`state_bytes`), the model's widths, its
FSDP2 shards, every pack of the run, and what the `memory` choice weighs (`weights_facts`). `choices.resolve` then
decides every `auto` from them.
"""

from __future__ import annotations

import dataclasses

import torch

from hybridtune.config import TrainConfig
from hybridtune.models.anatomy import param_count, router_loss, text_config
from hybridtune.ops import nf4
from hybridtune.runtime import distributed, engines, quant
from hybridtune.runtime.adapter_kind import LORA, adapter_kind
from hybridtune.runtime.facts import Facts
from hybridtune.runtime.memory import (
    ActivationShapes,
    ShardedModel,
    dequantized_bytes,
    nf4_bytes,
    optimizer_bytes,
    resident_bytes,
)
from hybridtune.runtime.memory_fit import host_memory
from hybridtune.runtime.optim import optim_name, uses_masters
from hybridtune.runtime.step import fused_loss_blocker


def measure(
    cfg: TrainConfig,
    device: torch.device,
    d: distributed.Dist,
    model: torch.nn.Module | None = None,
    bf16: bool = False,
    packs: list[tuple[int, ...]] = (),
) -> Facts:
    """The facts of this run; without a model, those known before it loads (device and processes). Under FSDP2 on
    a GPU with `fsdp_units: auto`, a collective (the whole-model unit's share of the tightest GPU); on a GPU,
    another (the least free memory over ranks, which the `memory` line always reads)."""
    cuda = device.type == "cuda"
    base = Facts(
        device=device.type,
        bf16_supported=cuda and torch.cuda.is_bf16_supported(),
        engine=d.engine if d.enabled else "none",
        world=d.world,
    )
    if model is None:
        return base
    share = engines.whole_model_share(model, d, device, bf16) if cfg.fsdp_units == "auto" else None
    free = None
    fsdp = d.enabled and d.engine == "fsdp"
    if cuda:  # (every choice that plans memory reads it; the `memory` line always does)
        # The driver's free memory, and what torch's allocator holds reserved but unused (the self-test's, say).
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        free = int(-distributed.all_max(-float(torch.cuda.mem_get_info(device)[0] + cached), d))
    return dataclasses.replace(
        base,
        n_params=param_count(model),
        router_loss=router_loss(model),
        fused_loss_blocker=fused_loss_blocker(model),
        whole_model_share=share,
        packs=tuple(packs),
        gpu_free_bytes=free,
        host_bytes=None if cuda else host_memory(),
        state_bytes=state_bytes(model, d, bf16, cfg),
        shapes=ActivationShapes.of(text_config(model)),
        sharded=ShardedModel.of(model, d.world, bf16) if fsdp else None,
        **weights_facts(cfg, model),
    )


def state_bytes(model: torch.nn.Module, d: distributed.Dist, bf16: bool, cfg: TrainConfig | None = None) -> int:
    """Bytes the run allocates beside the model as loaded: each trainable parameter's gradient and the optimizer's
    state (`memory.optimizer_bytes`: `cfg.optim`'s, with fp32 masters for bf16 weights under `MasterAdamW`), DDP's
    gradient buckets, and under bf16 autocast the bf16 copies of fp32 trainable weights the backward keeps; under
    FSDP2 what `engines.whole_model_bytes` holds beyond the whole model now resident (its shards, the gathered model, the window's gradient)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if d.engine == "fsdp" and d.enabled:
        # A meta-built model (any model under FSDP2, filled after fully_shard) holds none of it yet (nor its LoRA
        # adapter, drawn on the host: `memory.resident_bytes`).
        return max(0, engines.whole_model_bytes(model, d.world, bf16) - resident_bytes(model.parameters()))
    copies = 2 * sum(p.numel() for p in trainable if p.dtype == torch.float32) if bf16 else 0
    own = sum(p.numel() * p.element_size() for p in trainable)
    optim = optim_name(cfg) if cfg is not None else "adamw"
    masters = cfg is not None and uses_masters(cfg, bf16, d)
    held = sum(optimizer_bytes(optim, p.numel(), p.element_size(), masters) for p in trainable)
    # A QLoRA base: its largest NF4 weight dequantised for its matmul, forward and backward (ops/nf4.py).
    return held + (own if d.engine == "ddp" and d.enabled else 0) + copies + dequantized_bytes(model.parameters())


def weights_facts(cfg: TrainConfig, model: torch.nn.Module) -> dict:
    """What the `memory` choice reads of the model (runtime/memory_fit.py): its bytes as loaded, its trainable values
    and their bytes, and for LoRA on a bf16 base the bytes a NF4 base would save over QLoRA's targets
    (`quant.targets`) and its largest target dequantised per step (`memory.dequantized_bytes`)."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    out = dict(
        resident_bytes=resident_bytes(params),
        trainable=sum(p.numel() for p in trainable),
        trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
    )
    if adapter_kind(cfg) is LORA:  # (LoRA on a base not in NF4)
        named = dict(model.named_parameters())
        try:
            found = quant.targets(model)
        except (AttributeError, StopIteration):  # no decoder layers where QLoRA looks: no NF4 setup to weigh
            found = {}
        wanted = [named[n] for n in found if n in named and not nf4.is_nf4(named[n])]
        out["nf4_saving"] = sum(p.numel() * p.element_size() - nf4_bytes(p.numel()) for p in wanted)
        out["nf4_transient"] = 2 * max((p.numel() * 2 for p in wanted), default=0)  # as `dequantized_bytes`
    return out
