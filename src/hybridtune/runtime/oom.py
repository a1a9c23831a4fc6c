"""The fallback of `gradient_checkpointing: auto`: a first step that ran out of GPU memory without checkpointing
(the memory estimate of choices.py said it would fit) is retried once with checkpointing on, on the same data."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable

import torch

from hybridtune.errors import ConfigError
from hybridtune.runtime import distributed
from hybridtune.runtime.model import enable_checkpointing
from hybridtune.runtime.stream import BatchStream

logger = logging.getLogger(__name__)


def retry_with_checkpointing(
    step: Callable[[], dict],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    stream: BatchStream,
    device: torch.device,
    d: distributed.Dist,
) -> dict:
    """`step()`, and once more with checkpointing on if it ran out of memory: the data position, the RNG and the
    gradients are put back first, so the retried step is the one a run with checkpointing from the start takes.
    One process only: under torchrun the other ranks are already inside collectives, so there the error says
    which setting to change."""
    pos = stream.position()
    rng = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
    try:
        return step()
    except torch.OutOfMemoryError as e:
        if d.enabled:
            also = " or fsdp_units: layer" if d.engine == "fsdp" and d.units == "model" else ""
            raise ConfigError(
                f"out of GPU memory in the first step without gradient checkpointing ({str(e).splitlines()[0]}); "
                f"set gradient_checkpointing: true (or a shorter sequence_len{also})"
            ) from None
    optimizer.zero_grad(set_to_none=True)
    gc.collect()  # the failed step's traceback frames may still hold activations
    torch.set_rng_state(rng[0])  # dropout draws as in a run that had checkpointing from the start
    if device.type == "cuda":
        torch.cuda.set_rng_state(rng[1], device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)  # the logged peak is the run's, not the failed try's
    stream.seek(pos)
    enable_checkpointing(model)
    logger.warning(
        "gradient_checkpointing auto: the first step ran out of GPU memory without checkpointing; "
        "switched it on and retried the step (set gradient_checkpointing: true to start that way)"
    )
    return step()
