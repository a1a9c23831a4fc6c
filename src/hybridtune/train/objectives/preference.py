"""What the preference objectives (dpo.py) share: the run's data as pairs (`prepare_data`), the collator for them,
each pack's per-sequence log-probabilities by pair (`pair_logps`, summed from the chunked head's per-token
log-probabilities: no `[tokens, vocab]` logits), the reference's (`reference_logps`: under LoRA the same weights and
the same compiled code with the adapters' scale 0, one extra forward, detached; else a frozen copy of the starting
model), and the window's metrics, named as TRL names them (`WindowMetrics`).

A pack holds whole pairs, each reply its own document (prompt + chosen, prompt + rejected; data/pairs.py); the
batch carries each document's pair and side, so a document's log-probability lands in its pair's row whatever the
pack's order.
"""

from __future__ import annotations

import copy
import logging
from collections import Counter

import torch

from hybridtune.batch import CU_SEQ_LENS_Q, LABELS, NUM_PAIRS, PAIR_INDEX, PAIR_SIDE
from hybridtune.compiler.strategies import is_compiled
from hybridtune.config import PAIR_OBJECTIVES, PRESET_SEQUENCE_LEN, TrainConfig
from hybridtune.data import IGNORE_INDEX, PackedCollator
from hybridtune.data.build import LoadedData, PreparedData, prepare
from hybridtune.data.pairs import CHOSEN, PREFERENCE, PairCollator, PairDoc, fit_pairs, log_pair_records, pack_pairs
from hybridtune.errors import ConfigError, DataError
from hybridtune.models.anatomy import output_head, text_model, unwrap
from hybridtune.ops.loss import linear_log_probs
from hybridtune.runtime import distributed
from hybridtune.runtime.lora import adapters_off
from hybridtune.runtime.step import model_inputs, shifted_targets
from hybridtune.train.objectives.spec import check_keys

logger = logging.getLogger(__name__)

# Set on every micro-batch of a window by `Preference.window_items` (a python int): the window's trained tokens in
# chosen replies, over which an NLL term on them is averaged (TRL's token mean).
WINDOW_CHOSEN_TOKENS = "window_chosen_tokens"


def prepare_data(cfg: TrainConfig, tokenizer, loaded: LoadedData) -> PreparedData:
    """The run's bins and held-out examples: `data.build.prepare` for supervised data, pairs fitted and packed whole
    for preference data (the objective and the data must agree: one line otherwise)."""
    check_keys(cfg)
    kinds = {src.fmt == PREFERENCE for src in loaded.sources}
    paths = ", ".join(f"{src.source.name} ({src.fmt})" for src in loaded.sources)
    if kinds == {True, False}:
        raise DataError(f"the data mix preference pairs and supervised rows ({paths}); train them in separate runs")
    if cfg.objective in PAIR_OBJECTIVES and True not in kinds:
        raise ConfigError(
            f"objective '{cfg.objective}' trains on preference pairs, but the data are {paths}; give rows with "
            "prompt/chosen/rejected (or chosen/rejected conversations), or set objective: sft"
        )
    if cfg.objective not in PAIR_OBJECTIVES and True in kinds:
        raise ConfigError(
            f"the data are preference pairs ({paths}) but objective is '{cfg.objective}'; set objective: dpo "
            "(or simpo, orpo)"
        )
    return prepare_pairs(cfg, loaded) if True in kinds else prepare(cfg, tokenizer, loaded)


def prepare_pairs(cfg: TrainConfig, loaded: LoadedData) -> PreparedData:
    """Pairs fitted to sequence_len (each dropped or truncated one logged on its own line and in the report),
    packed whole; the held-out examples are the held-out pairs' chosen documents (eval loss and exact match on the
    preferred replies)."""
    seq_len = PRESET_SEQUENCE_LEN if cfg.sequence_len == "auto" else cfg.sequence_len

    def fit(picked, strategy: str, split: str):
        pairs = [src.examples[i] for src, i in picked]
        return fit_pairs(pairs, lambda k: picked[k][0].where(picked[k][1]), seq_len, strategy, split)

    fitted, stats, report = fit(loaded.train, cfg.excess_length_strategy, "train")
    held, _, held_report = fit(loaded.heldout, "drop", "heldout")
    if not fitted:
        raise DataError(
            f"no preference pairs left after filtering ({stats.examples_in} read, {stats.dropped} dropped: identical "
            f"or empty replies, or longer than sequence_len={seq_len}); raise sequence_len or check the data"
        )
    bins = pack_pairs(fitted, seq_len, cfg.sample_packing)
    stats.examples_packed, stats.bins = len(fitted), len(bins)
    stats.tokens, stats.capacity = sum(len(p) for p in fitted), len(bins) * seq_len
    reasons = Counter(r["reason"].replace("_", " ") for r in report)
    lost = "; " + ", ".join(f"{n} {why}" for why, n in sorted(reasons.items())) if reasons else ""
    logger.info(
        "data: %d preference pairs -> %d bins of %d tokens (%.0f%% full, both replies of a pair in one bin); "
        "%d held out%s",
        stats.examples_in, stats.bins, seq_len, 100 * stats.fill, len(held), lost,
    )  # fmt: skip
    log_pair_records(report + held_report)
    return PreparedData(bins, [p.docs()[0] for p in held], stats, report + held_report, loaded.sources, seq_len)


def collator_for(data: PreparedData) -> type[PackedCollator]:
    """The collator class of the run's bins: `PairCollator` for packs of preference pairs."""
    first = data.bins[0][0] if data.bins and data.bins[0] else None
    return PairCollator if isinstance(first, PairDoc) else PackedCollator


