"""Benchmark data: packs of documents with a realistic spread of lengths, the same for every mode.

Document lengths are drawn from a log-normal distribution (median 400 tokens, sigma 0.9: most
documents a few hundred tokens, a long tail past 2,000, as in instruction and chat corpora) and laid
end to end until the pack holds exactly `seq_len` tokens; the last document is cut to fit, as a
packer that splits documents would do. Token ids are uniform random over the vocabulary (never zeros);
the first quarter of each document is an untrained prompt, the rest trained, so the loss covers about
three quarters of the tokens. Everything is seeded: every mode and every process sees the same packs.
"""

from __future__ import annotations

import math
import random

import torch

from hybridtune.data import PackedCollator
from hybridtune.data.collator import StaticLayout
from hybridtune.data.packing import Example

MEDIAN_DOC = 400
SIGMA = 0.9
MIN_DOC = 16
PROMPT_SHARE = 0.25


def pack_layouts(seq_len: int, n: int, seed: int = 0) -> list[list[int]]:
    """`n` packs of exactly `seq_len` tokens, each a list of document lengths."""
    rng = random.Random(seed)
    layouts = []
    for _ in range(n):
        lens, left = [], seq_len
        while left > 0:
            d = int(round(rng.lognormvariate(math.log(MEDIAN_DOC), SIGMA)))
            d = min(left, max(MIN_DOC, d))
            if 0 < left - d < MIN_DOC:  # never leave a sliver shorter than a real document
                d = left
            lens.append(d)
            left -= d
        layouts.append(lens)
    return layouts


def make_batches(
    layouts: list[list[int]], vocab_size: int, seed: int = 0, static: bool | StaticLayout | None = False
) -> list[dict]:
    """Collated packed batches (see `hybridtune.data.collator`) for the given layouts; `static`: all filled to
    a static layout (filler documents, as `hybridtune train` does under a compile): the one given (train's
    `pack_layout` choice), or with True one fitted over them."""
    gen = torch.Generator().manual_seed(seed)
    layout = StaticLayout.fit(layouts, max_filler=1.0) if static is True else (static or None)
    collate = PackedCollator(layout=layout)
    batches = []
    for lens in layouts:
        docs = []
        for n in lens:
            ids = torch.randint(0, vocab_size, (n,), generator=gen).tolist()
            prompt = int(n * PROMPT_SHARE)
            docs.append(Example(ids, [0] * prompt + [1] * (n - prompt)))
        batch = collate(docs)
        batch["doc_lens"] = list(lens)
        batches.append(batch)
    return batches
