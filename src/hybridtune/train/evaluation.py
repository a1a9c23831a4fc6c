"""Held-out evaluation: loss and exact match over packs of the held-out examples, shared over ranks."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from hybridtune.batch import CU_SEQ_LENS_Q, LABELS, NUM_TOKENS
from hybridtune.data import IGNORE_INDEX, PackedCollator
from hybridtune.data.packing import Example
from hybridtune.runtime import distributed
from hybridtune.runtime.metrics import MetricsLog
from hybridtune.runtime.stream import to_device
from hybridtune.train.samples import log_samples

logger = logging.getLogger(__name__)


def eval_batches(examples: list[Example], seq_len: int) -> Iterator[list[Example]]:
    """Held-out examples in packs of at most seq_len tokens, in order."""
    cur: list[Example] = []
    used = 0
    for ex in examples:
        if cur and used + len(ex) > seq_len:
            yield cur
            cur, used = [], 0
        cur.append(ex)
        used += len(ex)
    if cur:
        yield cur


@torch.no_grad()
def evaluate(
    model,
    examples: list[Example],
    seq_len: int,
    device: torch.device,
    autocast,
    d: distributed.Dist = distributed.ONE,
    collate: PackedCollator | None = None,
) -> dict:
    """Held-out loss and exact match. `model(batch)` returns the logits `[1, T, vocab]` (a `LossModule`).

    Under torchrun each rank evaluates its share of the packs (`distributed.eval_share`) and the sums are
    all-reduced: every rank returns the metrics of one process, up to the order of float64 sums.

    Exact match: an example counts when the argmax prediction at every trained position (the whole
    response, end-of-turn included) equals the target. Under teacher forcing this is exactly the
    condition for greedy decoding to reproduce the response, so it is computed in one packed forward.
    """
    was_training = model.training
    model.eval()
    collate = collate or PackedCollator()
    total_loss, total_tokens, correct, counted = 0.0, 0, 0, 0
    packs = list(eval_batches(examples, seq_len))
    for i, counts in distributed.eval_share(len(packs), d):
        batch = to_device(collate(packs[i]), device)
        with autocast():
            logits = model(batch)
        if not counts:
            continue  # FSDP2: a rank short of packs takes part in the forward's collectives, counting nothing
        n = batch[NUM_TOKENS]  # the documents' own tokens: a static layout's filler comes after them
        logits = logits[0, : n - 1].float()
        targets = batch[LABELS][0, 1:n]
        mask = targets != IGNORE_INDEX
        ce = torch.nn.functional.cross_entropy(logits, targets.clamp(min=0), reduction="none")
        total_loss += float(ce[mask].sum())
        total_tokens += int(mask.sum())
        ok = (logits.argmax(-1) == targets) | ~mask
        cu = batch[CU_SEQ_LENS_Q].tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            # positions a..b-2 predict tokens a+1..b-1 of this document
            if mask[a : b - 1].any():
                counted += 1
                correct += int(ok[a : b - 1].all())
    model.train(was_training)
    total_loss, total_tokens, correct, counted = distributed.all_sum([total_loss, total_tokens, correct, counted], d)
    counted = int(counted)  # float64 holds these counts exactly
    return {
        "eval_loss": total_loss / max(total_tokens, 1),
        "exact_match": correct / max(counted, 1),
        "eval_examples": counted,
    }


def report_eval(res: dict, step: int, metrics: MetricsLog | None) -> None:
    """One eval line in the log (and one per `samples` entry) and one row in metrics.jsonl (`res` gains its step;
    `samples`, None where this rank generates none, is dropped then)."""
    res["step"] = step
    if res.get("samples") is None:
        res.pop("samples", None)
    if metrics is not None:
        metrics.write({"type": "eval", **res})
    logger.info(
        "eval  step %d  eval_loss %.4f  exact_match %.3f (%d held-out examples)",
        step,
        res["eval_loss"],
        res["exact_match"],
        res["eval_examples"],
    )
    log_samples(res.get("samples", []), step)
