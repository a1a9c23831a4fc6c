"""Preference pairs: a row of TRL's preference formats -> two documents (prompt + chosen, prompt + rejected), fitted
to sequence_len and packed as one unit (a pair never straddles packs), collated with each document's pair and side.

Formats (TRL's): `prompt` / `chosen` / `rejected` as texts (concatenated, each reply ending with EOS) or as lists of
messages (the chat template renders them; only the reply's messages are trained, as for supervised chats); without
`prompt` the two replies carry the whole conversation and the prompt is their shared prefix (of messages; of
characters for texts, a space before the fork going with the replies). Each document is tokenised by
`formats.to_example`'s prompt_completion path; the tokenised cache keeps them as two consecutive rows
(data/examples.py) and `grouped` joins each two into a `Pair`. An empty reply tokenises with no trained token.

Rows dropped (each one a log line and a data_report.jsonl record naming file:line): identical replies, an empty
reply, a pair longer than sequence_len under `excess_length_strategy: drop` (`truncate` keeps the start of each
document, halving the room between them when both are long), a truncation that cut a reply's every token.
In a pack each document is its own document: the collator's boundaries keep a mixer's state and attention apart.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hybridtune.batch import CU_SEQ_LENS_Q, NUM_PAIRS, PAIR_INDEX, PAIR_SIDE
from hybridtune.config import DatasetConfig
from hybridtune.data.collator import PackedCollator
from hybridtune.data.formats import to_example
from hybridtune.data.images import is_image_part
from hybridtune.data.packing import Example, PackStats, pack
from hybridtune.data.report import CUT_UNTRAINED, OVERLONG, TRUNCATED
from hybridtune.data.rows import decode_json_cells
from hybridtune.data.video import is_video_part
from hybridtune.errors import DataError

logger = logging.getLogger(__name__)

PREFERENCE = "preference"
CHOSEN, REJECTED = 0, 1
IDENTICAL = "identical_replies"
EMPTY = "empty_reply"
WHY = {
    IDENTICAL: "dropped: the chosen and rejected replies are the same",
    EMPTY: "dropped: a reply is empty (no trained token)",
    OVERLONG: "dropped: the pair is longer than sequence_len={} (its two documents share one pack)",
    TRUNCATED: "truncated to sequence_len={} for the pair",
    CUT_UNTRAINED: "dropped: truncating the pair to sequence_len={} cut a reply's every trained token",
}


@dataclass
class Pair(Example):
    """A row's two documents end to end (`input_ids`: the chosen document's, then the rejected one's); `split` is
    the chosen document's length. Its length is what the pair takes of a pack."""

    split: int = 0

    def docs(self) -> tuple[Example, Example]:
        s = self.split
        return Example(self.input_ids[:s], self.loss_mask[:s]), Example(self.input_ids[s:], self.loss_mask[s:])


@dataclass
class PairDoc(Example):
    """One document of a pair in a pack: `pair` (the pair's number in the run's data) and `side` (CHOSEN, REJECTED)."""

    pair: int = -1
    side: int = CHOSEN


def is_preference(row: dict, ds: DatasetConfig) -> bool:
    """Whether a row is in a preference format: it has the chosen and the rejected field."""
    return ds.field_chosen in row and ds.field_rejected in row


def used_fields(ds: DatasetConfig) -> set[str]:
    return {ds.field_prompt, ds.field_chosen, ds.field_rejected, "tools"}


def _empty(reply) -> bool:
    if isinstance(reply, str) or reply is None:
        return not reply.strip()
    if isinstance(reply, list):
        return all(isinstance(m, dict) and not m.get("tool_calls") and not str(m.get("content") or "").strip()
                   for m in reply)  # fmt: skip
    return False


def _shared_prompt(chosen, rejected, ds: DatasetConfig, where: str):
    """(prompt, chosen reply, rejected reply) of two whole conversations: their longest shared prefix, leaving each
    reply at least its last message (or, for texts, nothing left out: TRL's rule)."""
    if isinstance(chosen, list) and isinstance(rejected, list):
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        if n == 0:
            raise DataError(
                f"{where}: no '{ds.field_prompt}' field and '{ds.field_chosen}' / '{ds.field_rejected}' do not start "
                "with the same messages, so there is no shared prompt; add a prompt field or give whole conversations"
            )
        return chosen[:n], chosen[n:], rejected[n:]
    if isinstance(chosen, str) and isinstance(rejected, str):
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        if n and chosen[n - 1] == " ":
            n -= 1
        return chosen[:n], chosen[n:], rejected[n:]
    raise DataError(
        f"{where}: '{ds.field_chosen}' and '{ds.field_rejected}' must both be texts or both lists of messages"
    )


