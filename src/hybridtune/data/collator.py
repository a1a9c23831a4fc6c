"""`PackedCollator`: turns a bin of packed examples into the batch every layer reads, its layout computed once.

    input_ids, labels, position_ids  int64 [1, T]  labels: -100 at masked tokens and every document's first
                                                   token (unshifted); positions restart at 0 per document
    cu_seq_lens_q, cu_seq_lens_k     int32 [N + 1] cumulative document lengths (the two are equal)
    max_length_q, max_length_k       int           longest document (a python int: no device sync)
    (each registered mixer's)        e.g. int32 [C, 2] chunk indices: `MixerSpec.metadata`, hybridtune.mixers
    num_loss_tokens, num_tokens      int           label positions in the loss; the bin's tokens (T without filler)
    pixel_values, image_grid_thw,    (packs with images) the vision tower's input, each document's own M-RoPE
    mrope_position_ids               positions [3, T] (`PackedCollator(vision=...)`, data/vision.py)

Dynamic layout (the default): T is the sum of the bin's document lengths, no padding. Static layout
(`PackedCollator(layout=StaticLayout.fit(...))`): every batch has the same T and N, made up by filler documents after
the bin (pad tokens, labels -100, positions from 0); only C varies. Zero-length documents never appear.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from hybridtune.batch import (
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    IMAGE_GRID_THW,
    INPUT_IDS,
    LABELS,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    MROPE_POSITION_IDS,
    NUM_LOSS_TOKENS,
    NUM_TOKENS,
    PIXEL_VALUES,
    POSITION_IDS,
)
from hybridtune.data.packing import Example
from hybridtune.data.vision import rope_positions
from hybridtune.mixers import MIXERS, registry

IGNORE_INDEX = -100


class FillerShares(NamedTuple):
    """The filler's share of the computed tokens, and per mixer kind of its metadata rows (`MixerSpec.size`: a
    chunked mixer's chunks), `StaticLayout.filler_shares`."""

    tokens: float
    sizes: dict[str, float]

    @property
    def cost(self) -> float:
        """The estimated share of step time: the token share for the per-token work (projections, MLP, attention,
        loss) and each mixer's size share for the `time_share` of the step its kernels take."""
        shares = {k: MIXERS[k].time_share for k in self.sizes if k in MIXERS}
        return (1 - sum(shares.values())) * self.tokens + sum(w * self.sizes[k] for k, w in shares.items())


@dataclass(frozen=True)
class StaticLayout:
    """The fixed sizes of every batch of a static layout: `tokens` (T) and `docs` (N).

    The rows of the mixers' dynamic metadata (a chunked mixer's chunk count C, `MixerSpec.size`) are left to
    each batch: only the mixers' opaque ops read them, so the compiled loop marks them dynamic at no tracing cost
    and the filler needs no chunk arithmetic (fixing C as well cost 64 filler tokens for every chunk of difference
    between packs)."""

    tokens: int
    docs: int

    @classmethod
    def fit(cls, bins: Iterable[Sequence[int]], max_filler: float = 0.5) -> StaticLayout | None:
        """The smallest T for which every bin (its document lengths) fills up exactly, or None when the filler
        would cost more than `max_filler` of the step (`filler_cost`: tokens and mixer metadata rows, weighted).

        A bin of n documents and t tokens takes k = N - n >= 1 filler documents of at least one token each, so
        T >= t - n + N for every bin: the smallest T is max(t - n) + N with the smallest N, max n + 1.
        """
        bins = [list(b) for b in bins]
        if not bins or any(not b or min(b) <= 0 for b in bins):
            raise ValueError("StaticLayout.fit needs bins of positive document lengths")
        N = max(map(len, bins)) + 1
        T = max(sum(b) - len(b) for b in bins) + N
        layout = cls(tokens=T, docs=N)
        return layout if layout.filler_cost(bins) <= max_filler else None

    def filler_cost(self, bins: Iterable[Sequence[int]]) -> float:
        """The estimated share of step time the filler of these bins takes (`FillerShares.cost`)."""
        return self.filler_shares(bins).cost

    def filler_shares(self, bins: Iterable[Sequence[int]]) -> FillerShares:
        """The share of the computed tokens, and of each mixer's metadata rows (a chunked mixer's chunks), that the
        filler of these bins takes. A size share is the larger one where fillers are many one-token documents
        (each one a whole chunk of a chunked kernel)."""
        real_t, fill_t, real_s, fill_s = 0, 0, {}, {}
        for b in bins:
            real_t += sum(b)
            fill = self.filler(b)
            fill_t += sum(fill)
            for k, n in registry.sizes(b).items():
                real_s[k] = real_s.get(k, 0) + n
            for k, n in registry.sizes(fill).items():
                fill_s[k] = fill_s.get(k, 0) + n
        sizes = {k: fill_s[k] / (real_s[k] + fill_s[k]) if real_s[k] + fill_s[k] else 0.0 for k in fill_s}
        return FillerShares(fill_t / (real_t + fill_t), sizes)

    def filler(self, doc_lens: Sequence[int]) -> list[int]:
        """Lengths of the filler documents that bring a bin of `doc_lens` to exactly this layout: one takes
        the rest of the tokens, the others (when the bin has fewer than N - 1 documents) one token each."""
        k = self.docs - len(doc_lens)
        F = self.tokens - sum(doc_lens)
        if k < 1 or F < k:
            raise ValueError(
                f"a bin of {len(doc_lens)} documents and {sum(doc_lens)} tokens does not fit the static layout "
                f"{self}; fit the layout over every bin it will collate"
            )
        return [F - (k - 1)] + [1] * (k - 1)


