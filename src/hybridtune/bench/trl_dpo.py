"""TRL's DPOTrainer as the bench's dpo baseline: `trl-dpo` (its own padding) and `trl-dpo-pf` (padding_free=True).

The model is the preset's weights as the hf-* modes load them, gradient checkpointing as users run it with peft
(non-reentrant), then hybridtune's LoRA call (`lora_from_config`: the same r, alpha, targets and seeded draws as the
ht modes, so losses compare step for step) handed to `DPOTrainer` with `ref_model=None`. TRL then adds a frozen "ref"
copy of the adapter; it is removed again, so the reference is the model with its adapters switched off, as TRL does
for a `peft_config` and as hybridtune does (a fresh adapter's copy is that same base model, at more cost).

What is timed is TRL's step, one micro-batch: its collator's padded batch (prompt + chosen rows, then prompt +
rejected rows, padded to the longest), `DPOTrainer.compute_loss` (policy forward with its fused LM head, the
reference forward without gradients, the loss for the config's beta and loss_type, its metrics), backward, then the
worker's clipping and AdamW as for every mode. Not timed: TRL's text tokenisation (the bench hands it tokenised
rows) and the Trainer's loop (its dataloader, callbacks, logging): each step's pairs are one pack's pairs of
hybridtune's pair packing (bench/pairs.py), in order, so neither TRL's sampler shuffles nor its loader drops.
Reference log-probs are never precomputed (`precompute_ref_log_probs=False`), as hybridtune does not.
"""

from __future__ import annotations

import dataclasses
import tempfile

import torch

from hybridtune.batch import NUM_PAIRS, NUM_TOKENS
from hybridtune.bench.pairs import trl_examples
from hybridtune.models.hub import resolve_source
from hybridtune.models.loading import load_model, tokenizer_for
from hybridtune.runtime.adapter_kind import adapter_kind
from hybridtune.runtime.compose import Composed
from hybridtune.runtime.lora import applied_targets, lora_from_config
from hybridtune.runtime.model import RunModel
from hybridtune.train.objectives.dpo import DPO_LOSS_TYPES

INSTALL = "pip install trl==1.16.0 datasets"


class NotRun(Exception):
    """A mode that cannot run as asked here, with the reason: its row says it and the bench goes on."""


def _trl():
    try:
        import datasets
        import trl
    except ImportError as e:
        raise ImportError(f"the trl-dpo modes need TRL's DPOTrainer: {INSTALL} ({e})") from None
    return trl, datasets


class TRLLoss(torch.nn.Module):
    """A trl mode's engine: `DPOTrainer.compute_loss` of one collated batch (`batch["trl"]`): TRL's mean over the
    batch's pairs. `objective.window_items` counts the pairs, as hybridtune's dpo does."""

    def __init__(self, trainer):
        super().__init__()
        self.model = trainer.model
        self.trainer = trainer  # (not a module: not part of the parameters)
        self.objective = PairCount()

    def forward(self, batch: dict, num_items: int | None = None) -> torch.Tensor:
        return self.trainer.compute_loss(self.model, batch["trl"])


class PairCount:
    def window_items(self, batches: list[dict]) -> int:
        return sum(b[NUM_PAIRS] for b in batches)


def dpo_config(trl, cfg, mode, device: torch.device, out: str):
    """DPOConfig for the run: hybridtune's beta, loss type and label smoothing; no truncation (the pairs fit the
    bench's packs); checkpointing as the mode says; bf16 on a GPU; the reference computed each step."""
    return trl.DPOConfig(
        output_dir=out,
        beta=cfg.beta,
        loss_type=[DPO_LOSS_TYPES[0] if cfg.loss_type == "auto" else cfg.loss_type],
        label_smoothing=cfg.label_smoothing,
        max_length=None,
        padding_free=mode.padding_free,
        precompute_ref_log_probs=False,
        gradient_checkpointing=mode.gc,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=device.type == "cuda",
        use_cpu=device.type != "cuda",
        learning_rate=cfg.learning_rate,
        lr_scheduler_type="constant",
        per_device_train_batch_size=1,
        max_grad_norm=cfg.max_grad_norm,
        seed=cfg.seed,
        report_to="none",
        save_strategy="no",
        dataset_num_proc=None,
    )


