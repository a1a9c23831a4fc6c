"""What the run's choices read and what they are: `Facts` (measured by `measure.measure` before `choices.resolve`),
`Choice` (a value with its reason and its warnings) and `Choices` (every choice of a run, logged a line each in
`ORDER`, each line followed by its choice's warnings)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from hybridtune.data.collator import StaticLayout
from hybridtune.runtime.memory import ActivationShapes, ShardedModel


@dataclass(frozen=True)
class Choice:
    value: Any
    reason: str
    warnings: tuple[str, ...] = ()  # what the user should know about this value, said with its line


@dataclass(frozen=True)
class Facts:
    """What the choices depend on, measured by the trainer before it resolves them."""

    device: str  # "cpu" | "cuda"
    bf16_supported: bool = False  # the GPU computes in bf16
    engine: str = "none"  # "none" (one process) | "ddp" | "fsdp"
    world: int = 1
    n_params: int = 0
    router_loss: bool = False  # the model's loss adds an MoE router term (`output_router_logits`)
    fused_loss_blocker: str | None = None  # why the fused loss cannot stand in for the model's, or None
    # The whole-model FSDP2 unit's estimated bytes per GPU over the smallest GPU's memory (max over ranks); None
    # where it was not measured (no FSDP2, units not auto, or no GPU).
    whole_model_share: float | None = None
    packs: tuple[tuple[int, ...], ...] = ()  # document lengths of every train and eval pack the run collates
    # The GPU's free bytes once the model is loaded (min over ranks), measured under `gradient_checkpointing: auto`,
    # under `gradient_checkpointing: true` with `keep_mixer_cores: auto` in one process, and under FSDP2 with
    # `fsdp_units: auto`.
    gpu_free_bytes: int | None = None
    host_bytes: int | None = None  # the machine's physical memory, which a CPU run's step fills
    state_bytes: int = 0  # what the run allocates beside the resident model: gradients, AdamW state, DDP's buckets
    shapes: ActivationShapes | None = None  # the model's widths, for the activation estimate
    sharded: ShardedModel | None = None  # under FSDP2: the model's bytes per GPU with its layers as units
    # The weights and the optimizer (runtime/memory_fit.py): the model's bytes as loaded, its trainable values and
    # their bytes, and for LoRA on a bf16 base what a NF4 base (load_in_4bit) would save and add per step.
    resident_bytes: int = 0
    trainable: int = 0
    trainable_bytes: int = 0
    nf4_saving: int = 0
    nf4_transient: int = 0


@dataclass(frozen=True)
class Choices:
    bf16: Choice
    threads: Choice  # int, or None to keep torch's default
    compile: Choice  # "off" | "loop" | "modules"
    fsdp_units: Choice  # "model" | "layer" | "group:K", or None without FSDP2
    pack_layout: Choice  # a StaticLayout, or None for the dynamic layout
    fused_loss: Choice  # bool
    checkpointing: Choice  # bool (auto: from the memory estimate; off is retried with it on after an OOM)
    compile_regions: Choice  # bool: compile_loop(regional=...)
    keep_mixer_cores: Choice = Choice(False, "no checkpointing")  # bool: compile_loop(keep_cores=...)
    cuda_graphs: Choice = Choice(False, "cuda_graphs: off")  # bool
    memory: Choice = Choice(None, "not estimated")  # str: the weights and optimizer as configured (never switched)

    @property
    def warnings(self) -> tuple[str, ...]:
        """Every choice's warnings, in `ORDER`."""
        return tuple(w for name in ORDER for w in getattr(self, name).warnings)

    def lines(self) -> list[str]:
        """One log line per choice: `name: value (reason)`."""
        out = []
        for name in ORDER:
            c: Choice = getattr(self, name)
            out.append(f"{name}: {_show(c.value, NONE.get(name, '-'))} ({c.reason})")
        return out

    def log(self, log: logging.Logger) -> None:
        """Each choice's line (info), then its warnings (warning)."""
        for name, line in zip(ORDER, self.lines()):
            log.info("choice %s", line)
            for w in getattr(self, name).warnings:
                log.warning("%s", w)


ORDER = (
    "bf16",
    "threads",
    "compile",
    "compile_regions",
    "fsdp_units",
    "pack_layout",
    "cuda_graphs",
    "fused_loss",
    "checkpointing",
    "keep_mixer_cores",
    "memory",
)
NONE = {"threads": "torch's default", "pack_layout": "dynamic"}  # what a None value means, per choice


def _show(value, none: str) -> str:
    if isinstance(value, StaticLayout):
        return f"static {value.tokens} tokens / {value.docs} documents"
    return none if value is None else str(value)
