"""The `memory` choice: whether the weights and optimizer as configured fit the GPU, said before the first step.

The configured setup's peak is estimated as the model's bytes as loaded plus the step's (`memory.step_bytes`, with
the run's checkpointing, beside the gradients and optimizer state `measure.state_bytes` counted). When it fills more
than `FIT_SHARE` of the free memory, one warning names the lighter setups that would fit, each with its estimate
and the key to set: LoRA on a bf16 base -> `load_in_4bit: true` (QLoRA: its targets in NF4, `memory.nf4_bytes`,
plus the dequantised transient of its largest weight); a full fine-tune with AdamW -> `optim: adamw_8bit` or
`adamw_bf16_sr` (`memory.optimizer_bytes`, their weights held as `optim.model_dtype` asks). Nothing is switched: the
run keeps its config (its first step's out-of-memory retry, runtime/oom.py, still covers an estimate too low).
On the CPU the peak is compared with the machine's memory: past it a warning, past `HOST_REFUSE` times it refused.
"""

from __future__ import annotations

import dataclasses
import os

from hybridtune.config import TrainConfig
from hybridtune.errors import ConfigError
from hybridtune.runtime.adapter_kind import FULL, LORA, adapter_kind
from hybridtune.runtime.facts import Choice, Facts
from hybridtune.runtime.memory import FIT_SHARE, GIB, optimizer_bytes, step_bytes
from hybridtune.runtime.optim import model_dtype, optim_name

LIGHTER_OPTIMS = ("adamw_8bit", "adamw_bf16_sr")


def configured(cfg: TrainConfig, facts: Facts, bf16: bool) -> str:
    """The weights and optimizer as configured, in words (the choice's value)."""
    optim, kind = optim_name(cfg), adapter_kind(cfg)
    if kind.lora:
        return f"{cfg.adapter} on a{' NF4' if kind.nf4_base else ' bf16' if bf16 else 'n fp32'} base, {optim}"
    masters = kind.uses_masters(optim, bf16, facts.engine)
    return f"full fine-tune, {optim}{' with fp32 masters' if masters else ''}"


def _held(optim: str, facts: Facts, masters: bool) -> int:
    """Gradients and optimizer state of the trainable values as `facts` measured them (their bytes each as held)."""
    n = facts.trainable
    return optimizer_bytes(optim, n, facts.trainable_bytes // n, masters) if n else 0


def alternatives(cfg: TrainConfig, facts: Facts, bf16: bool) -> list[tuple[str, int, int]]:
    """(the setting to make, the model's bytes under it less those now, the step's state bytes less those now) of
    each lighter setup for this run."""
    out, kind = [], adapter_kind(cfg)
    if kind is LORA and facts.nf4_saving:  # (LoRA on a bf16 or fp32 base: QLoRA's NF4 one is lighter)
        out.append(("load_in_4bit: true (QLoRA)", -facts.nf4_saving, facts.nf4_transient))
    optim = optim_name(cfg)
    if kind is FULL and optim == "adamw" and facts.trainable:
        masters = kind.uses_masters(optim, bf16, facts.engine)
        now = _held(optim, facts, masters)
        n, width_now = facts.trainable, facts.trainable_bytes // facts.trainable
        for alt in LIGHTER_OPTIMS if bf16 else LIGHTER_OPTIMS[:1]:
            width = (model_dtype(dataclasses.replace(cfg, optim=alt), bf16) or kind.held_dtype(bf16)).itemsize
            # (under bf16 autocast the backward keeps a bf16 copy of each fp32 weight: `measure.state_bytes`)
            copies = 2 * n * (bf16 and width == 4) - 2 * n * (bf16 and width_now == 4)
            state = optimizer_bytes(alt, n, width, False) - now + copies
            out.append((f"optim: {alt}", n * width - facts.trainable_bytes, state))
    return out


def choose_memory(cfg: TrainConfig, facts: Facts, tokens: int, bf16: bool, fused: bool, checkpointing: bool) -> Choice:
    """The configured weights and optimizer (never switched), the estimated peak at micro-batches of `tokens`
    tokens and, on a GPU, whether it fits the free memory; a warning with the lighter setups that would fit when it
    does not (see the module doc). Under FSDP2 the units choice plans the memory (`fsdp_units`)."""
    value = configured(cfg, facts, bf16)
    if facts.engine == "fsdp":
        return Choice(value, "under FSDP2 the layers per unit are fitted to the memory (fsdp_units)")
    if facts.shapes is None or not facts.shapes.layer_types or not facts.shapes.hidden:
        return Choice(value, "not estimated: the model's layer widths are unknown")

    def peak(weights: int = 0, state: int = 0) -> int:
        est = step_bytes(facts.shapes, tokens, bf16=bf16, fused_loss=fused, state_bytes=facts.state_bytes + state)
        return facts.resident_bytes + weights + (est.with_checkpointing if checkpointing else est.without)

    need = peak()
    ckpt = "with" if checkpointing else "without"
    figures = f"about {need / GIB:.1f} GiB at peak ({tokens}-token micro-batches {ckpt} checkpointing)"
    free = facts.gpu_free_bytes
    if facts.device != "cuda" and facts.host_bytes:
        return _on_the_host(value, figures, need, facts.host_bytes, tokens)
    if facts.device != "cuda" or free is None:
        return Choice(value, f"{figures}; no GPU memory to compare with")
    # What the step may fill: FIT_SHARE of the free memory once the model loaded, beside the model as loaded.
    room = FIT_SHARE * free + facts.resident_bytes
    of = f"{FIT_SHARE:.0%} of the {free / GIB:.1f} GiB free beside the {facts.resident_bytes / GIB:.1f} GiB model"
    if need <= room:
        return Choice(value, f"fits: {figures}, within {of}")
    others = [(key, peak(w, s)) for key, w, s in alternatives(cfg, facts, bf16)]
    fitting = [f"{key} about {n / GIB:.1f} GiB" for key, n in others if n <= room]
    over = [f"{key} about {n / GIB:.1f} GiB" for key, n in others if n > room]
    if fitting:
        advice = f"set {' or '.join(fitting)} (fits){'; not ' + ', '.join(over) if over else ''}"
    elif over:
        advice = f"lighter setups do not fit either ({', '.join(over)}); a shorter sequence_len needs less"
    else:
        advice = "no lighter weights or optimizer for it; a shorter sequence_len needs less"
    warning = (
        f"memory: {value} needs {figures}, more than {of}; the first step may run out of memory: {advice} "
        "(nothing is switched)"
    )
    return Choice(value, f"does not fit: {figures}, more than {of}", (warning,))


# A CPU step past the machine's memory is not caught as a GPU's is (the OS swaps or kills the process): a step over
# it is warned of, one past HOST_REFUSE times it (a sequence_len of a billion, say) refused before it starts.
HOST_REFUSE = 4


def host_memory() -> int | None:
    """The machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _on_the_host(value: str, figures: str, need: int, host: int, tokens: int) -> Choice:
    """The `memory` choice of a run on the CPU, against the machine's memory `host`."""
    of = f"the {host / GIB:.1f} GiB of this machine's memory"
    fix = f"a shorter sequence_len or micro_batch_size needs less ({tokens} tokens a micro-batch now)"
    if need > HOST_REFUSE * host:
        raise ConfigError(f"memory: {value} needs {figures}, over {HOST_REFUSE} times {of}: {fix}")
    if need <= host:
        return Choice(value, f"{figures}, within {of}")
    warning = f"memory: {value} needs {figures}, more than {of}; the step may swap or be killed: {fix}"
    return Choice(value, f"does not fit: {figures}, more than {of}", (warning,))
