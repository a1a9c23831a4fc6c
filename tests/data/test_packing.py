"""Packing and collator invariants: nothing lost or duplicated, boundaries and positions right."""

from __future__ import annotations

import random

import pytest
import torch

from hybridtune.data import IGNORE_INDEX, Example, PackedCollator, pack, varlen_metadata
from hybridtune.data.packing import fit_to_length
from hybridtune.mixers.gdn.core import chunk_indices as _chunk_indices


def random_examples(rng: random.Random, n: int, max_len: int) -> list[Example]:
    out = []
    for _ in range(n):
        length = rng.randint(1, max_len)
        out.append(Example([rng.randrange(1000) for _ in range(length)], [rng.randint(0, 1) for _ in range(length)]))
    return out


@pytest.mark.parametrize("seq_len", [7, 63, 64, 75, 257])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pack_is_a_partition_within_capacity(seq_len, seed):
    rng = random.Random(seed)
    exs = random_examples(rng, 200, seq_len)
    bins = pack(exs, seq_len)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(exs)))  # every example exactly once
    assert all(sum(len(exs[i]) for i in b) <= seq_len for b in bins)
    # First-fit decreasing is within 11/9 OPT + 1 bins; the volume bound is a weaker, sure floor.
    assert len(bins) <= 11 / 9 * (sum(len(e) for e in exs) / seq_len + 1) + 1
    assert bins == pack(exs, seq_len)  # deterministic


def test_pack_rejects_overlong_and_empty():
    with pytest.raises(ValueError, match="more than seq_len"):
        pack([[1, 2, 3]], 2)
    with pytest.raises(ValueError, match="empty"):
        pack([[1], []], 4)
    with pytest.raises(ValueError, match="at least 2"):
        pack([[1]], 1)


def test_fit_to_length_truncates_or_drops_and_counts():
    exs = [Example([1] * 10, [0] + [1] * 9), Example([2] * 3, [0, 1, 1]), Example([3] * 4, [1, 0, 0, 0])]
    kept, st = fit_to_length(exs, 5, "truncate")
    assert [len(e) for e in kept] == [5, 3] and st.truncated == 1 and st.dropped == 1  # last: no trainable target
    kept, st = fit_to_length(exs, 5, "drop")
    assert [len(e) for e in kept] == [3] and st.dropped == 2 and st.truncated == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_collator_tokens_labels_positions_metadata(seed):
    rng = random.Random(seed)
    docs = random_examples(rng, 5, 90)
    b = PackedCollator()(docs)
    lens = [len(d) for d in docs]
    T = sum(lens)
    assert b["input_ids"].shape == (1, T) and b["labels"].shape == (1, T) and b["position_ids"].shape == (1, T)
    assert b["input_ids"][0].tolist() == [t for d in docs for t in d.input_ids]
    cu = b["cu_seq_lens_q"]
    assert cu.dtype == torch.int32 and cu.tolist() == [0] + list(torch.tensor(lens).cumsum(0).tolist())
    assert torch.equal(b["cu_seq_lens_k"], cu)
    assert b["max_length_q"] == b["max_length_k"] == max(lens) and isinstance(b["max_length_q"], int)
    pos = b["position_ids"][0].tolist()
    labels = b["labels"][0].tolist()
    for d, start in zip(docs, cu[:-1].tolist()):
        assert pos[start : start + len(d)] == list(range(len(d)))
        assert labels[start] == IGNORE_INDEX  # first token of a document is never a target
        for j in range(1, len(d)):
            assert labels[start + j] == (d.input_ids[j] if d.loss_mask[j] else IGNORE_INDEX)
    assert b["num_loss_tokens"] == sum(x != IGNORE_INDEX for x in labels)
    ci = b["gdn_chunk_indices"]
    assert ci.dtype == torch.int32 and ci.shape == (sum(-(-n // 64) for n in lens), 2)


def test_chunk_indices_layout():
    assert _chunk_indices([63, 64, 65, 1], 64).tolist() == [[0, 0], [1, 0], [2, 0], [2, 1], [3, 0]]


def test_metadata_rejects_empty_documents():
    with pytest.raises(ValueError, match="positive"):
        varlen_metadata([3, 0, 2])
    with pytest.raises(ValueError, match="zero-length"):
        PackedCollator()([Example([1, 2], [1, 1]), Example([], [])])


def _first_fit_decreasing_by_scan(lengths: list[int], seq_len: int) -> list[list[int]]:
    """The reference: every example scans the bins in order for the first with room."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins, free = [], []
    for i in order:
        for b, room in enumerate(free):
            if room >= lengths[i]:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(seq_len - lengths[i])
    return bins


@pytest.mark.parametrize("seed", range(6))
def test_pack_is_first_fit_decreasing(seed):
    rng = random.Random(seed)
    seq_len = rng.choice([2, 7, 64, 256, 1000])
    n = rng.choice([1, 2, 3, 50, 700])
    lengths = [
        rng.randint(1, seq_len) if rng.random() < 0.7 else rng.randint(1, max(1, seq_len // 8)) for _ in range(n)
    ]
    assert pack([[0] * k for k in lengths], seq_len) == _first_fit_decreasing_by_scan(lengths, seq_len)