def varlen_metadata(doc_lens: Sequence[int]) -> dict:
    """Packing metadata for documents of the given lengths laid end to end (see module docstring)."""
    if not doc_lens or any(n <= 0 for n in doc_lens):
        raise ValueError(f"document lengths must be positive and non-empty, got {list(doc_lens)}")
    cu = torch.zeros(len(doc_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(doc_lens, dtype=torch.int64), 0).to(torch.int32)
    max_len = int(max(doc_lens))
    return {
        CU_SEQ_LENS_Q: cu,
        CU_SEQ_LENS_K: cu.clone(),
        MAX_LENGTH_Q: max_len,
        MAX_LENGTH_K: max_len,
        **registry.metadata(doc_lens),
    }


class PackedCollator:
    """Collates one bin (a list of `Example`s) into a packed batch of batch size 1.

    Packed batches are always `[1, T]`: varlen kernels take one long row and the document
    boundaries, so a micro-batch is one bin; more bins per step come from gradient accumulation.
    """

    def __init__(self, layout: StaticLayout | None = None, pad_token_id: int = 0, vision=None):
        self.layout = layout
        self.pad_token_id = pad_token_id
        self.vision = vision  # a vision-language model's (data/vision.py): packs with images need it

    def __call__(self, docs: Sequence[Example]) -> dict:
        if not docs:
            raise ValueError("PackedCollator got an empty bin")
        ids: list[int] = []
        labels: list[int] = []
        pos: list[int] = []
        for doc in docs:
            n = len(doc)
            if n == 0:
                raise ValueError("PackedCollator got a zero-length document; drop it before packing")
            ids.extend(doc.input_ids)
            # First token of each document has no in-document predecessor: never a target.
            labels.append(IGNORE_INDEX)
            labels.extend(t if m else IGNORE_INDEX for t, m in zip(doc.input_ids[1:], doc.loss_mask[1:]))
            pos.extend(range(n))
        lens = [len(d) for d in docs]
        num_tokens = len(ids)
        if self.layout is not None:
            for n in self.layout.filler(lens):
                ids.extend([self.pad_token_id] * n)
                labels.extend([IGNORE_INDEX] * n)
                pos.extend(range(n))
                lens.append(n)
        batch = {
            INPUT_IDS: torch.tensor([ids], dtype=torch.long),
            LABELS: torch.tensor([labels], dtype=torch.long),
            POSITION_IDS: torch.tensor([pos], dtype=torch.long),
        }
        batch.update(varlen_metadata(lens))
        if self.layout is not None:
            # A python int that changes per batch would re-specialise a static graph; T bounds every document.
            batch[MAX_LENGTH_Q] = batch[MAX_LENGTH_K] = self.layout.tokens
        batch[NUM_LOSS_TOKENS] = sum(1 for x in labels if x != IGNORE_INDEX)
        batch[NUM_TOKENS] = num_tokens
        if any(doc.images for doc in docs):
            batch.update(self._images(docs, lens))
        return batch

    def _images(self, docs: Sequence[Example], lens: Sequence[int]) -> dict:
        """The pack's images for the vision tower (document order), and every document's own M-RoPE positions
        [3, T] laid end to end (a filler's, and a text document's, are its text positions on all three rows)."""
        if self.vision is None:
            raise ValueError("a pack with images needs PackedCollator(vision=...), the model's data.vision.Vision")
        refs = [im for doc in docs for im in doc.images]
        pixels, grid = self.vision.pixels(refs)
        images = [doc.images for doc in docs] + [()] * (len(lens) - len(docs))
        rows = [rope_positions(n, ims, self.vision.merge) for n, ims in zip(lens, images)]
        return {PIXEL_VALUES: pixels, IMAGE_GRID_THW: grid, MROPE_POSITION_IDS: torch.cat(rows, 1)}
