"""Group-relative policy optimisation: `objective: grpo`, TRL's GRPO loss on packed prompt + completion documents.

Each prompt's `num_generations` completions form a group; a completion's advantage is its reward minus its group's
mean, divided by the group's (`scale_rewards: group`), the step's (`batch`) reward std + 1e-4, or not (`none`).
Per completion token, with r = exp(logp - old_logp) (old = logp detached when `num_iterations` is 1) and A its
completion's advantage: loss_t = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta kl_t, kl_t =
exp(ref - logp) - (ref - logp) - 1 (the reference: adapters off as data under LoRA, a frozen copy otherwise; only when
beta > 0). Log-probs are of logits / temperature, from the chunked head (no [tokens, vocab] logits).
The step's loss (its window: every completion of the step) is, by `loss_type`: grpo = mean over completions of each
completion's token mean; dr_grpo = token sum / (completions x max_completion_length); dapo = token mean over the step.
Old and reference log-probs are taken once per batch of completions (`prepare`), before its updates. Metrics by
TRL's names: kl, clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean (+ the rollout's rewards).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from hybridtune.batch import CU_SEQ_LENS_Q, LABELS
from hybridtune.config import TrainConfig
from hybridtune.data import IGNORE_INDEX, PackedCollator
from hybridtune.data.packing import Example, pack
from hybridtune.errors import ConfigError
from hybridtune.models.anatomy import output_head, text_model, unwrap
from hybridtune.ops.loss import linear_log_probs
from hybridtune.runtime import distributed, lora
from hybridtune.runtime.adapter_kind import adapter_kind
from hybridtune.runtime.step import model_inputs, shifted_targets
from hybridtune.train.objectives.preference import frozen_copy
from hybridtune.train.objectives.spec import check_keys

GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
# Batch keys of a pack of completions (`CompletionCollator`, `GRPO.prepare`).
ADVANTAGES = "advantages"  # float32 [N]: each document's advantage (0 at a static layout's filler)
NUM_COMPLETIONS = "num_completions"  # int: the pack's completions
OLD_LOGPS = "old_per_token_logps"  # float32 [T]: position t's log-prob of token t + 1 under the policy that sampled
REF_LOGPS = "ref_per_token_logps"  # float32 [T]: the same under the reference
STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)


@dataclasses.dataclass
class Completion(Example):
    """A prompt and one sampled completion as one document (`loss_mask`: 1 on the completion's tokens) with its
    completion's advantage."""

    advantage: float = 0.0


class CompletionCollator(PackedCollator):
    """`PackedCollator` for packs of `Completion`s: adds each document's advantage and the pack's completions."""

    def __call__(self, docs: Sequence[Example]) -> dict:
        batch = super().__call__(docs)
        n = batch[CU_SEQ_LENS_Q].numel() - 1
        adv = [getattr(d, "advantage", 0.0) for d in docs] + [0.0] * (n - len(docs))
        batch[ADVANTAGES] = torch.tensor(adv, dtype=torch.float32)
        batch[NUM_COMPLETIONS] = sum(isinstance(d, Completion) for d in docs)
        return batch


def group_advantages(rewards: torch.Tensor, num_generations: int, scale: str = "group") -> torch.Tensor:
    """Advantages `[B]` of rewards `[B]` laid out group after group (TRL's: std unbiased, + 1e-4)."""
    grouped = rewards.view(-1, num_generations)
    adv = rewards - grouped.mean(1).repeat_interleave(num_generations)
    if scale == "group":
        adv = adv / (grouped.std(1).repeat_interleave(num_generations) + STD_EPS)
    elif scale == "batch":
        adv = adv / (rewards.std() + STD_EPS)
    return adv


def pack_completions(completions: Sequence[Completion], seq_len: int, per_pack: int | None = None) -> list[list]:
    """Bins of completions (first-fit decreasing within `seq_len`; `per_pack`: at most that many in one bin)."""
    if per_pack:
        return [list(completions[i : i + per_pack]) for i in range(0, len(completions), per_pack)]
    return [[completions[i] for i in b] for b in pack(completions, seq_len)]


def completion_logps(model: torch.nn.Module, batch: dict, fused: bool, temperature: float = 1.0) -> torch.Tensor:
    """Position t's log-probability of token t + 1 under logits / temperature `[T]` (fp32; 0 where not trained)."""
    kwargs = model_inputs(batch)
    targets = shifted_targets(kwargs.pop(LABELS))
    base = unwrap(model)
    if fused:  # (hidden / T) @ W.T = logits / T
        hidden = text_model(base)(**kwargs, use_cache=False).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1])
        return linear_log_probs(hidden / temperature if temperature != 1 else hidden, output_head(base).weight, targets)
    logits = model(**kwargs).logits
    logp = torch.log_softmax(logits.reshape(-1, logits.shape[-1]).float() / temperature, dim=-1)
    valid = targets != IGNORE_INDEX
    return torch.where(valid, logp.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)


def doc_of_positions(batch: dict, length: int, device) -> torch.Tensor:
    """Each position's document `[T]` (int64)."""
    positions = torch.arange(length, device=device)
    return torch.searchsorted(batch[CU_SEQ_LENS_Q][1:].to(torch.long), positions, right=True)


