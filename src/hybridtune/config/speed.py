"""The speed keys of a run: fast kernels' provisioning, torch.compile's strategy and its overrides, CUDA graphs,
what activation checkpointing keeps, the device, the distributed engine and its units, the CPU threads."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal

from hybridtune.config.keys import Bound, at_least, key

# torch's intra-op threads beyond the core count only contend for the same cores; a few times the core count
# is room enough for experiments. Tens of thousands exhaust the process's thread limit and the tokenizers'
# thread pool panics (a segfault), so the bound follows the machine rather than a fixed number.
THREADS_PER_CPU = 4


def max_num_threads() -> int:
    """The most CPU threads `num_threads` may ask for on this machine: THREADS_PER_CPU x os.cpu_count()."""
    return THREADS_PER_CPU * (os.cpu_count() or 1)


def _threads(cfg) -> str:
    return (
        f"must be at most {max_num_threads()} ({THREADS_PER_CPU} x the {os.cpu_count() or 1} CPUs of this "
        "machine; more threads only contend for the same cores); use 0 for auto"
    )


@dataclass
class SpeedKeys:
    kernels: Literal["auto", "check", "off"] = key(
        "auto", "fast kernels: auto = install missing ones (pinned wheels, GPU only), check = report only, off = skip"
    )
    compile: Literal["auto", "off", "loop", "modules"] = key(
        "auto",
        "torch.compile strategy: loop = the whole decoder loop as one graph, modules = per-class forwards, "
        "auto = loop on a GPU and off on the CPU (where inductor's C++ build is slow)",
    )
    cuda_graphs: Literal["auto", "on", "off"] = key(
        "auto",
        "replay the compiled loop's kernels as CUDA graphs (torch.compile mode reduce-overhead); auto = on for one "
        "process running compile: loop on a GPU over a static pack_layout",
    )
    compile_regions: Literal["auto"] | bool = key(
        "auto",
        "compile: loop traces each distinct decoder layer once and reuses it for the identical ones: the same step, "
        "a shorter first one; auto = on for the loop in one process, off under torchrun",
    )
    keep_mixer_cores: Literal["auto"] | bool = key(
        "auto",
        "under checkpointing, keep the mixers' core outputs (true: faster, more memory) or recompute them in the "
        "backward (false); auto = keep them when the memory estimate fits",
    )
    compile_overrides: list[str] = key(
        [], "per-class plan overrides for compile: modules, as Class=compile|fullgraph|eager|off (see doctor)"
    )
    require_fast_path: bool = key(False, "refuse to train when a mixer would run on a slow fallback")
    device: Literal["auto", "cpu", "cuda"] = key("auto", "where to train")
    distributed: Literal["auto", "ddp", "fsdp"] = key(
        "auto",
        "engine under torchrun or --nproc N: ddp = the whole model on every rank, fsdp = FSDP2 (see fsdp_units), "
        "auto = ddp for LoRA and fsdp for a full fine-tune",
    )
    fsdp_units: str = key(
        "auto",
        "FSDP2's unit: layer (least memory), group:K (K consecutive layers), model (what compile: loop needs), "
        "auto (model under the loop if it leaves room for activations, else the largest group that fits)",
        Bound(
            lambda v, cfg: bool(re.fullmatch(r"auto|layer|model|group:[1-9][0-9]*", str(v))),
            "must be auto, layer, model or group:K (K consecutive decoder layers per unit, K >= 1); e.g. group:4",
        ),
    )
    num_threads: int = key(
        0,
        "CPU threads for torch (0 = auto: one thread for small models on the CPU, else torch's default)",
        at_least(0, "must be 0 (auto) or more"),
        Bound(lambda v, cfg: v <= max_num_threads(), _threads),
    )
