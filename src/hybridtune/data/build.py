"""From config to training bins and held-out examples: load every source (data/sources.py), tokenise it (cached,
data/examples.py), hold out the eval examples (`test_datasets`, else a `val_set_size` share), fit, pack."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

from hybridtune.config import TrainConfig
from hybridtune.data.examples import load_examples
from hybridtune.data.packing import Example, PackStats, fit_to_length, pack
from hybridtune.errors import DataError

logger = logging.getLogger(__name__)


@dataclass
class PreparedData:
    bins: list[list[Example]]  # training bins, each at most sequence_len tokens
    eval_examples: list[Example]
    stats: PackStats


def split_heldout(examples: list[Example], val_set_size: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Deterministic held-out split: a share (< 1) or a count (>= 1) of the examples."""
    n_val = int(round(val_set_size * len(examples))) if val_set_size < 1 else int(val_set_size)
    if n_val == 0:
        return examples, []
    if n_val >= len(examples):
        raise DataError(f"val_set_size={val_set_size} leaves no training examples out of {len(examples)}; lower it")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    val = set(order[:n_val])
    return [e for i, e in enumerate(examples) if i not in val], [examples[i] for i in sorted(val)]


def prepare(cfg: TrainConfig, tokenizer) -> PreparedData:
    def load(sources) -> list[Example]:
        return [e for ds in sources for e in load_examples(ds, tokenizer, cfg.train_on_inputs, cfg.dataset_num_proc)]

    examples = load(cfg.resolved_datasets())
    if cfg.test_datasets:
        train, heldout = examples, load(cfg.test_datasets)
    else:
        train, heldout = split_heldout(examples, cfg.val_set_size, cfg.seed)
    fitted, stats = fit_to_length(train, cfg.sequence_len, cfg.excess_length_strategy)
    heldout, _ = fit_to_length(heldout, cfg.sequence_len, "drop")
    if not fitted:
        raise DataError(
            f"no training examples left after filtering ({stats.examples_in} read, {stats.dropped} dropped as longer than "
            f"sequence_len={cfg.sequence_len} or without any trainable token); raise sequence_len or check the loss mask"
        )
    if cfg.sample_packing:
        bins = [[fitted[i] for i in b] for b in pack(fitted, cfg.sequence_len)]
    else:
        bins = [[e] for e in fitted]
    stats.examples_packed = len(fitted)
    stats.bins = len(bins)
    stats.tokens = sum(len(e) for e in fitted)
    stats.capacity = len(bins) * cfg.sequence_len
    msg = (
        f"data: {stats.examples_in} training examples -> {stats.bins} bins of {cfg.sequence_len} tokens "
        f"({stats.fill:.0%} full); {len(heldout)} held out" + (" (test_datasets)" if cfg.test_datasets else "")
    )
    if stats.truncated or stats.dropped:
        msg += f"; {stats.truncated} truncated, {stats.dropped} dropped (excess_length_strategy={cfg.excess_length_strategy})"
    logger.info(msg)
    return PreparedData(bins, heldout, stats)
