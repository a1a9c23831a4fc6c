"""Static pack layout: every batch filled to the same T and N with non-empty filler documents, for any set
of bins (random bins of odd sizes); fillers are never trained on and never counted as tokens."""

from __future__ import annotations

import random

import pytest

from hybridtune.data.collator import IGNORE_INDEX, PackedCollator, StaticLayout
from hybridtune.data.packing import Example
from hybridtune.mixers.gdn.core import chunk_indices as _chunk_indices
from hybridtune.mixers.gdn.spec import CHUNK_SIZE, TIME_SHARE


def chunk_indices(doc_lens):
    return _chunk_indices(doc_lens, CHUNK_SIZE)


def _random_bins(rng: random.Random, seq_len: int, n_bins: int) -> list[list[int]]:
    bins = []
    for _ in range(n_bins):
        b, used = [], 0
        while True:
            n = max(1, int(rng.lognormvariate(3.5, 1.3)))
            if used + n > seq_len:
                break
            b.append(n)
            used += n
        bins.append(b or [seq_len])
    return bins


@pytest.mark.parametrize("seed", range(40))
def test_every_bin_fills_to_exactly_the_layout(seed):
    rng = random.Random(seed)
    seq_len = rng.choice([63, 64, 65, 200, 1000, 4096])
    bins = _random_bins(rng, seq_len, rng.randint(1, 25))
    layout = StaticLayout.fit(bins, max_filler=1.0)
    assert layout.tokens >= max(map(sum, bins)) + 1 and layout.docs >= max(map(len, bins)) + 1
    for b in bins:
        full = b + layout.filler(b)
        assert min(full) > 0  # no zero-length document ever reaches a kernel
        assert sum(full) == layout.tokens and len(full) == layout.docs
        # the filler adds at most one partial chunk past the whole chunks its tokens need, plus one per
        # extra one-token document
        k = layout.docs - len(b)
        extra = len(chunk_indices(full)) - len(chunk_indices(b))
        assert extra <= -(-(layout.tokens - sum(b) - (k - 1)) // 64) + (k - 1)


def test_collated_batch_has_the_layout_and_masks_the_filler():
    docs = [Example(list(range(1, 71)), [0] * 10 + [1] * 60), Example([5, 6, 7], [0, 1, 1])]
    other = [Example(list(range(1, 130)), [1] * 129)]
    layout = StaticLayout.fit([[70, 3], [129]], max_filler=1.0)
    collate = PackedCollator(layout=layout, pad_token_id=9)
    plain = PackedCollator()(docs)
    for bin_ in (docs, other):
        b = collate(bin_)
        T = layout.tokens
        assert b["input_ids"].shape == b["labels"].shape == b["position_ids"].shape == (1, T)
        assert b["cu_seq_lens_q"].shape == (layout.docs + 1,)
        assert b["gdn_chunk_indices"].tolist() == chunk_indices(b["cu_seq_lens_q"].diff().tolist()).tolist()
        assert b["max_length_q"] == b["max_length_k"] == T
        n = sum(len(d) for d in bin_)
        assert b["num_tokens"] == n
        assert (b["labels"][0, n:] == IGNORE_INDEX).all() and (b["input_ids"][0, n:] == 9).all()
        cu = b["cu_seq_lens_q"].tolist()
        for a, z in zip(cu[:-1], cu[1:]):  # positions restart in every document, fillers included
            assert b["position_ids"][0, a:z].tolist() == list(range(z - a))
    b = collate(docs)
    n = plain["input_ids"].shape[1]
    for k in ("input_ids", "labels", "position_ids"):  # the documents themselves are collated as without filler
        assert b[k][0, :n].tolist() == plain[k][0].tolist()
    assert b["num_loss_tokens"] == plain["num_loss_tokens"] == 60 + 2  # fillers add no target
    assert b["cu_seq_lens_q"][: len(docs) + 1].tolist() == plain["cu_seq_lens_q"].tolist()


def test_a_bin_outside_the_fitted_layout_is_refused():
    layout = StaticLayout.fit([[10, 20]], max_filler=1.0)
    with pytest.raises(ValueError, match="does not fit the static layout"):
        layout.filler([10] * 40)
    with pytest.raises(ValueError, match="positive document lengths"):
        StaticLayout.fit([[3, 0]])


def test_fit_says_none_past_the_filler_limit():
    # A full pack beside a pack a quarter full: T is the full one's length + 1 filler token + 1, so the
    # quarter-full pack is mostly filler (3/8 of all computed tokens).
    bins = [[4096], [1024]]
    wide = StaticLayout.fit(bins, max_filler=1.0)
    assert (wide.tokens, wide.docs) == (4097, 2)
    assert StaticLayout.fit(bins, max_filler=0.1) is None
    assert StaticLayout.fit(bins, max_filler=0.4) == wide


def _fits(bins, T, N):
    """Brute force: every bin takes N - n >= 1 non-empty filler documents of T - t tokens in all."""
    return all(N - len(b) >= 1 and T - sum(b) >= N - len(b) for b in bins)


@pytest.mark.parametrize("seed", range(6))
def test_fit_finds_the_smallest_tokens(seed):
    rng = random.Random(100 + seed)
    bins = _random_bins(rng, rng.choice([64, 150]), rng.randint(1, 6))
    got = StaticLayout.fit(bins, max_filler=1.0)
    assert _fits(bins, got.tokens, got.docs)
    smaller = [(T, N) for N in range(1, 64) for T in range(1, got.tokens) if _fits(bins, T, N)]
    assert not smaller, (bins, got, smaller[:3])
    fewer = [N for N in range(1, got.docs) if _fits(bins, got.tokens, N)]  # and the fewest documents at that T
    assert not fewer, (bins, got, fewer)


def test_filler_shares_count_chunks_as_well_as_tokens():
    # Nine full packs beside one pack of 20 short documents: N = 21, T = 4095 + 21. Every full pack takes 20
    # one-token filler documents: 20 tokens, but 20 whole GDN chunks on its 64. The short pack takes one
    # filler document of the rest (2836 tokens, 45 chunks).
    bins = [[4096]] * 9 + [[64] * 20]
    layout = StaticLayout.fit(bins, max_filler=1.0)
    assert (layout.tokens, layout.docs) == (4116, 21)
    assert layout.filler([4096]) == [1] * 20 and layout.filler([64] * 20) == [2836]
    tok, sizes = layout.filler_shares(bins)
    chunks = sizes["gdn"]
    assert tok == pytest.approx((9 * 20 + 2836) / (10 * 4116))
    assert chunks == pytest.approx((9 * 20 + 45) / (9 * (64 + 20) + 20 + 45))
    assert tok < 0.1 < chunks
    cost = layout.filler_cost(bins)
    assert cost == pytest.approx((1 - TIME_SHARE) * tok + TIME_SHARE * chunks) and tok < cost < chunks
    assert StaticLayout.fit(bins, max_filler=cost) == layout
    assert StaticLayout.fit(bins, max_filler=tok) is None  # the chunks' share of the cost counts