def token_logps(model: torch.nn.Module, batch: dict, fused: bool) -> torch.Tensor:
    """Each position's log-probability of its next token `[T]` (fp32; 0 where nothing is trained)."""
    kwargs = model_inputs(batch)
    targets = shifted_targets(kwargs.pop(LABELS))
    base = unwrap(model)
    if fused:
        hidden = text_model(base)(**kwargs, use_cache=False).last_hidden_state
        return linear_log_probs(hidden.reshape(-1, hidden.shape[-1]), output_head(base).weight, targets)
    logits = model(**kwargs).logits
    logp = torch.log_softmax(logits.reshape(-1, logits.shape[-1]).float(), dim=-1)
    valid = targets != IGNORE_INDEX
    return torch.where(valid, logp.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)


def by_pair(values: torch.Tensor, batch: dict) -> torch.Tensor:
    """Per-document values `[N]` as `[P, 2]` (pair, side); a static layout's filler falls into a dropped slot."""
    P, index = batch[NUM_PAIRS], batch[PAIR_INDEX]
    key = torch.where(index >= 0, index * 2 + batch[PAIR_SIDE], 2 * P)
    return values.new_zeros(2 * P + 1).index_add(0, key, values)[: 2 * P].view(P, 2)


def pair_logps(model: torch.nn.Module, batch: dict, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each reply, its trained tokens), both `[P, 2]` fp32 (side 0 chosen, 1 rejected)."""
    tok = token_logps(model, batch, fused)
    cu = batch[CU_SEQ_LENS_Q]
    positions = torch.arange(tok.shape[0], device=tok.device)
    # Position t predicts token t + 1 of the same document (a document's first token is never a target).
    doc = torch.searchsorted(cu[1:].to(torch.long), positions, right=True)
    n = cu.shape[0] - 1
    valid = (shifted_targets(batch[LABELS]) != IGNORE_INDEX).to(tok.dtype)
    seq = tok.new_zeros(n).index_add(0, doc, tok)
    count = tok.new_zeros(n).index_add(0, doc, valid)
    return by_pair(seq, batch), by_pair(count, batch)


def reference_logps(model: torch.nn.Module, reference: torch.nn.Module | None, batch: dict, fused: bool):
    """`pair_logps` of the reference, detached: `reference` when given (a frozen copy, without gradients), else
    `model` with its LoRA adapters off as data (`runtime.lora.adapters_off`: each layer's scale 0). A compiled
    `model` runs its reference forward with grad mode on, as the policy's: the same compiled code and graph (a
    forward without gradients would compile one more); its outputs are detached at once, so nothing of it is kept
    for the backward (docs/PERFORMANCE.md)."""
    if reference is not None:
        with torch.no_grad():
            return pair_logps(reference, batch, fused)
    if not callable(getattr(model, "disable_adapter", None)):
        raise ConfigError(
            "dpo needs a reference model: under LoRA the adapters are switched off; under a full fine-tune the "
            "objective is built with a frozen copy of the starting model (build_objective(cfg, fused, model))"
        )
    with adapters_off(model), torch.set_grad_enabled(torch.is_grad_enabled() and is_compiled(model)):
        logps, tokens = pair_logps(model, batch, fused)
    return logps.detach(), tokens


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The starting model as the reference of a full fine-tune: a copy beside it, frozen (logged with its size)."""
    if any(p.is_meta for p in model.parameters()):
        raise ConfigError(
            "objective dpo under a full fine-tune sharded by FSDP2 needs reference log-probs precomputed before "
            "training, which hybridtune does not do yet; use adapter: lora (the reference is then free), or "
            "distributed: ddp or one process (a frozen copy of the model beside it)"
        )
    ref = copy.deepcopy(model).requires_grad_(False)
    size = sum(p.numel() * p.element_size() for p in ref.parameters()) / 2**30
    logger.info(
        "reference model: a frozen copy of the starting model (%.2f GiB; a full fine-tune moves every weight, so "
        "the reference cannot be the trained model with something switched off)", size,
    )  # fmt: skip
    return ref


def chosen_tokens(batch: dict) -> int:
    """Trained tokens in the chosen replies of a collated (host) batch."""
    trained = batch[LABELS][0] != IGNORE_INDEX
    cu, side = batch[CU_SEQ_LENS_Q].tolist(), batch[PAIR_SIDE].tolist()
    return sum(int(trained[cu[d] : cu[d + 1]].sum()) for d, s in enumerate(side) if s == CHOSEN)


class WindowMetrics:
    """Sums over an optimizer step's pairs (detached, on the device), reduced over ranks and averaged per pair once
    a step (`take`); `nll_loss` is averaged over the chosen replies' trained tokens instead, as TRL does."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self.sums = {}

    def add(self, values: dict[str, torch.Tensor]) -> None:
        for k, v in values.items():
            v = v.detach().double().sum()
            self.sums[k] = self.sums[k] + v if k in self.sums else v

    def take(self, d: distributed.Dist) -> dict[str, float]:
        if not self.sums:
            return {}
        names = list(self.sums)  # (the same order on every rank: the objective adds them in one order)
        totals = distributed.all_sum_(torch.stack([self.sums[k] for k in names]), d).tolist()
        got = dict(zip(names, totals))
        self.reset()
        pairs, tokens = got.pop("pairs", 0.0), got.pop("nll_tokens", 0.0)
        out = {k: v / max(pairs, 1.0) for k, v in got.items() if k != "nll_loss"}
        if "nll_loss" in got:
            out["nll_loss"] = got["nll_loss"] / max(tokens, 1.0)
        return out
