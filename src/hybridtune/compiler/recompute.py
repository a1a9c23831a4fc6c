"""What a checkpointed decoder layer recomputes in the backward: everything (plain non-reentrant checkpointing), or
everything but its mixer's core (`keep_cores`).

Under gradient checkpointing each layer's forward runs twice, the second time in the backward to rebuild what the
backward reads. The projections are GEMMs at the GPU's peak, worth recomputing; the mixers' cores are not: a chunked
linear-attention forward (its output, cumulative gate and solved WY matrix) and the attention kernel are a few FLOPs per byte of output at a fraction of the peak (FLA's kernels and FlashAttention),
so with `keep_cores` their outputs are kept from the first forward (selective activation
checkpointing: `torch.utils.checkpoint.create_selective_checkpoint_contexts`, which AOT autograd's partitioner honours
under torch.compile as eagerly) and the recompute runs the rest. Its price is those outputs per layer
(`runtime.memory.ActivationShapes.core_elements`); the loss and every gradient are the same. What is kept is the ops in
`core_ops()`: each registered mixer's `core_ops` (mixers/), not torch's varlen attention (a custom op of its own) that
packed CUDA batches run, which is recomputed until keeping it is checked on a GPU.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from hybridtune.mixers import MIXERS, registry

# Set on a layer's checkpoint function (`_gradient_checkpointing_func`) that keeps the cores, for the FLOP count.
KEEPS = "_hybridtune_keeps_cores"


@functools.cache
def core_ops() -> frozenset:
    """The ops whose outputs `keep_cores` keeps: those of every registered mixer whose core is kept
    (`MixerSpec.core_ops`: a chunked delta rule's forward, SDPA's attention kernels). An attention that runs as a custom
    op of its own (torch's varlen attention, the flash-attn package's) is recomputed. Cached, cleared when a mixer
    is registered or unregistered (`registry.on_change`)."""
    ops = set()
    for spec in MIXERS.values():
        if spec.core_ops is not None:
            ops.update(spec.core_ops())
    return frozenset(ops)


registry.on_change(core_ops.cache_clear)


def _keep_cores(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in core_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def keep_cores_context():
    """`context_fn` for `torch.utils.checkpoint`: the cores' outputs saved, the rest recomputed."""
    return create_selective_checkpoint_contexts(_keep_cores)


def checkpoint_kwargs(keep_cores: bool) -> dict:
    """The keyword arguments of a layer's non-reentrant checkpoint."""
    return {"use_reentrant": False, "context_fn": keep_cores_context} if keep_cores else {"use_reentrant": False}


def checkpoint_fn(keep_cores: bool):
    """`torch.utils.checkpoint.checkpoint` with those arguments (a layer's `_gradient_checkpointing_func`)."""
    fn = functools.partial(checkpoint, **checkpoint_kwargs(keep_cores))
    setattr(fn, KEEPS, keep_cores)
    return fn


def keeps_cores(module: torch.nn.Module) -> bool:
    """Whether `module`'s checkpoint function keeps the cores (one installed here or by compiler/regions.py)."""
    return bool(getattr(getattr(module, "_gradient_checkpointing_func", None), KEEPS, False))
