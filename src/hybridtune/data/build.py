"""From config to training bins and held-out examples: load every source (data/sources.py), tokenise it (cached,
data/examples.py), hold out the eval examples (`test_datasets`, else a `val_set_size` share: `load_data`), fit to
sequence_len (every truncated or dropped row recorded: data/report.py), pack (`prepare`). Between the two, a trainer
decides `sequence_len: auto` from the training examples' lengths (`covering_length`, runtime/defaults.py)."""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from dataclasses import dataclass, field

from hybridtune.config import PRESET_SEQUENCE_LEN, TrainConfig
from hybridtune.data.chat import check_template_kwargs
from hybridtune.data.examples import Loaded, load_source
from hybridtune.data.images import set_image_policy
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
    sequence_len: int = 0  # the bins' size (a `sequence_len: auto` as decided)


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


def covering_length(lengths: list[int], share: float, cap: int | None = None) -> int:
    """The smallest power of two (at least 2) that holds a `share` of `lengths` whole (their nearest-rank quantile),
    at most `cap` (a model's context); `cap` (or 2) for no lengths."""
    if not lengths:
        return cap or 2
    quantile = sorted(lengths)[max(0, math.ceil(share * len(lengths)) - 1)]
    n = 1 << max(1, math.ceil(math.log2(max(quantile, 2))))
    return min(n, cap) if cap else n


def bins_for(lengths: list[int], seq_len: int, sample: int = 20_000) -> int:
    """How many bins of `seq_len` tokens `pack` fills with documents of `lengths` (each cut to `seq_len`); past
    `sample` documents, estimated from a fixed random sample of them (first-fit's bins grow with the documents)."""
    if len(lengths) > sample:
        part = random.Random(0).sample(lengths, sample)
        return math.ceil(bins_for(part, seq_len, sample) * len(lengths) / sample)
    return len(pack([range(min(n, seq_len)) for n in lengths if n], seq_len)) if lengths else 0


@dataclass
class LoadedData:
    """Every source tokenised and split, before sequence_len: (source, row) of each training and held-out example."""

    sources: list[Loaded]
    train: list[tuple[Loaded, int]]
    heldout: list[tuple[Loaded, int]]

    def train_lengths(self) -> list[int]:
        return [len(src.examples[i]) for src, i in self.train]


def load_data(cfg: TrainConfig, tokenizer, vision=None) -> LoadedData:
    """Every source tokenised and split (`vision`: a vision-language model's, data/vision.py, takes the rows' images)."""
    kwargs = check_template_kwargs(cfg.chat_template_kwargs)
    set_image_policy(cfg.allow_outside_images, cfg.image_roots)  # (where the rows' images may be read from)

    def load(sources) -> list[Loaded]:
        return [
            load_source(ds, tokenizer, cfg.train_on_inputs, cfg.dataset_num_proc, template_kwargs=kwargs, vision=vision)
            for ds in sources
        ]

    def rows(loaded: list[Loaded]) -> list[tuple[Loaded, int]]:  # (source, row) of every example, in order
        return [(src, i) for src in loaded for i in range(len(src.examples))]

    sources = load(cfg.resolved_datasets())
    if cfg.test_datasets:
        test = load(cfg.test_datasets)
        train, heldout = rows(sources), rows(test)
        sources += test
    else:
        train, heldout = split_heldout(rows(sources), cfg.val_set_size, cfg.seed)
    return LoadedData(sources, train, heldout)


def prepare(cfg: TrainConfig, tokenizer, loaded: LoadedData | None = None) -> PreparedData:
    """The run's bins and held-out examples (`loaded`: `load_data`'s, when the caller has it). A `sequence_len: auto`
    that the caller has not decided (runtime/defaults.py) is the preset's PRESET_SEQUENCE_LEN."""
    loaded = loaded or load_data(cfg, tokenizer)
    if cfg.sequence_len == "auto":
        cfg = dataclasses.replace(cfg, sequence_len=PRESET_SEQUENCE_LEN)
    sources, train, heldout = loaded.sources, loaded.train, loaded.heldout

    def fit_rows(picked: list[tuple[Loaded, int]], strategy: str, split: str):
        examples = [src.examples[i] for src, i in picked]
        return fit(examples, lambda k: picked[k][0].where(picked[k][1]), cfg.sequence_len, strategy, split)

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
    return PreparedData(bins, held, stats, report, sources, cfg.sequence_len)