def _check_reply_roles(reply, key: str, ds: DatasetConfig, where: str, fork: int | None) -> None:
    """A reply of messages holds the model's turns only: assistant turns, and tool results answering a tool call the
    reply made before them. Every reply message is trained, so a user or system turn there would be trained as if
    the model had said it. `fork`: where the replies start in their fields when the prompt is their shared prefix."""
    if not isinstance(reply, list):
        return
    called = False
    for j, m in enumerate(reply):
        role = m.get(ds.message_field_role) if isinstance(m, dict) else None
        trained = role == "assistant" or (role in ds.roles_to_train and role not in ("user", "system", "tool"))
        if not isinstance(role, str) or trained or (role == "tool" and called):
            called = called or bool(isinstance(m, dict) and m.get("tool_calls"))
            continue  # (a message without a role is parse_messages' to refuse)
        what = "answers no tool call made earlier in the reply" if role == "tool" else "is not the model's"
        if fork is None:
            fix = f"move it into '{ds.field_prompt}'"
        else:
            fix = (
                f"with no '{ds.field_prompt}' field the replies start where '{ds.field_chosen}' and "
                f"'{ds.field_rejected}' differ at message {fork}; give a '{ds.field_prompt}' field, or conversations "
                "that differ only in the model's turns"
            )
        raise DataError(
            f"{where}: message {j + (fork or 0)} of '{key}' has role '{role}', which {what}: a reply holds only the "
            f"model's turns (assistant, and tool results of its own tool calls), every one of them trained; {fix}"
        )


def _check_value(value, key: str, ds: DatasetConfig, where: str) -> None:
    """A prompt or reply is text or a list of messages (a number would be trained as its digits), and holds no image
    or video: preference pairs train on text only so far."""
    if value is None and key == ds.field_prompt:
        return
    if not isinstance(value, (str, list)):
        raise DataError(
            f"{where}: field '{key}' is {type(value).__name__} {str(value)[:40]!r}; a preference prompt or reply must "
            'be text or a list of messages (write a number as text: "2")'
        )
    for j, m in enumerate(value if isinstance(value, list) else []):
        content = m.get(ds.message_field_content) if isinstance(m, dict) else None
        for k, part in enumerate(content if isinstance(content, list) else []):
            if is_image_part(part) or is_video_part(part):
                raise DataError(
                    f"{where}: message {j} of '{key}', content part {k} is {part.get('type')}: preference pairs (dpo, "
                    "simpo, orpo) train on text only so far (sft trains a vision-language model's images); drop the "
                    "media parts, or train this data with objective: sft"
                )


def row_examples(row: dict, tokenizer, ds: DatasetConfig, where: str, template_kwargs: dict | None = None):
    """A preference row -> (chosen document, rejected document); each is `to_example` of (prompt, reply) with
    only the reply trained. An empty reply's document has no trained token (the row is then dropped, counted)."""
    keys = (ds.field_chosen, ds.field_rejected)
    row = decode_json_cells(row, keys, keys)
    if isinstance(row.get(ds.field_chosen), list):
        row = decode_json_cells(row, (ds.field_prompt,))
    for key in keys:
        if row.get(key) is None:
            raise DataError(f"{where}: preference row has no value in field '{key}' (fields: {sorted(row)})")
    for key in (ds.field_prompt, *keys):
        _check_value(row.get(key), key, ds, where)
    chosen, rejected = row[ds.field_chosen], row[ds.field_rejected]
    prompt, fork = row.get(ds.field_prompt), None
    if prompt is None:
        prompt, chosen, rejected = _shared_prompt(chosen, rejected, ds, where)
        fork = len(prompt) if isinstance(prompt, list) else None
    docs = []
    for key, reply in ((ds.field_chosen, chosen), (ds.field_rejected, rejected)):
        _check_reply_roles(reply, key, ds, where, fork)
        if reply == []:  # rendered as one empty reply, then untrained
            reply = [{"role": "assistant", "content": ""}]
        one = {ds.field_prompt: prompt, key: reply, "tools": row.get("tools")}
        as_pc = dataclasses.replace(ds, field_completion=key)
        ex = to_example(one, "prompt_completion", tokenizer, as_pc, False, where, None, template_kwargs)
        if _empty(reply):
            ex = Example(ex.input_ids, [0] * len(ex))
        docs.append(ex)
    return docs[0], docs[1]


def append_rows(out: dict[str, list], row: dict, tokenizer, ds: DatasetConfig, where: str, template_kwargs) -> None:
    """The tokenising map's two output rows for one preference row (data/examples.py): each column of `out` gets
    its empty value ([] or, for `error`, None), then the documents, the unread fields and the row's error."""
    unused, error = sorted(set(row) - used_fields(ds)), None
    try:
        docs = row_examples(row, tokenizer, ds, where, template_kwargs)
    except DataError as e:
        docs, error = (Example([], []), Example([], [])), str(e)
    for ex in docs:
        for key, column in out.items():
            column.append(None if key == "error" else [])
        out["input_ids"][-1], out["loss_mask"][-1] = ex.input_ids, ex.loss_mask
        out["unused"][-1], out["error"][-1] = unused, error


def grouped(examples: Sequence[Example]) -> list[Pair]:
    """The tokenised cache's rows (chosen, rejected, chosen, ...) as one `Pair` per source row."""
    if len(examples) % 2:
        raise ValueError(f"preference examples come in twos, got {len(examples)}")
    return [_joined(c, r) for c, r in zip(examples[0::2], examples[1::2])]


