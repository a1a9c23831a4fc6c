"""Packing by default (issue 46): with `sequence_len: auto`, short data packs many examples (or preference pairs) to
an optimizer step, not one: the pack length is raised from the length that holds the examples until a step holds
PACK_EXAMPLES of them, as long as an epoch keeps MIN_STEPS steps and the model's context allows; what a step then
holds (examples and tokens) is a `choice batch` line with its reason. Small data keeps its steps; a given
sequence_len, sample_packing: false and a resume's recorded value are kept."""

from __future__ import annotations

import logging
import math
import random
from pathlib import Path

import pytest

from hybridtune.config import load_config
from hybridtune.data.packing import pack
from hybridtune.models.hub import ModelSource
from hybridtune.runtime import defaults as dflt
from hybridtune.runtime.defaults import resolve_defaults

CHECKPOINT = ModelSource("acme/tiny", Path("/nonexistent"), "abc")  # a checkpoint (no config.json: no context)
PRESET = ModelSource("tiny-qwen3_5", None)


def cfg_of(**kw):
    return load_config(None, {"output_dir": "/tmp/unused-run", **kw}, warn=False)


def short(n: int, lo: int = 30, hi: int = 50) -> list[int]:
    rng = random.Random()
    return [rng.randint(lo, hi) for _ in range(n)]


def per_step(lengths: list[int], seq_len: int, bins_a_step: int = 1) -> float:
    """Examples an optimizer step holds when `lengths` are packed into bins of `seq_len`, as training packs them."""
    bins = pack([range(n) for n in lengths], seq_len)
    return len(lengths) / math.ceil(len(bins) / bins_a_step)


@pytest.mark.parametrize("source", [CHECKPOINT, PRESET])
@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_short_data_packs_at_least_8_a_step_said_in_a_choice_line(source, objective, caplog):
    lengths = short(random.randint(280, 320))  # about 300 examples (pairs) of about 40 tokens
    d = resolve_defaults(cfg_of(objective=objective), source, lengths)
    n = d.sequence_len.value
    assert per_step(lengths, n) >= dflt.PACK_EXAMPLES
    assert math.ceil(len(pack([range(k) for k in lengths], n))) >= dflt.MIN_STEPS  # an epoch keeps its steps
    assert per_step(lengths, n // 2) < dflt.PACK_EXAMPLES  # the least such length, not a larger one
    with caplog.at_level(logging.INFO):
        d.log(logging.getLogger("hybridtune.test"))
    unit = "pairs" if objective == "dpo" else "examples"
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("choice batch: "))
    shown = float(line.split()[2])
    assert shown == pytest.approx(per_step(lengths, n), abs=0.051) and shown >= 8, line  # (shown to 0.1)
    assert line.split()[3] == unit + "," and f"bins of {n} tokens" in line and "steps an epoch" in line
    seq = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("choice sequence_len: "))
    assert f"raised to pack at least {dflt.PACK_EXAMPLES} a step" in seq


def test_the_step_counts_micro_batches_and_accumulation():
    lengths = short(300)
    plain = resolve_defaults(cfg_of(), CHECKPOINT, lengths).sequence_len.value
    acc = random.choice([2, 4])
    d = resolve_defaults(cfg_of(gradient_accumulation_steps=acc), CHECKPOINT, lengths)
    assert d.sequence_len.value < plain  # the step's bins hold the examples: each bin needs fewer
    assert per_step(lengths, d.sequence_len.value, acc) >= dflt.PACK_EXAMPLES
    assert d.batch.value["examples"] == pytest.approx(per_step(lengths, d.sequence_len.value, acc))


def test_small_data_keeps_its_steps(caplog):
    lengths = short(random.randint(18, 30), 33, 50)  # fewer than 8 x MIN_STEPS: a longer pack leaves too few steps
    d = resolve_defaults(cfg_of(), CHECKPOINT, lengths)
    assert d.sequence_len.value == 64  # the least power of two holding them, as before
    assert d.batch.value["examples"] == pytest.approx(1.0)
    assert "a longer pack would leave an epoch fewer than 16 steps" in d.batch.reason


def test_the_pack_stays_within_the_models_context(tmp_path):
    from checkpoints import make_checkpoint

    ckpt = make_checkpoint(tmp_path, "qwen3_5_text")
    source = ModelSource(str(ckpt), ckpt)
    context = dflt.model_context(source)
    lengths = short(2000, context // 8, context // 5)  # long enough that 8 a step would need more than the context
    d = resolve_defaults(cfg_of(), source, lengths)
    assert d.sequence_len.value == context and d.batch.value["examples"] < dflt.PACK_EXAMPLES


def test_given_values_no_packing_grpo_and_a_resume_are_kept():
    lengths = short(300)
    given = resolve_defaults(cfg_of(sequence_len=64), CHECKPOINT, lengths)
    assert given.sequence_len.value == 64 and given.batch.value["examples"] == pytest.approx(per_step(lengths, 64))
    alone = resolve_defaults(cfg_of(sample_packing=False), CHECKPOINT, lengths)
    assert alone.sequence_len.value == 64 and alone.batch.value["examples"] == 1.0
    assert "one example a bin (sample_packing: false)" in alone.batch.reason
    grpo = resolve_defaults(cfg_of(objective="grpo", adapter="lora"), CHECKPOINT, lengths)
    assert grpo.sequence_len.value == 64 and grpo.batch.value is None
    resumed = resolve_defaults(cfg_of(), CHECKPOINT, lengths, {"sequence_len": 128})
    assert resumed.sequence_len.value == 128 and "as the run this resumes decided it" in resumed.sequence_len.reason


def test_the_demo_keeps_its_length():
    """The README's demo (a preset on the bundled arithmetic chats, about 17 tokens each) already packs 15 a step."""
    d = resolve_defaults(cfg_of(), PRESET, short(7680, 14, 20))
    assert d.sequence_len.value == 256 and d.batch.value["examples"] >= dflt.PACK_EXAMPLES


def test_large_data_is_packed_once_per_length_from_a_sample():
    """Past 20,000 documents the bins are estimated from a fixed sample of them: within 2% of packing them all."""
    from hybridtune.data.build import bins_for

    lengths = short(random.randint(40_000, 60_000), 5, 120)
    n = random.choice([256, 512, 1024])
    exact = len(pack([range(k) for k in lengths], n))
    assert abs(bins_for(lengths, n) - exact) <= 0.02 * exact
    assert bins_for(lengths, n, sample=len(lengths)) == exact