@dataclasses.dataclass
class GRPO:
    """`objective: grpo`; `fused`: log-probs from the chunked head (train's `loss` choice)."""

    fused: bool = True
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    temperature: float = 1.0
    max_completion_length: int = 256
    num_iterations: int = 1
    reference: torch.nn.Module | None = None  # a full fine-tune's frozen starting model; None: adapters switched off
    name: str = "grpo"
    batch_keys: frozenset[str] = frozenset({LABELS, ADVANTAGES, NUM_COMPLETIONS})
    needs_generation: bool = True
    sums: dict = dataclasses.field(default_factory=dict)
    rollout: dict = dataclasses.field(default_factory=dict)  # the rollout's metrics of the step (rewards, lengths)

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0

    def prepare(self, model: torch.nn.Module, batches: list[dict]) -> None:
        """Before a batch of completions' first update: its old log-probs (num_iterations > 1) and the reference's
        (beta > 0), without gradients, into each batch (on the model's device)."""
        with torch.no_grad():
            for b in batches:
                if self.num_iterations > 1:
                    b[OLD_LOGPS] = completion_logps(model, b, self.fused, self.temperature)
                if self.beta > 0:
                    b[REF_LOGPS] = self.reference_logps(model, b)

    def reference_logps(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        if self.reference is not None:
            return completion_logps(self.reference, batch, self.fused, self.temperature)
        if not callable(getattr(model, "disable_adapter", None)):
            raise ConfigError(
                "grpo with beta > 0 needs a reference: under LoRA the adapters are switched off; under a full "
                "fine-tune the objective is built with a frozen copy of the starting model"
            )
        with lora.adapters_off(model):  # (each LoRA layer's scale 0 as data: the policy's own compiled code)
            return completion_logps(model, batch, self.fused, self.temperature)

    def window_items(self, batches: list[dict]) -> int:
        """What the step's loss averages over: completions (grpo), completions x max_completion_length (dr_grpo),
        trained completion tokens (dapo). Starts the window's metrics."""
        self.sums = {}
        completions = sum(b[NUM_COMPLETIONS] for b in batches)
        if self.loss_type == "grpo":
            return completions
        if self.loss_type == "dr_grpo":
            return completions * self.max_completion_length
        return sum(int((b[LABELS] != IGNORE_INDEX).sum()) for b in batches)

    def loss(self, model: torch.nn.Module, batch: dict, num_items: int) -> torch.Tensor:
        logp = completion_logps(model, batch, self.fused, self.temperature)
        mask = (shifted_targets(batch[LABELS]) != IGNORE_INDEX).to(logp.dtype)
        doc = doc_of_positions(batch, logp.shape[0], logp.device)
        adv = batch[ADVANTAGES].to(logp.device, logp.dtype)[doc]
        old = batch[OLD_LOGPS] if OLD_LOGPS in batch else logp.detach()
        ratio = torch.exp(logp - old)
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + high)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
        if self.beta > 0:
            delta = batch[REF_LOGPS] - logp
            kl = torch.exp(delta) - delta - 1
            per_token = per_token + self.beta * kl
            self._add("kl", (kl.detach() * mask).sum())
        per_token = per_token * mask
        if self.loss_type == "grpo":
            n = batch[CU_SEQ_LENS_Q].numel() - 1
            sums = per_token.new_zeros(n).index_add(0, doc, per_token)
            counts = mask.new_zeros(n).index_add(0, doc, mask)
            total = (sums / counts.clamp(min=1)).sum()
        else:
            total = per_token.sum()
        r = ratio.detach()
        low_clip = ((r < 1 - self.epsilon) & (adv < 0)).to(mask.dtype) * mask
        high_clip = ((r > 1 + high) & (adv > 0)).to(mask.dtype) * mask
        self._add("clip_ratio/low_mean", low_clip.sum())
        self._add("clip_ratio/high_mean", high_clip.sum())
        self._add("clip_ratio/region_mean", (low_clip + high_clip).sum())
        self._add("tokens", mask.sum())
        return total / max(num_items, 1)

    def _add(self, key: str, value: torch.Tensor) -> None:
        v = value.detach().double()
        self.sums[key] = self.sums[key] + v if key in self.sums else v

    def step_metrics(self, d: distributed.Dist = distributed.ONE) -> dict[str, float]:
        """The step's kl and clip ratios (means over its completion tokens, over ranks), and the rollout's."""
        out = dict(self.rollout)
        if self.sums:
            names = list(self.sums)
            got = dict(zip(names, distributed.all_sum_(torch.stack([self.sums[k] for k in names]), d).tolist()))
            tokens = max(got.pop("tokens"), 1.0)
            out |= {k: v / tokens for k, v in got.items()}
        self.sums = {}
        return out


def build_grpo(cfg: TrainConfig, fused: bool, model: torch.nn.Module | None = None) -> GRPO:
    """The objective of `cfg`; `model` (the freshly built one) gives a full fine-tune with beta > 0 its reference."""
    check_keys(cfg)
    reference = None
    if cfg.beta > 0 and adapter_kind(cfg).lora and model is not None:
        lora.live_scales(model)  # the scales are tensors from the first forward on: no recompile
    elif cfg.beta > 0 and model is not None:
        reference = frozen_copy(model)
    return GRPO(
        fused=fused, beta=cfg.beta, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, temperature=cfg.temperature,
        loss_type="dapo" if cfg.loss_type == "auto" else cfg.loss_type, max_completion_length=cfg.max_completion_length,
        num_iterations=cfg.num_iterations, reference=reference,
    )  # fmt: skip
