"""Benchmark preference pairs: realistic lengths, packed by hybridtune's own pair packing, the same for every mode.

Each pair is a prompt of 200-1,000 tokens and two replies (chosen, rejected) of 100-800 tokens each, lengths uniform
and seeded, token ids uniform over the vocabulary (never zeros), the prompt untrained and the replies trained. A pair
is two documents, prompt + chosen and prompt + rejected (data/pairs.py), so it takes up to 3,600 tokens of a pack;
under a shorter sequence_len (the CPU's) every range is scaled down by the same factor so a pair still fits. Pairs
are drawn until they fill one pack more than the bench's `layouts`, packed whole (`pack_pairs`, first-fit
decreasing), and the `layouts` fullest packs kept in their order: every step's pairs are one pack's, the same pairs
in the same order for hybridtune (`PairCollator`) and for TRL (its own collator, padded: bench/trl_dpo.py).

Tokens of a pair are counted as the model processes them, prompt + chosen and prompt + rejected (the prompt twice),
for both tools; `reference_flops` is the reference model's forward over them (LoRA off, no gradient).
"""

from __future__ import annotations

import random

from hybridtune.config import ObjectiveTraits
from hybridtune.data.collator import StaticLayout
from hybridtune.data.pairs import CHOSEN, Pair, PairCollator, PairDoc, pack_pairs
from hybridtune.mixers import MIXERS
from hybridtune.models.flops import step_flops

PROMPT = (200, 1000)
REPLY = (100, 800)
LONGEST = 2 * PROMPT[1] + 2 * REPLY[1]  # a pair's two documents at their longest


def scale(seq_len: int) -> float:
    """The factor on every length range: 1 when the longest pair fits `seq_len`."""
    return min(1.0, seq_len / LONGEST)


def _ranges(seq_len: int) -> tuple[tuple[int, int], tuple[int, int]]:
    s = scale(seq_len)
    return tuple(max(2, round(n * s)) for n in PROMPT), tuple(max(2, round(n * s)) for n in REPLY)


def make_pairs(seq_len: int, layouts: int, vocab_size: int, seed: int = 0) -> list[list[PairDoc]]:
    """`layouts` packs of whole pairs (each pair as its chosen then its rejected `PairDoc`, numbered in order)."""
    lengths, tokens = random.Random(seed), random.Random(seed + 1)  # (lengths whatever the vocabulary)
    (p0, p1), (r0, r1) = _ranges(seq_len)

    def draw(n: int) -> list[int]:
        return [tokens.randrange(1, vocab_size) for _ in range(n)]

    pairs: list[Pair] = []
    while sum(len(p) for p in pairs) < (layouts + 1) * seq_len:
        prompt = draw(lengths.randint(p0, p1))
        chosen, rejected = draw(lengths.randint(r0, r1)), draw(lengths.randint(r0, r1))
        mask = [0] * len(prompt)
        pairs.append(
            Pair(
                input_ids=prompt + chosen + prompt + rejected,
                loss_mask=mask + [1] * len(chosen) + mask + [1] * len(rejected),
                split=len(prompt) + len(chosen),
            )
        )
    bins = pack_pairs(pairs, seq_len)
    fullest = sorted(sorted(range(len(bins)), key=lambda i: -sum(len(d) for d in bins[i]))[:layouts])
    kept = [bins[i] for i in fullest]
    number = {}  # pairs renumbered in order of appearance
    return [
        [
            PairDoc(
                input_ids=d.input_ids, loss_mask=d.loss_mask, pair=number.setdefault(d.pair, len(number)), side=d.side
            )
            for d in b
        ]
        for b in kept
    ]


def packs_for(traits: ObjectiveTraits):
    """What makes the bench's packs for an objective of these traits that has no bench data of its own: the pairs
    here for an objective of pairs (`make_pairs`, as `ObjectiveSpec.bench_packs` is called); None: the bench's
    random documents."""
    if traits.unit != "pairs":
        return None
    return lambda seq_len, layouts, vocab_size, seed: make_pairs(seq_len, len(layouts), vocab_size, seed)


def doc_lens(packs: list[list[PairDoc]]) -> list[list[int]]:
    return [[len(d) for d in p] for p in packs]


def pair_batches(packs: list[list[PairDoc]], static: StaticLayout | None = None, collator=PairCollator) -> list[dict]:
    """Collated packs (`collator`, the objective's: `PairCollator` for pairs; filled to `static` when given), each
    with its `doc_lens`."""
    collate = collator(layout=static)
    out = []
    for p in packs:
        batch = collate(p)
        batch["doc_lens"] = [len(d) for d in p]
        out.append(batch)
    return out


def trl_examples(pack: list[PairDoc]) -> list[dict]:
    """A pack's pairs as TRL's tokenised rows (`prompt_ids`, `chosen_ids`, `rejected_ids`), in the pack's order."""
    rows: dict[int, dict] = {}
    for d in pack:
        prompt = d.loss_mask.index(1)
        row = rows.setdefault(d.pair, {"prompt_ids": d.input_ids[:prompt]})
        row["chosen_ids" if d.side == CHOSEN else "rejected_ids"] = d.input_ids[prompt:]
    return list(rows.values())


def describe(packs: list[list[PairDoc]], seq_len: int) -> dict:
    """What bench.json says of the pair data."""
    pairs = [len(p) // 2 for p in packs]
    tokens = [sum(len(d) for d in p) for p in packs]
    prompt, reply = _ranges(seq_len)
    return {
        "pairs_per_pack": pairs,
        "tokens_per_pack": tokens,
        "fill": sum(tokens) / (len(packs) * seq_len),
        "distribution": f"preference pairs: prompt {prompt[0]}-{prompt[1]} tokens, replies {reply[0]}-{reply[1]} "
        "(uniform, seeded), packed whole by hybridtune's pair packing; tokens counted as prompt + chosen and "
        "prompt + rejected",
    }


def reference_flops(config, lens: list[int]) -> float:
    """The reference's forward over the documents `lens` (no gradient, no recompute): a third of each mixer core's
    forward-and-backward count, half of every frozen weight's (step_flops counts them 3x and 4x the forward)."""
    f = step_flops(config, lens, adapter="lora")
    cores = {spec.core_names[0] or f"{spec.kind}_core" for spec in MIXERS.values() if spec.flops is not None}
    skip = {"recompute", "lora", "linear_trained"}
    return sum(v / 3 if k in cores else v / 2 for k, v in f.breakdown.items() if k not in skip)
