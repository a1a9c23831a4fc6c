"""Every row accounted for: fitting examples to `sequence_len` with a record of each row truncated or dropped (where it
is, why, how many tokens over), a few of them named in the log and all of them returned for the run's
`data_report.jsonl` (written by the trainer: the data layer writes no run file).

Reasons: `longer_than_sequence_len` (dropped under `excess_length_strategy: drop`, and always for held-out rows),
`truncated` (kept, its first sequence_len tokens), `no_trained_token_after_truncation` (truncate cut every trained
token: dropped, counted apart), `no_trained_token` (nothing to train on in the row itself: an empty reply, a
one-token document). The first token of a document is never a target, so a trained token must come after it.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Sequence

from hybridtune.data.packing import Example, PackStats

logger = logging.getLogger(__name__)

NAMED_IN_LOG = 5  # rows named one line each; the rest are counted (all are in the report)
TRUNCATED = "truncated"
OVERLONG = "longer_than_sequence_len"
CUT_UNTRAINED = "no_trained_token_after_truncation"
UNTRAINED = "no_trained_token"
WHY = {
    TRUNCATED: "truncated to sequence_len={}",
    OVERLONG: "dropped: longer than sequence_len={}",
    CUT_UNTRAINED: "dropped: truncating to sequence_len={} cut every trained token",
    UNTRAINED: "dropped: no trained token",
}


def _trained(mask: Sequence[int]) -> int:
    return sum(mask[1:])


def fit(
    examples: Sequence[Example], where: Callable[[int], str], seq_len: int, strategy: str, split: str = "train"
) -> tuple[list[Example], PackStats, list[dict]]:
    """(kept examples, counts, one record per truncated or dropped example) under `strategy` ('truncate' or
    'drop'); the same examples `packing.fit_to_length` keeps. `where(i)`: example i's row."""
    if strategy not in ("truncate", "drop"):
        raise ValueError(f"excess_length_strategy must be 'truncate' or 'drop', got {strategy!r}")
    stats = PackStats(examples_in=len(examples))
    kept: list[Example] = []
    records: list[dict] = []
    for i, ex in enumerate(examples):
        n, trained = len(ex), _trained(ex.loss_mask)
        reason = None
        if n > seq_len and strategy == "drop":
            reason = OVERLONG
        elif n > seq_len:
            cut = ex.truncated(seq_len)
            reason = TRUNCATED if seq_len >= 2 and _trained(cut.loss_mask) else CUT_UNTRAINED
            if trained == 0:
                reason = UNTRAINED
        elif n < 2 or not trained:
            reason = UNTRAINED
        if reason is not None:
            record = {"split": split, "where": where(i), "reason": reason, "tokens": n, "sequence_len": seq_len}
            record.update(tokens_over=max(0, n - seq_len), trained_tokens=trained)
            if reason == TRUNCATED:
                record["trained_tokens_cut"] = trained - _trained(cut.loss_mask)
            records.append(record)
        if reason == TRUNCATED:
            stats.truncated += 1
            kept.append(cut)
        elif reason is None:
            kept.append(ex)
        else:
            stats.dropped += 1
    return kept, stats, records


def describe(record: dict) -> str:
    """One log line for a record: where, what happened, and the numbers."""
    over = f", {record['tokens_over']} over" if record["tokens_over"] else ""
    line = f"{record['where']}: {WHY[record['reason']].format(record['sequence_len'])}"
    line += f" ({record['tokens']} tokens{over}; {record['trained_tokens']} trained"
    if "trained_tokens_cut" in record:
        line += f", {record['trained_tokens_cut']} of them cut"
    return line + ")" + (" [held out]" if record["split"] != "train" else "")


def counts(records: Sequence[dict]) -> str:
    """'2 truncated, 1 dropped (1 truncation cut every trained token)' for the log's summary line ('' for none)."""
    by = Counter(r["reason"] for r in records if r["split"] == "train")
    dropped = by[OVERLONG] + by[CUT_UNTRAINED] + by[UNTRAINED]
    parts = []
    if by[TRUNCATED]:
        parts.append(f"{by[TRUNCATED]} truncated")
    if dropped:
        why = [
            f"{by[OVERLONG]} longer than sequence_len" if by[OVERLONG] else "",
            f"{by[CUT_UNTRAINED]} whose truncation cut every trained token" if by[CUT_UNTRAINED] else "",
            f"{by[UNTRAINED]} without a trained token" if by[UNTRAINED] else "",
        ]
        parts.append(f"{dropped} dropped ({', '.join(w for w in why if w)})")
    return ", ".join(parts)


def log_records(records: Sequence[dict], named: int = NAMED_IN_LOG) -> None:
    """The first `named` records one line each, then how many more; every one is in the data report."""
    for r in records[:named]:
        logger.warning("data: %s", describe(r))
    if len(records) > named:
        logger.warning("data: and %d more rows truncated or dropped", len(records) - named)
    if records:
        logger.info("data: a training run lists every truncated or dropped row in data_report.jsonl in its output_dir")


def to_jsonl(records: Sequence[dict]) -> str:
    """The records as JSON lines (the text of data_report.jsonl)."""
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
