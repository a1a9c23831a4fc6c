"""`eval_samples`: a few greedy generations from held-out prompts at each eval.

A sample's prompt is an example's tokens up to its first trained token (a chat's conversation up to and including
the first trained assistant turn's header; an alpaca example's prompt), its reference the trained tokens that
follow, up to the end of that turn; examples with nothing before their first trained token (plain text) have no
prompt and are passed over. The same first N such examples of the held-out set are generated at every eval, so the
log shows one set of prompts evolving.

Generation is transformers' own `generate` (greedy, the model's recurrent and key/value cache) on the trained model
itself: the patched mixers take the upstream forward whenever a cache is given (models/patching.py), the
compiled loop calls the upstream forward with a cache (compiler/loop.py), and the attention implementation falls
back to SDPA without packing metadata. It stops at the reference's last token (the format's end of turn) or the
tokenizer's end-of-sequence token, and equals stock transformers' greedy decoding of the same weights (tested).
"""

from __future__ import annotations

import logging

import torch

from hybridtune.config import TrainConfig
from hybridtune.data.packing import Example
from hybridtune.runtime import distributed
from hybridtune.runtime.generation import greedy

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s", message)


def sample_prompts(examples: list[Example], n: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reference ids) of the first `n` examples that have a prompt.

    >>> ex = [Example([1, 2, 3], [1, 1, 1]), Example([5, 6, 7, 8, 9, 4], [0, 0, 1, 1, 0, 1])]
    >>> sample_prompts(ex, 2)
    [([5, 6], [7, 8])]
    """
    out = []
    for ex in examples:
        if len(out) == n:
            break
        first = next((i for i, m in enumerate(ex.loss_mask) if m), None)
        if not first or ex.images:  # nothing trained, nothing before it, or images (not generated with yet)
            continue
        end = next((i for i in range(first, len(ex)) if not ex.loss_mask[i]), len(ex))
        out.append((ex.input_ids[:first], ex.input_ids[first:end]))
    return out


def generate_samples(
    model: torch.nn.Module,
    examples: list[Example],
    tokenizer,
    cfg: TrainConfig,
    device: torch.device,
    autocast,
    d: distributed.Dist = distributed.ONE,
) -> list[dict] | None:
    """`cfg.eval_samples` samples `{prompt, generated, reference}` (decoded text) from `examples`, at most
    `cfg.eval_max_new_tokens` generated tokens each, on rank 0 (None on the other ranks, and under FSDP2, whose
    sharded weights a single rank cannot run: said once)."""
    if d.engine == "fsdp":
        if d.is_main:
            _warn_once("eval_samples: not generated under FSDP2 (sharded weights); the eval runs without them")
        return None
    if not d.is_main:
        return None
    prompts = sample_prompts(examples, cfg.eval_samples)
    if any(ex.images for ex in examples):
        _warn_once("eval_samples: held-out examples with images are passed over (generation with images: not yet)")
    if not prompts:
        _warn_once(
            "eval_samples: no held-out example has a prompt (plain text: every token is trained); none generated"
        )
        return None
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    was_training = model.training
    model.eval()
    out = []
    try:
        for prompt, reference in prompts:
            stop = sorted({reference[-1]} | ({eos} if eos is not None else set()))
            with autocast():
                new = greedy(model, prompt, cfg.eval_max_new_tokens, stop, pad, device)
            out.append(
                {
                    "prompt": tokenizer.decode(prompt),
                    "generated": tokenizer.decode(new),
                    "reference": tokenizer.decode(reference),
                }
            )
    finally:
        model.train(was_training)
    return out


def log_samples(samples: list[dict], step: int) -> None:
    """One line per sample: the prompt's end and what the model wrote, newlines shown as \\n."""

    def one_line(text: str, keep: int) -> str:  # keep > 0: the first `keep` characters; < 0: the last
        text = text.replace("\n", "\\n")
        if len(text) <= abs(keep):
            return text
        return text[:keep] + "..." if keep > 0 else "..." + text[keep:]

    for i, s in enumerate(samples, 1):
        prompt, generated = one_line(s["prompt"], -60), one_line(s["generated"], 200)
        logger.info("eval  step %d  sample %d/%d  %s -> %s", step, i, len(samples), prompt, generated)
