"""`PackedCollator`: turns a bin of packed examples into the batch every layer reads.

This is the single place that turns document boundaries into metadata. Everything a kernel needs
about the pack layout is computed here, once per batch, on the host, so nothing inside the compiled
model calls `nonzero`, `.item()` or `.tolist()`.

Batch keys (transformers' own names where they exist):
    input_ids      int64 [1, T]
    labels         int64 [1, T]   -100 at masked tokens and at the first token of every document
                                  (labels are unshifted, as transformers expects; the loss shifts)
    position_ids   int64 [1, T]   restart at 0 for every document
    cu_seq_lens_q  int32 [N + 1]  cumulative document lengths (== cu_seq_lens_k)
    cu_seq_lens_k  int32 [N + 1]
    max_length_q   int            longest document (python int, so no device sync)
    max_length_k   int
    gdn_chunk_indices int32 [C, 2]  (document, chunk-within-document) for every 64-token chunk,
                                  the layout chunked linear-attention kernels iterate over
    num_loss_tokens int           number of label positions that count in the loss
    num_tokens     int            tokens of the bin's own documents (T without filler)

Dynamic layout (the default): T is the sum of the bin's document lengths, no padding. Static layout
(`PackedCollator(layout=StaticLayout.fit(...))`): every batch has the same T, N and C, so a compiled
graph has no symbolic sizes (about half the tracing time) and is fit for CUDA graphs. The bin is
followed by filler documents (pad tokens, labels -100, positions restarting at 0) whose lengths are
chosen so that the totals come out exactly; fillers are ordinary non-empty documents, so every
kernel treats them as it treats any document, and nothing before them can see them (they come last,
and documents never see each other). Zero-length documents never appear in either layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from hybridtune.data.packing import Example

IGNORE_INDEX = -100
GDN_CHUNK_SIZE = 64


def _chunks(n: int, chunk_size: int) -> int:
    return -(-n // chunk_size)


@dataclass(frozen=True)
class StaticLayout:
    """The fixed sizes of every batch of a static layout: `tokens` (T), `docs` (N), `chunks` (C)."""

    tokens: int
    docs: int
    chunks: int
    chunk_size: int = GDN_CHUNK_SIZE

    @classmethod
    def fit(
        cls, bins: Iterable[Sequence[int]], chunk_size: int = GDN_CHUNK_SIZE, max_filler: float = 0.5
    ) -> StaticLayout | None:
        """The smallest T (then N) for which every bin (its document lengths) can be filled up exactly, or None
        when every such layout would make more than `max_filler` of the computed tokens filler.

        A bin of n documents, t tokens and c chunks takes k = N - n >= 1 filler documents holding
        F = T - t >= k tokens in C - c chunks. k documents of l_i >= 1 tokens make sum(ceil(l_i / s)) chunks
        for any total in [max(k, ceil(F / s)), k + (F - k) // s] (s = chunk size), so a common C exists when
        those ranges of all bins overlap. Each N from max n + 1 is scanned from its smallest T up; the bins
        are first reduced to what decides the bounds (the largest c per t, the smallest c - n per t - n).
        """
        bins = [list(b) for b in bins]
        if not bins or any(not b or min(b) <= 0 for b in bins):
            raise ValueError("StaticLayout.fit needs bins of positive document lengths")
        s = chunk_size
        t = torch.tensor([sum(b) for b in bins], dtype=torch.int64)
        n = torch.tensor([len(b) for b in bins], dtype=torch.int64)
        c = torch.tensor([sum(_chunks(x, s) for x in b) for b in bins], dtype=torch.int64)
        # lo(N, T) = max(N + max(c - n), max over bins of c + ceil((T - t) / s)): only the largest c per t matters.
        ut, inv = torch.unique(t, return_inverse=True)
        c_at_t = torch.full_like(ut, -1).scatter_reduce(0, inv, c, "amax")
        # hi(N, T) = N + min over bins of (c - n) + (T - N - (t - n)) // s: only the smallest c - n per t - n.
        ud, inv = torch.unique(t - n, return_inverse=True)
        a_at_d = torch.full_like(ud, 1 << 40).scatter_reduce(0, inv, c - n, "amin")
        max_a = int((c - n).max())
        real = float(t.sum())
        t_cap = int(real / (len(bins) * (1 - max_filler))) if max_filler < 1 else 1 << 40
        best: StaticLayout | None = None
        top_n = int(n.max())
        for N in range(top_n + 1, top_n + 17):
            T = int(ud.max()) + N  # F >= k in every bin
            stop = min(t_cap, T + 65 * s)  # past ~64 chunks of slack more filler no longer opens a fit
            while T <= stop and (best is None or T < best.tokens):
                lo = max(N + max_a, int((c_at_t + torch.div(T - ut + s - 1, s, rounding_mode="floor")).max()))
                hi = N + int((a_at_d + torch.div(T - N - ud, s, rounding_mode="floor")).min())
                if lo <= hi:
                    best = cls(tokens=T, docs=N, chunks=lo, chunk_size=s)
                    break
                T += 1
        return best

    def filler(self, doc_lens: Sequence[int]) -> list[int]:
        """Lengths of the filler documents that bring a bin of `doc_lens` to exactly this layout."""
        s = self.chunk_size
        k = self.docs - len(doc_lens)
        F = self.tokens - sum(doc_lens)
        Cf = self.chunks - sum(_chunks(n, s) for n in doc_lens)
        if k < 1 or not (max(k, _chunks(F, s)) <= Cf <= k + (F - k) // s):
            raise ValueError(
                f"a bin of {len(doc_lens)} documents and {sum(doc_lens)} tokens does not fit the static layout "
                f"{self}; fit the layout over every bin it will collate"
            )
        chunks = [Cf - (k - 1)] + [1] * (k - 1)  # every filler document's chunk count, summing to Cf
        lens = [s * (ci - 1) + 1 for ci in chunks]  # the shortest lengths with those chunk counts
        rest = F - sum(lens)
        for i in range(k):  # each can take s - 1 more tokens without a new chunk; F <= s * Cf makes it fit
            add = min(s - 1, rest)
            lens[i] += add
            rest -= add
        assert rest == 0 and all(n > 0 for n in lens), (doc_lens, self)
        return lens


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
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu.clone(),
        "max_length_q": max_len,
        "max_length_k": max_len,
        "gdn_chunk_indices": chunk_indices(doc_lens, chunk_size),
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
            "input_ids": torch.tensor([ids], dtype=torch.long),
            "labels": torch.tensor([labels], dtype=torch.long),
            "position_ids": torch.tensor([pos], dtype=torch.long),
        }
        batch.update(varlen_metadata(lens, self.chunk_size))
        if self.layout is not None:
            # A python int that changes per batch would re-specialise a static graph; T bounds every document.
            batch["max_length_q"] = batch["max_length_k"] = self.layout.tokens
        batch["num_loss_tokens"] = sum(1 for x in labels if x != IGNORE_INDEX)
        batch["num_tokens"] = num_tokens
        return batch