def _joined(c: Example, r: Example) -> Pair:
    return Pair(input_ids=c.input_ids + r.input_ids, loss_mask=c.loss_mask + r.loss_mask, split=len(c))


def _trained(ex: Example) -> int:
    return sum(ex.loss_mask[1:])  # a document's first token is never a target


def _room(a: int, b: int, seq_len: int) -> tuple[int, int]:
    """Lengths of two documents cut to share `seq_len`: a short one kept whole, two long ones halved."""
    half = seq_len // 2
    if a <= half:
        return a, seq_len - a
    if b <= half:
        return seq_len - b, b
    return half, seq_len - half


def fit_pairs(
    pairs: Sequence[Pair], where: Callable[[int], str], seq_len: int, strategy: str, split: str = "train"
) -> tuple[list[Pair], PackStats, list[dict]]:
    """(kept pairs, counts, one record per dropped or truncated pair) under `excess_length_strategy`."""
    stats = PackStats(examples_in=len(pairs))
    kept: list[Pair] = []
    records: list[dict] = []
    for i, p in enumerate(pairs):
        c, r = p.docs()
        n, reason = len(p), None
        if c.input_ids == r.input_ids and c.loss_mask == r.loss_mask:
            reason = IDENTICAL
        elif not _trained(c) or not _trained(r):
            reason = EMPTY
        elif n > seq_len and strategy == "drop":
            reason = OVERLONG
        elif n > seq_len:
            a, b = _room(len(c), len(r), seq_len)
            c, r = Example(c.input_ids[:a], c.loss_mask[:a]), Example(r.input_ids[:b], r.loss_mask[:b])
            cut = not _trained(c) or not _trained(r) or c.input_ids == r.input_ids
            reason = CUT_UNTRAINED if cut else TRUNCATED
        if reason is not None:
            records.append(
                {"split": split, "where": where(i), "reason": reason, "tokens": n, "sequence_len": seq_len,
                 "tokens_over": max(0, n - seq_len), "trained_tokens": _trained(c) + _trained(r)}
            )  # fmt: skip
        if reason == TRUNCATED:
            stats.truncated += 1
            kept.append(_joined(c, r))
        elif reason is None:
            kept.append(p)
        else:
            stats.dropped += 1
    return kept, stats, records


def log_pair_records(records: Sequence[dict]) -> None:
    """One line per dropped or truncated pair: where it is and why."""
    for r in records:
        held = " [held out]" if r["split"] != "train" else ""
        logger.warning(
            "data: %s: %s (%d tokens)%s", r["where"], WHY[r["reason"]].format(r["sequence_len"]), r["tokens"], held
        )


def pair_docs(p: Pair, number: int) -> list[PairDoc]:
    c, r = p.docs()
    return [
        PairDoc(input_ids=d.input_ids, loss_mask=d.loss_mask, pair=number, side=side)
        for d, side in ((c, CHOSEN), (r, REJECTED))
    ]


def pack_pairs(pairs: Sequence[Pair], seq_len: int, packing: bool = True) -> list[list[PairDoc]]:
    """Bins of whole pairs (first-fit decreasing on their lengths; one pair a bin without packing), each pair as its
    chosen then its rejected document, numbered by its place in `pairs`."""
    bins = pack(pairs, seq_len) if packing else [[i] for i in range(len(pairs))]
    return [[d for i in b for d in pair_docs(pairs[i], i)] for b in bins]


class PairCollator(PackedCollator):
    """`PackedCollator` for packs of `PairDoc`s, adding each document's pair (numbered 0..P-1 in the pack, in order
    of appearance) and side as int64 [N] (-1 at a static layout's filler) and the pack's pair count P. A pack of
    plain documents (the held-out chosen replies) is collated as `PackedCollator` does."""

    def __call__(self, docs: Sequence[Example]) -> dict:
        batch = super().__call__(docs)
        if not any(isinstance(doc, PairDoc) for doc in docs):
            return batch  # held-out chosen replies, evaluated as supervised documents
        n = batch[CU_SEQ_LENS_Q].numel() - 1
        index, side = [-1] * n, [-1] * n
        number: dict[int, int] = {}
        sides: dict[int, set[int]] = {}
        for d, doc in enumerate(docs):
            if not isinstance(doc, PairDoc):
                raise ValueError("PairCollator collates the documents of preference pairs (PairDoc) only")
            index[d], side[d] = number.setdefault(doc.pair, len(number)), doc.side
            sides.setdefault(doc.pair, set()).add(doc.side)
        if any(s != {CHOSEN, REJECTED} for s in sides.values()) or len(docs) != 2 * len(number):
            raise ValueError("a pack of preference pairs must hold each pair's chosen and rejected document once")
        batch[PAIR_INDEX] = torch.tensor(index, dtype=torch.long)
        batch[PAIR_SIDE] = torch.tensor(side, dtype=torch.long)
        batch[NUM_PAIRS] = len(number)
        return batch