PROBE = "tiny-qwen3_5"  # the model TRL's padding_free answer is asked on before the run's own model loads


def _trainer(trl, datasets, model, tokenizer, args):
    placeholder = datasets.Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}])  # (init only)
    return trl.DPOTrainer(model=model, args=args, train_dataset=placeholder, processing_class=tokenizer)


def _refused(trl, why: str) -> NotRun:
    return NotRun(
        f"TRL {trl.__version__} turns DPOConfig(padding_free=True) off{why} (it logs that padding-free is unavailable "
        "and falls back to padding): trl-dpo-pf would measure trl-dpo again"
    )


def probe_padding_free(trl, datasets, cfg, mode) -> None:
    """NotRun when TRL turns padding_free off for a tiny model of the family, on the CPU: a second of work
    instead of loading a 9B model to hear the same answer (the run's own model is asked again once loaded)."""
    probe = resolve_source(PROBE)
    tokenizer = tokenizer_for(probe)
    model = load_model(probe, tokenizer, seed=0, dtype=torch.float32).model
    model = lora_from_config(model, dataclasses.replace(cfg, lora_r=4, lora_alpha=8, lora_target_parameters=[]))
    with tempfile.TemporaryDirectory(prefix="hybridtune-trl-") as out:
        trainer = _trainer(trl, datasets, model, tokenizer, dpo_config(trl, cfg, mode, torch.device("cpu"), out))
    if not getattr(trainer, "padding_free", False):
        raise _refused(trl, f" (asked on {PROBE} before loading the model)")


def build_trl(cfg, mode, source, tokenizer, device: torch.device, packs: list, result: dict):
    """(`Composed` whose engine is TRL's loss, the packs as TRL's collated batches on the device)."""
    trl, datasets = _trl()
    result["trl"] = trl.__version__
    if not adapter_kind(cfg).lora:
        raise NotRun(
            "the trl-dpo modes run LoRA (a full fine-tune's TRL reference is a second model); use --adapter lora"
        )
    if mode.padding_free:
        probe_padding_free(trl, datasets, cfg, mode)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(cfg.seed)  # (as the hf modes and `hybridtune train`: the same weights and LoRA draws)
    loaded = load_model(source, tokenizer, seed=cfg.seed, dtype=dtype)
    model = loaded.model.to(device)
    if mode.gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model = lora_from_config(model, cfg)
    result["lora_modules"], result["lora_parameters"] = applied_targets(model)
    with tempfile.TemporaryDirectory(prefix="hybridtune-trl-") as out:
        trainer = _trainer(trl, datasets, model, tokenizer, dpo_config(trl, cfg, mode, device, out))
    if mode.padding_free and not getattr(trainer, "padding_free", False):
        raise _refused(trl, " for this model")
    peft_model = trainer.model
    if "ref" in getattr(peft_model, "peft_config", {}):
        peft_model.delete_adapter("ref")
        peft_model.set_adapter("default")
    result["reference"] = "the policy with its LoRA adapters switched off (TRL's use_adapter(None)), each step"
    engine = TRLLoss(trainer)
    engine.train()
    batches, padded = [], []
    for pack in packs:
        rows = trl_examples(pack)
        collated = trainer.data_collator(rows)
        mask = collated["attention_mask"]
        padded.append(mask.numel())
        batches.append(
            {
                "trl": {k: v.to(device) for k, v in collated.items()},
                NUM_PAIRS: len(rows),
                NUM_TOKENS: int(mask.sum()),  # the real tokens: prompt + chosen and prompt + rejected
                "doc_lens": mask.sum(1).tolist(),
            }
        )
    result["padded_tokens_per_pack"] = padded
    c = Composed(RunModel(loaded, peft_model, None), engine, engine, device, device.type == "cuda")
    return c, batches
