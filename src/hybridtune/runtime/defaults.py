"""The `auto` defaults that follow from what the model is, decided once before the data is packed, each a `Choice`
with its reason (logged `choice learning_rate: ...`, as runtime/choices.py's are):

    learning_rate  a preset: the demo's 1e-3; a checkpoint: 2e-4 under LoRA, 1e-5 for a full fine-tune
    sequence_len   a preset: 256; a checkpoint: the smallest power of two holding COVER of the training examples
                   whole (data.build.covering_length), at most the model's context (max_position_embeddings); then,
                   for packed data, doubled while an optimizer step holds fewer than PACK_EXAMPLES examples (or
                   preference pairs) and an epoch keeps MIN_STEPS steps (`pack_length`)
    batch          what an optimizer step then holds: examples (pairs) and tokens, from the packing (logged only)

A given value is kept. A resumed run takes the values its checkpoint's run record holds (`RESOLVED`), so a resume
never packs or steps differently from the run it continues. The step's memory at that length is
gradient_checkpointing: auto's to fit (runtime/memory.py), not this choice's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path

from hybridtune.config import PRESET_LEARNING_RATE, PRESET_SEQUENCE_LEN, TrainConfig, objective_traits
from hybridtune.data.build import bins_for, covering_length
from hybridtune.models.hub import ModelSource
from hybridtune.runtime.adapter_kind import adapter_kind
from hybridtune.runtime.facts import Choice

# What practitioners start a released checkpoint at (peft's and TRL's LoRA examples; full fine-tunes of instruct
# models 1e-5 to 2e-5): a LoRA adapter starts at zero and needs the larger step, full weights the small one.
LORA_LEARNING_RATE = 2e-4
FULL_LEARNING_RATE = 1e-5
COVER = 0.99  # the share of the training examples `sequence_len: auto` keeps whole
RESOLVED = "resolved"  # the run record's key holding the values the run's `auto`s took ({"sequence_len": 512, ...})
KEYS = ("learning_rate", "sequence_len")
# Short data packed to the length that holds its longest examples is one example a step: the default learning rates
# above are what practitioners use with a batch of about 8 to 32 examples, so `sequence_len: auto` packs at least
# PACK_EXAMPLES of them a step where the data allow it. It stops before an epoch has fewer than MIN_STEPS optimizer
# steps (small data keeps its updates, and the warmup stays a small part of the run), at the model's context, and
# without a context (a preset) at MAX_PACK tokens.
PACK_EXAMPLES = 8
MIN_STEPS = 16
MAX_PACK = 4096


@dataclasses.dataclass(frozen=True)
class Defaults:
    learning_rate: Choice
    sequence_len: Choice
    batch: Choice = Choice(None, "not decided")  # {"examples": float, "tokens": float, "unit": str} per step

    def resolved(self) -> dict:
        """The values, for the run record (`RESOLVED`) and the config."""
        return {k: getattr(self, k).value for k in KEYS}

    def apply(self, cfg: TrainConfig) -> TrainConfig:
        return dataclasses.replace(cfg, **self.resolved())

    def log(self, log: logging.Logger) -> None:
        for k in KEYS:
            c: Choice = getattr(self, k)
            log.info("choice %s: %s (%s)", k, f"{c.value:g}" if isinstance(c.value, float) else c.value, c.reason)
        b = self.batch.value
        shown = f"{b['examples']:.1f} {b['unit']}, {b['tokens']:.0f} tokens per optimizer step" if b else "-"
        log.info("choice batch: %s (%s)", shown, self.batch.reason)


def model_context(source: ModelSource) -> int | None:
    """The checkpoint's context length: config.json's max_position_embeddings (its text_config's, for a
    vision-language model); None for a preset or a config without it. Reads JSON only."""
    if source.path is None:
        return None
    try:
        config = json.loads((Path(source.path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for part in (config.get("text_config"), config):
        value = part.get("max_position_embeddings") if isinstance(part, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 2:
            return value
    return None


def choose_learning_rate(cfg: TrainConfig, preset: bool, recorded: dict) -> Choice:
    if cfg.learning_rate != "auto":
        return Choice(cfg.learning_rate, "given")
    if isinstance(recorded.get("learning_rate"), float):
        return Choice(recorded["learning_rate"], "auto: as the run this resumes decided it")
    if preset:
        return Choice(PRESET_LEARNING_RATE, "auto: a preset with random weights, the demo's rate")
    if adapter_kind(cfg).lora:
        return Choice(LORA_LEARNING_RATE, "auto: LoRA on a checkpoint, as practitioners start it")
    return Choice(FULL_LEARNING_RATE, "auto: a full fine-tune of a checkpoint, as practitioners start it")


def packs(cfg: TrainConfig) -> bool:
    """Whether `cfg`'s training data are packed into bins of sequence_len (a sampling objective's, grpo's, bins are
    its completions)."""
    return cfg.sample_packing and objective_traits(cfg.objective).packed


def bins_per_step(cfg: TrainConfig) -> int:
    """Bins an optimizer step takes: micro_batch_size x gradient_accumulation_steps x the processes (torchrun's)."""
    world = os.environ.get("WORLD_SIZE", "1")
    return cfg.micro_batch_size * cfg.gradient_accumulation_steps * (int(world) if world.isdigit() else 1)


def stepper(cfg: TrainConfig, lengths: list[int]) -> Callable[[int], int]:
    """Optimizer steps an epoch of `lengths` takes at a sequence_len, each length packed once (large data packs
    slowly, and a length is asked about more than once)."""
    seen: dict[int, int] = {}

    def steps(n: int) -> int:
        if n not in seen:
            bins = bins_for(lengths, n) if packs(cfg) else len(lengths)
            seen[n] = max(1, math.ceil(bins / bins_per_step(cfg)))
        return seen[n]

    return steps


def pack_length(lengths: list[int], start: int, cap: int, steps: Callable[[int], int]) -> int:
    """`start` doubled while a step of its packs holds fewer than PACK_EXAMPLES of `lengths` and the next length,
    at most `cap`, keeps an epoch at MIN_STEPS optimizer steps or more (`steps`: `stepper`'s)."""
    n = start
    while len(lengths) / steps(n) < PACK_EXAMPLES and 2 * n <= cap:
        if steps(2 * n) < MIN_STEPS:
            break
        n *= 2
    return n


def choose_sequence_len(
    cfg: TrainConfig, lengths: list[int], context: int | None, preset: bool, recorded: dict, steps=None
) -> Choice:
    """`lengths`: the training examples' (or preference pairs') token counts; `steps`: `stepper`'s for them."""
    steps = steps or stepper(cfg, lengths)
    given = cfg.sequence_len != "auto"
    value = cfg.sequence_len if given else recorded.get("sequence_len")
    if isinstance(value, int) and not given:
        return Choice(value, f"auto: as the run this resumes decided it; {_fits(lengths, value)}")
    if given:
        return Choice(value, f"given; {_fits(lengths, value)}")
    if preset:
        start, why = PRESET_SEQUENCE_LEN, "a preset, the demo's length"
    else:
        start = covering_length(lengths, COVER, context)
        if context is not None and start == context and covering_length(lengths, COVER) > context:
            why = f"the model's context (max_position_embeddings {context})"
        else:
            ctx = f", within the model's context of {context}" if context else ""
            why = f"the smallest power of two holding {COVER:.0%} of them{ctx}"
    n = pack_length(lengths, start, context or max(start, MAX_PACK), steps) if packs(cfg) and lengths else start
    if n > start:
        unit = objective_traits(cfg.objective).unit
        few = len(lengths) / steps(start)
        why += (
            f", {start}, packs {few:.1f} {unit} a step: raised to pack at least {PACK_EXAMPLES} a step while an "
            f"epoch keeps {MIN_STEPS} steps or more"
        )
    return Choice(n, f"auto: {why}; {_fits(lengths, n)}")


def choose_batch(cfg: TrainConfig, lengths: list[int], seq_len: int, steps=None) -> Choice:
    """What an optimizer step holds at `seq_len`: examples (pairs) and tokens, on average over an epoch."""
    if (traits := objective_traits(cfg.objective)).sampled:
        what = f"{traits.name}: a step holds micro_batch_size x gradient_accumulation_steps {traits.unit}' completions"
        return Choice(None, what)
    if not lengths:
        return Choice(None, "no training examples")
    steps, per = (steps or stepper(cfg, lengths))(seq_len), bins_per_step(cfg)
    tokens = sum(min(n, seq_len) for n in lengths)
    value = {"examples": len(lengths) / steps, "tokens": tokens / steps, "unit": traits.unit}
    how = "" if packs(cfg) else ", one example a bin (sample_packing: false)"
    world = per // (cfg.micro_batch_size * cfg.gradient_accumulation_steps)
    why = (
        f"bins of {seq_len} tokens{how}, {per} a step (micro_batch_size {cfg.micro_batch_size} x "
        f"gradient_accumulation_steps {cfg.gradient_accumulation_steps} x {world} process(es)); {steps} steps an epoch"
    )
    if packs(cfg) and cfg.sequence_len == "auto" and value["examples"] < PACK_EXAMPLES:
        why += (
            f"; fewer than {PACK_EXAMPLES} a step: a longer pack would leave an epoch fewer than {MIN_STEPS} steps "
            "or pass the model's context"
        )
    return Choice(value, why)


def _fits(lengths: list[int], n: int) -> str:
    if not lengths:
        return "no training examples"
    fit = sum(length <= n for length in lengths)
    return f"{fit / len(lengths):.1%} of the {len(lengths)} training examples fit whole (longest {max(lengths)} tokens)"


def recorded_values(run: dict | None) -> dict:
    """The values a run record ({"config": ..., RESOLVED: ...}) says its `auto`s took; {} when it says none."""
    held = run.get(RESOLVED) if isinstance(run, dict) else None
    if isinstance(held, dict):
        return {k: v for k, v in held.items() if k in KEYS}
    # A run from before these keys had `auto` recorded the numbers it ran with in its config: it continues with them.
    config = run.get("config") if isinstance(run, dict) else None
    if not isinstance(config, dict):
        return {}
    return {k: config[k] for k in KEYS if isinstance(config.get(k), (int, float)) and not isinstance(config[k], bool)}


def resolve_defaults(
    cfg: TrainConfig, source: ModelSource, lengths: list[int], recorded: dict | None = None
) -> Defaults:
    """Every default of this module for `cfg` on `source` (see the module docstring); `recorded`: a resumed run's
    `recorded_values`."""
    recorded = recorded or {}
    steps = stepper(cfg, lengths)
    seq = choose_sequence_len(cfg, lengths, model_context(source), source.is_preset, recorded, steps)
    return Defaults(
        learning_rate=choose_learning_rate(cfg, source.is_preset, recorded),
        sequence_len=seq,
        batch=choose_batch(cfg, lengths, seq.value, steps),
    )
