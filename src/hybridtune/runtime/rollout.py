"""In-process rollouts for on-policy objectives (grpo): groups of completions sampled on the policy's live weights.

Each prompt is prefilled once (one forward, transformers' hybrid `DynamicCache`: the GDN layers' conv and recurrent
state, the attention layers' keys and values); the cache is then copied to the group's `num_generations` rows
(`Cache.reorder_cache`, an index_select on every layer's state) and one decode loop runs the group, a token per row
per step, until every row has ended its turn (an end-of-turn id, kept) or has `max_new_tokens`. Sampling is
transformers' (logits / temperature, then top-p as its TopPLogitsWarper keeps tokens), drawn by the exponential race
(argmax of p / E, E ~ Exp(1) from each row's own generator), so a row's tokens depend on its generator alone, not on
the rows beside it: a group equals its rows generated one by one (tested). temperature 0 is greedy.
The model is put in eval mode (no dropout) for the rollout and back as it was after.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from hybridtune.models.anatomy import text_config


@dataclass
class Rollout:
    """One completion: its token ids (through the first end-of-turn id when it has one) and whether it was cut at
    max_new_tokens."""

    ids: list[int]
    truncated: bool


def filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """transformers' TopPLogitsWarper: the smallest tokens whose cumulative probability (ascending) stays within
    1 - top_p are set to -inf; the most likely token is always kept."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=False)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop = cum <= 1 - top_p
    drop[..., -1:] = False
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def next_tokens(logits: torch.Tensor, temperature: float, top_p: float, generators: list) -> torch.Tensor:
    """One token per row of `logits` [R, V]: greedy at temperature 0, else sampled (the module doc's race)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = filter_top_p(logits.float() / temperature, top_p).softmax(-1)
    race = torch.stack(
        [torch.empty(logits.shape[-1], device=logits.device).exponential_(generator=g) for g in generators]
    )
    return (probs / race).argmax(-1)


@contextlib.contextmanager
def evaluating(model: torch.nn.Module):
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def _forward(model, ids: torch.Tensor, cache) -> torch.Tensor:
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].float()


@torch.no_grad()
def sample_group(
    model: torch.nn.Module,
    prompt: list[int],
    generators: list[torch.Generator | None],
    max_new_tokens: int,
    stop: list[int],
    temperature: float = 1.0,
    top_p: float = 1.0,
    pad_token_id: int = 0,
) -> list[Rollout]:
    """len(generators) completions of `prompt` (token ids): one prefill, its cache copied to every row, one decode
    loop. A row that has ended keeps decoding `pad_token_id` (its tokens after the end are dropped)."""
    device = next(model.parameters()).device
    rows = len(generators)
    with evaluating(model):
        cache = DynamicCache(config=text_config(model))
        logits = _forward(model, torch.tensor([prompt], device=device), cache).expand(rows, -1)
        cache.reorder_cache(torch.zeros(rows, dtype=torch.long, device=device))  # the prompt's state, on every row
        stops = torch.tensor(stop or [-1], device=device)
        out = torch.empty(rows, 0, dtype=torch.long, device=device)
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        for step in range(max_new_tokens):
            tok = torch.where(done, pad_token_id, next_tokens(logits, temperature, top_p, generators))
            out = torch.cat([out, tok[:, None]], 1)
            done = done | torch.isin(tok, stops)
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            logits = _forward(model, tok[:, None], cache)
    result = []
    for row in out.tolist():
        end = next((i for i, t in enumerate(row) if t in stop), None)
        result.append(Rollout(row, True) if end is None else Rollout(row[: end + 1], False))
    return result


def sample_groups(
    model: torch.nn.Module,
    prompts: list[list[int]],
    num_generations: int,
    max_new_tokens: int,
    stop: list[int],
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    pad_token_id: int = 0,
) -> list[list[Rollout]]:
    """`num_generations` completions of each prompt; row j of prompt i draws from its own generator, seeded
    `seed + i * num_generations + j` (a rollout is reproducible from the seed alone)."""
    device = next(model.parameters()).device
    out = []
    for i, prompt in enumerate(prompts):
        gens = []
        for j in range(num_generations):
            g = torch.Generator(device=device)
            g.manual_seed(seed + i * num_generations + j)
            gens.append(g)
        out.append(sample_group(model, prompt, gens, max_new_tokens, stop, temperature, top_p, pad_token_id))
    return out
