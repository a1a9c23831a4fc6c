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

T is the sum of the bin's document lengths (no padding); zero-length documents never appear.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridtune.data.packing import Example

IGNORE_INDEX = -100
GDN_CHUNK_SIZE = 64


def chunk_indices(doc_lens: Sequence[int], chunk_size: int = GDN_CHUNK_SIZE) -> torch.Tensor:
    """int32 [C, 2]: for each chunk of each document, (document index, chunk index within it)."""
    rows = [(d, c) for d, n in enumerate(doc_lens) for c in range(-(-n // chunk_size))]
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

    def __init__(self, chunk_size: int = GDN_CHUNK_SIZE):
        self.chunk_size = chunk_size

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
        batch = {
            "input_ids": torch.tensor([ids], dtype=torch.long),
            "labels": torch.tensor([labels], dtype=torch.long),
            "position_ids": torch.tensor([pos], dtype=torch.long),
        }
        batch.update(varlen_metadata([len(d) for d in docs], self.chunk_size))
        batch["num_loss_tokens"] = sum(1 for x in labels if x != IGNORE_INDEX)
        return batch
