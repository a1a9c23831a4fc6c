"""Packing preference pairs: whole pairs per pack, each reply its own document (its own boundaries, positions and
first-token label), the batch's pair index and side, a static layout's filler, and fitting a pair to sequence_len."""

from __future__ import annotations

import pytest
import torch

from hybridtune.batch import CU_SEQ_LENS_Q, LABELS, NUM_PAIRS, PAIR_INDEX, PAIR_SIDE, POSITION_IDS
from hybridtune.data import IGNORE_INDEX, Example
from hybridtune.data.collator import StaticLayout
from hybridtune.data.pairs import CHOSEN, REJECTED, Pair, PairCollator, PairDoc, fit_pairs, pack_pairs, pair_docs


def pair(prompt: int, chosen: int, rejected: int, first: int = 1) -> Pair:
    p = list(range(first, first + prompt))
    c = p + [100 + k for k in range(chosen)]
    r = p + [200 + k for k in range(rejected)]
    mask = [0] * prompt
    return Pair(input_ids=c + r, loss_mask=mask + [1] * chosen + mask + [1] * rejected, split=len(c))


def test_packs_hold_whole_pairs_chosen_then_rejected():
    pairs = [pair(5, 3, 4, first=10 * i) for i in range(3)] + [pair(15, 6, 2), pair(2, 2, 2)]
    bins = pack_pairs(pairs, 40)
    seen = []
    for b in bins:
        assert sum(len(d) for d in b) <= 40 and len(b) % 2 == 0
        for c, r in zip(b[0::2], b[1::2]):
            assert (c.pair, c.side, r.pair, r.side) == (c.pair, CHOSEN, c.pair, REJECTED)
            want_c, want_r = pairs[c.pair].docs()
            assert (c.input_ids, c.loss_mask, r.input_ids, r.loss_mask) == (
                want_c.input_ids, want_c.loss_mask, want_r.input_ids, want_r.loss_mask
            )  # fmt: skip
            seen.append(c.pair)
    assert sorted(seen) == list(range(5)) and len(bins) < 5  # every pair once, several to a pack
    assert [len(b) for b in pack_pairs(pairs, 40, packing=False)] == [2] * 5  # unpacked: one pair a pack


def test_the_collator_gives_each_reply_its_own_document_and_its_pair():
    pairs = [pair(3, 2, 3), pair(4, 1, 2, first=50)]
    docs = [d for i in (1, 0) for d in pair_docs(pairs[i], number=7 + i)]  # numbers are the run's, any order
    batch = PairCollator()(docs)
    lens = [len(d) for d in docs]
    assert batch[CU_SEQ_LENS_Q].tolist() == [0, *torch.tensor(lens).cumsum(0).tolist()]
    assert batch[PAIR_INDEX].tolist() == [0, 0, 1, 1] and batch[PAIR_SIDE].tolist() == [0, 1, 0, 1]
    assert batch[NUM_PAIRS] == 2
    labels, pos, cu = batch[LABELS][0], batch[POSITION_IDS][0], batch[CU_SEQ_LENS_Q].tolist()
    for d, doc in enumerate(docs):
        a, b = cu[d], cu[d + 1]
        assert pos[a:b].tolist() == list(range(b - a))  # positions restart: the rejected reply never sees the chosen
        assert labels[a] == IGNORE_INDEX  # a document's first token is never a target
        trained = [t for t, m in zip(doc.input_ids[1:], doc.loss_mask[1:]) if m]
        assert [int(x) for x in labels[a + 1 : b] if x != IGNORE_INDEX] == trained


def test_a_static_layout_fills_after_the_pairs():
    bins = pack_pairs([pair(3, 2, 3), pair(4, 1, 2), pair(6, 3, 3)], 24)
    layout = StaticLayout.fit([[len(d) for d in b] for b in bins])
    for b in bins:
        batch = PairCollator(layout=layout)(b)
        n = len(b)
        assert batch[CU_SEQ_LENS_Q].numel() - 1 == layout.docs > n
        assert batch[PAIR_INDEX].tolist()[n:] == [-1] * (layout.docs - n)
        assert batch[PAIR_SIDE].tolist()[n:] == [-1] * (layout.docs - n)


def test_a_pack_must_hold_both_replies_of_each_pair():
    c, r = pair_docs(pair(3, 2, 2), number=0)
    with pytest.raises(ValueError, match="each pair's chosen and rejected document once"):
        PairCollator()([c])
    with pytest.raises(ValueError, match="each pair's chosen and rejected document once"):
        PairCollator()([c, r, PairDoc(input_ids=[1, 2], loss_mask=[0, 1], pair=0, side=REJECTED)])
    held_out = PairCollator()([Example([1, 2, 3], [0, 1, 1])])  # plain documents: the held-out chosen replies
    assert PAIR_INDEX not in held_out and held_out[LABELS].tolist() == [[IGNORE_INDEX, 2, 3]]


def test_fitting_a_pair_to_sequence_len():
    short_long = pair(4, 2, 30)  # chosen 6 tokens, rejected 34
    (kept,), stats, records = fit_pairs([short_long], lambda i: f"f:{i + 1}", 24, "truncate")
    c, r = kept.docs()
    assert (len(c), len(r)) == (6, 18) and c.input_ids == short_long.docs()[0].input_ids  # the short one whole
    assert stats.truncated == 1 and records[0]["reason"] == "truncated" and records[0]["where"] == "f:1"
    kept, stats, records = fit_pairs([short_long], lambda i: f"f:{i + 1}", 24, "drop")
    assert kept == [] and records[0]["reason"] == "longer_than_sequence_len" and records[0]["tokens_over"] == 16
    prompt_only = pair(30, 2, 2)  # truncation would leave no reply token
    kept, _, records = fit_pairs([prompt_only], lambda i: "g:1", 24, "truncate")
    assert kept == [] and records[0]["reason"] == "no_trained_token_after_truncation"
