"""`PackedCollator`: turns a bin of packed examples into the batch every layer reads, its layout computed once.

    input_ids, labels, position_ids  int64 [1, T]  labels: -100 at masked tokens and every document's first
                                                   token (unshifted); positions restart at 0 per document
    cu_seq_lens_q, cu_seq_lens_k     int32 [N + 1] cumulative document lengths (the two are equal)
    max_length_q, max_length_k       int           longest document (a python int: no device sync)
    gdn_chunk_indices                int32 [C, 2]  (document, chunk within document) of every 64-token chunk
    num_loss_tokens, num_tokens      int           label positions in the loss; the bin's tokens (T without filler)

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
    GDN_CHUNK_INDICES,
    INPUT_IDS,
    LABELS,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    NUM_LOSS_TOKENS,
    NUM_TOKENS,
    POSITION_IDS,
)
from hybridtune.data.packing import Example

IGNORE_INDEX = -100
GDN_CHUNK_SIZE = 64
# The GDN delta-rule kernels' share of a training step's GPU time for the 2B shape at 4096-token packs, from its
# profile (docs/INTERNALS.md). They work per 64-token chunk, everything else per token, so a filler
# document's cost is weighted by it (`StaticLayout.filler_cost`).
GDN_TIME_SHARE = 0.12


def _chunks(n: int, chunk_size: int) -> int:
    return -(-n // chunk_size)


class FillerShares(NamedTuple):
    """The filler's share of the computed tokens and of the GDN chunks (`StaticLayout.filler_shares`)."""

    tokens: float
    chunks: float

    @property
    def cost(self) -> float:
        """The estimated share of step time: the token share for the per-token work (projections, MLP, attention,
        loss) and the chunk share for the GDN kernels (GDN_TIME_SHARE of the time)."""
        return (1 - GDN_TIME_SHARE) * self.tokens + GDN_TIME_SHARE * self.chunks


@dataclass(frozen=True)
class StaticLayout:
    """The fixed sizes of every batch of a static layout: `tokens` (T) and `docs` (N).

    The number of 64-token chunks (C, the rows of `gdn_chunk_indices`) is left to each batch: only the
    opaque GDN ops read it, so the compiled loop marks it dynamic at no tracing cost and the filler needs no
    chunk arithmetic (fixing C as well cost 64 filler tokens for every chunk of difference between packs)."""

    tokens: int
    docs: int
    chunk_size: int = GDN_CHUNK_SIZE

    @classmethod
    def fit(
        cls, bins: Iterable[Sequence[int]], chunk_size: int = GDN_CHUNK_SIZE, max_filler: float = 0.5
    ) -> StaticLayout | None:
        """The smallest T for which every bin (its document lengths) fills up exactly, or None when the filler
        would cost more than `max_filler` of the step (`filler_cost`: tokens and GDN chunks, weighted).

        A bin of n documents and t tokens takes k = N - n >= 1 filler documents of at least one token each, so
        T >= t - n + N for every bin: the smallest T is max(t - n) + N with the smallest N, max n + 1.
        """
        bins = [list(b) for b in bins]
        if not bins or any(not b or min(b) <= 0 for b in bins):
            raise ValueError("StaticLayout.fit needs bins of positive document lengths")
        N = max(map(len, bins)) + 1
        T = max(sum(b) - len(b) for b in bins) + N
        layout = cls(tokens=T, docs=N, chunk_size=chunk_size)
        return layout if layout.filler_cost(bins) <= max_filler else None

    def filler_cost(self, bins: Iterable[Sequence[int]]) -> float:
        """The estimated share of step time the filler of these bins takes (`FillerShares.cost`)."""
        return self.filler_shares(bins).cost

    def filler_shares(self, bins: Iterable[Sequence[int]]) -> FillerShares:
        """The share of the computed tokens, and of the 64-token GDN chunks, that the filler of these bins takes.
        The chunk share is the larger one where fillers are many one-token documents (each one a whole chunk of
        the delta-rule kernels)."""
        s, real_t, real_c, fill_t, fill_c = self.chunk_size, 0, 0, 0, 0
        for b in bins:
            real_t += sum(b)
            real_c += sum(_chunks(n, s) for n in b)
            fill = self.filler(b)
            fill_t += sum(fill)
            fill_c += sum(_chunks(n, s) for n in fill)
        return FillerShares(fill_t / (real_t + fill_t), fill_c / (real_c + fill_c))

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


def chunk_indices(doc_lens: Sequence[int], chunk_size: int = GDN_CHUNK_SIZE) -> torch.Tensor:
    """int32 [C, 2]: for each chunk of each document, (document index, chunk index within it)."""
    rows = [(d, c) for d, n in enumerate(doc_lens) for c in range(_chunks(n, chunk_size))]
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 2)


def varlen_metadata(doc_lens: Sequence[int], chunk_size: int = GDN_CHUNK_SIZE) -> dict:
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
        GDN_CHUNK_INDICES: chunk_indices(doc_lens, chunk_size),
    }


class PackedCollator:
    """Collates one bin (a list of `Example`s) into a packed batch of batch size 1.

    Packed batches are always `[1, T]`: varlen kernels take one long row and the document
    boundaries, so a micro-batch is one bin; more bins per step come from gradient accumulation.
    """

    def __init__(self, chunk_size: int = GDN_CHUNK_SIZE, layout: StaticLayout | None = None, pad_token_id: int = 0):
        if layout is not None and layout.chunk_size != chunk_size:
            raise ValueError(f"static layout chunk size {layout.chunk_size} != collator chunk size {chunk_size}")
        self.chunk_size = chunk_size
        self.layout = layout
        self.pad_token_id = pad_token_id

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
        batch.update(varlen_metadata(lens, self.chunk_size))
        if self.layout is not None:
            # A python int that changes per batch would re-specialise a static graph; T bounds every document.
            batch[MAX_LENGTH_Q] = batch[MAX_LENGTH_K] = self.layout.tokens
        batch[NUM_LOSS_TOKENS] = sum(1 for x in labels if x != IGNORE_INDEX)
        batch[NUM_TOKENS] = num_tokens
        return batch
