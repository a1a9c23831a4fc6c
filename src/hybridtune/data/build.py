"""From config to training bins and held-out examples: load every source (data/sources.py), tokenise it (cached,
data/examples.py), hold out the eval examples (`test_datasets`, else a `val_set_size` share), fit to sequence_len
(every truncated or dropped row recorded: data/report.py), pack."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

from hybridtune.config import TrainConfig
from hybridtune.data.chat import check_template_kwargs
from hybridtune.data.examples import Loaded, load_source
from hybridtune.data.packing import Example, PackStats, pack
from hybridtune.data.report import counts, fit, log_records
from hybridtune.errors import DataError

logger = logging.getLogger(__name__)


@dataclass
class PreparedData:
    bins: list[list[Example]]  # training bins, each at most sequence_len tokens
    eval_examples: list[Example]
    stats: PackStats
    report: list[dict] = field(default_factory=list)  # every truncated or dropped row (data/report.py's records)
    sources: list[Loaded] = field(default_factory=list)  # each data source's examples, rows, cache key and format


def split_heldout(examples: list, val_set_size: float, seed: int) -> tuple[list, list]:
    """Deterministic held-out split: a share (< 1) or a count (>= 1) of the examples (or of anything listed)."""
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
    kwargs = check_template_kwargs(cfg.chat_template_kwargs)

    def load(sources) -> list[Loaded]:
        return [
            load_source(ds, tokenizer, cfg.train_on_inputs, cfg.dataset_num_proc, template_kwargs=kwargs)
            for ds in sources
        ]

    def rows(loaded: list[Loaded]) -> list[tuple[Loaded, int]]:  # (source, row) of every example, in order
        return [(src, i) for src in loaded for i in range(len(src.examples))]

    def fit_rows(picked: list[tuple[Loaded, int]], strategy: str, split: str):
        examples = [src.examples[i] for src, i in picked]
        return fit(examples, lambda k: picked[k][0].where(picked[k][1]), cfg.sequence_len, strategy, split)

    sources = load(cfg.resolved_datasets())
    if cfg.test_datasets:
        test = load(cfg.test_datasets)
        train, heldout = rows(sources), rows(test)
        sources += test
    else:
        train, heldout = split_heldout(rows(sources), cfg.val_set_size, cfg.seed)
    fitted, stats, report = fit_rows(train, cfg.excess_length_strategy, "train")
    held, _, held_report = fit_rows(heldout, "drop", "heldout")
    report += held_report
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
        f"({stats.fill:.0%} full); {len(held)} held out" + (" (test_datasets)" if cfg.test_datasets else "")
    )
    lost = counts(report)
    if lost:
        msg += f"; {lost} (excess_length_strategy={cfg.excess_length_strategy})"
    if held_report:
        msg += f"; {len(held_report)} held-out dropped"
    logger.info(msg)
    log_records(report)
    return PreparedData(bins, held, stats, report, sources)
