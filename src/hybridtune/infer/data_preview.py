"""`hybridtune data [CONFIG] [--key value ...] [--rows N]`: the configured data as training will see it, without
loading the model's weights (its tokenizer only; a vision-language checkpoint's processor too, for the rows' images
and videos, whose runs of visual tokens are shown as one token and its count).

Renders the first N rows of each data source with the chat template, the trained tokens marked (green on a
terminal; between [[ and ]] elsewhere), with each row's token counts and what sequence_len does to it; then the
packing summary (bins, fill, truncations, drops: the trainer's own data preparation, the objective's spec's, e.g.
for preference data its pair filters, train/objectives/preference.py) and each source's tokenisation cache key. An
objective whose spec has a preview of its own (grpo's prompts) prints that instead. What a row holds is shown, never
obeyed: its terminal control characters are printed escaped (`printable`).
"""

from __future__ import annotations

import logging
import re
import sys
from collections import Counter
from typing import TextIO

from hybridtune.config import TrainConfig, config_help, load_config, parse_overrides
from hybridtune.data.build import PreparedData
from hybridtune.data.chat import with_chat_template
from hybridtune.data.examples import Loaded
from hybridtune.data.pairs import PREFERENCE
from hybridtune.data.pairs import WHY as PAIR_WHY
from hybridtune.data.report import WHY, counts
from hybridtune.errors import ConfigError, printable
from hybridtune.models.hub import resolve_source
from hybridtune.models.loading import tokenizer_for
from hybridtune.runtime.defaults import resolve_defaults
from hybridtune.train.objectives import spec_of

logger = logging.getLogger(__name__)

USAGE = """usage: hybridtune data [CONFIG.yaml] [--key value ...] [--rows N]

Show what a training run with this config trains on: the first N rows (default 2) of each data source rendered
with the chat template, the trained text marked, each row's tokens; the packing summary and the cache key. Takes
the keys `hybridtune train` takes (--dataset FILE, --base_model, --sequence_len, --chat_template_kwargs, ...);
loads the tokenizer only, never the model's weights."""

# A hub model's files the tokenizer needs (no weights are downloaded).
TOKENIZER_FILES = ["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
OPEN, CLOSE = "[[", "]]"
PAD_RUN = re.compile(r"(<\|[a-z_]+_pad\|>)\1{2,}")  # an image's or video's visual tokens: one and the count
GREEN, RESET = "\x1b[32m", "\x1b[0m"


def marked(tokenizer, input_ids: list[int], loss_mask: list[int], color: bool) -> str:
    """The rendered text, each run of trained tokens wrapped in the marks (colour, or [[ ]]). A document's first
    token is never a target, so it is shown untrained."""
    mask = [0, *loss_mask[1:]]
    out, start = [], 0
    for i in range(1, len(input_ids) + 1):
        if i == len(input_ids) or mask[i] != mask[start]:
            text = tokenizer.decode(input_ids[start:i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            text = PAD_RUN.sub(lambda m: f"{m.group(1)} x{len(m.group(0)) // len(m.group(1))}", printable(text))
            if mask[start]:
                text = f"{GREEN}{text}{RESET}" if color else f"{OPEN}{text}{CLOSE}"
            out.append(text)
            start = i
    return "".join(out)


def row_lines(src: Loaded, i: int, tokenizer, notes: dict[str, dict], color: bool) -> list[str]:
    ex = src.examples[i]
    where = src.where(i)
    trained = sum(ex.loss_mask[1:])
    head = f"--- {printable(where)} ({src.fmt}): {len(ex)} tokens, {trained} trained"
    if where in notes:
        r = notes[where]
        why = PAIR_WHY if src.fmt == PREFERENCE else WHY
        head += f"; {why[r['reason']].format(r['sequence_len'])}" + (
            f" ({r['tokens_over']} over)" if r["tokens_over"] else ""
        )
    return [head, marked(tokenizer, ex.input_ids, ex.loss_mask, color)]


def summary(data: PreparedData, cfg: TrainConfig) -> list[str]:
    s = data.stats
    pairs = any(src.fmt == PREFERENCE for src in data.sources)
    what = "preference pairs" if pairs else "training examples"
    line = (
        f"packing: {s.examples_in} {what} -> {s.bins} bins of {cfg.sequence_len} tokens ({s.fill:.0%} full), "
        f"{len(data.eval_examples)} held out"
    )
    lost = _pairs_lost(data.report, cfg.sequence_len) if pairs else counts(data.report)
    line += f"; {lost}" if lost else "; none truncated or dropped"
    lines = [line]
    lines += [printable(f"cache key: {src.source.name}: {src.key}") for src in data.sources]
    return lines


def _pairs_lost(report: list[dict], seq_len: int) -> str:
    """'2 pairs dropped: the chosen and rejected replies are the same, ...' (the training split's; '' for none)."""
    by = Counter(r["reason"] for r in report if r["split"] == "train")
    return ", ".join(f"{n} pair{'s' * (n != 1)} {PAIR_WHY[why].format(seq_len)}" for why, n in sorted(by.items()))


def preview(cfg: TrainConfig, rows: int, out: TextIO, color: bool = False) -> PreparedData:
    """Print the preview of `cfg`'s data to `out`; returns the prepared data."""
    source = resolve_source(cfg.base_model, cfg.revision, files=TOKENIZER_FILES)
    tokenizer = with_chat_template(tokenizer_for(source, cfg.tokenizer), cfg.chat_template)
    from hybridtune.runtime.vision import vision_for  # why here: torch-bound, past argument parsing

    vision = vision_for(source, tokenizer, cfg.min_pixels, cfg.max_pixels)  # None: a text model
    spec = spec_of(cfg.objective)
    if spec.preview is not None:  # the objective's own (grpo's prompts, whose completions are sampled in training)
        return spec.preview(cfg, tokenizer, vision, rows, out)
    loaded = spec.load(cfg, tokenizer, vision)
    defaults = resolve_defaults(cfg, source, loaded.train_lengths())  # sequence_len: auto, as training decides it
    defaults.log(logger)
    cfg = defaults.apply(cfg)
    data = spec.prepare(cfg, tokenizer, loaded)  # train's own: preference pairs filtered and fitted whole
    notes = {r["where"]: r for r in data.report}
    mark = "green" if color else f"between {OPEN} and {CLOSE}"
    print(printable(f"data for {cfg.base_model}'s tokenizer, sequence_len {cfg.sequence_len}; trained text {mark}"),
          file=out)  # fmt: skip
    for src in data.sources:
        shown = min(rows, len(src.examples))
        print(printable(f"\n{src.source.name}: {shown} of {len(src.examples)} rows, format '{src.fmt}'"), file=out)
        for i in range(shown):
            print("\n".join(row_lines(src, i, tokenizer, notes, color)), file=out)
    print("", *summary(data, cfg), sep="\n", file=out)
    return data


def take_rows(argv: list[str]) -> tuple[int, list[str]]:
    """`--rows N` (or `--rows=N`) out of argv."""
    rows, rest, i = 2, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--rows" or arg.startswith("--rows="):
            value = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            if not value.isdigit():
                raise ConfigError(f"--rows {value!r}: give a whole number of rows to show (0 or more)")
            rows = int(value)
            continue
        rest.append(arg)
        i += 1
    return rows, rest


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE + "\n\n" + config_help())
        return 0
    rows, argv = take_rows(argv)
    path = None
    if argv and not argv[0].startswith("--"):
        path, argv = argv[0], argv[1:]
    cfg = load_config(path, parse_overrides(argv))
    preview(cfg, rows, sys.stdout, color=sys.stdout.isatty())
    return 0
