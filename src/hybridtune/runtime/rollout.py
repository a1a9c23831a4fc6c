"""In-process rollouts for on-policy objectives (grpo): groups of completions sampled on the policy's live weights.

Every row of a rollout decodes together in one static state (transformers' `StaticCache`, kept on the model for the
next rollout of the same size): the prompts left-padded and prefilled in one forward (the padding masked, so a row
equals its prompt alone), then one decode loop, a token per row per step, until every row has ended its turn (an
end-of-turn id, kept) or has `max_new_tokens`. On a GPU the decode step runs as CUDA graphs (compiled, else captured),
trusted only after its first step's logits match the eager step's; a failure or mismatch is one warning and the
eager step. Sampling is transformers' (temperature, then its top-p warper), drawn by the exponential race from each
row's own generator, so a group equals its rows generated one by one; temperature 0 is greedy. The model is in eval
mode (no dropout) for the rollout and back as it was after. docs/ARCHITECTURE.md has the design.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
from transformers import StaticCache

from hybridtune.models.anatomy import text_config

logger = logging.getLogger(__name__)


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


# The check of a graphed step against the eager step: the max logit difference of one step from the same state, over
# the logits' scale. The compiled step rounds as eager does (STEP_INDUCTOR_OPTIONS): equal but for an fp32 sum of
# another order flipping a bf16 rounding (tests/runtime/test_rollout_compiled.py); a captured eager step is equal.
CHECK_TOLERANCE = 2e-2
BUCKET = 64  # prompt lengths are rounded up to a multiple of this: rollouts of nearby lengths share the buffers


def _bucket(n: int) -> int:
    return -(-n // BUCKET) * BUCKET


class Decoder:
    """The static state of `rows` rows of `length` tokens (prompt bucket + max_new_tokens) and the decode step over it
    (compiled with CUDA graphs on a GPU, after the check of the module doc)."""

    def __init__(self, model: torch.nn.Module, rows: int, length: int, device: torch.device):
        self.model, self.rows, self.length, self.device = model, rows, length, device
        self.cache = StaticCache(config=text_config(model), max_batch_size=rows, max_cache_len=length)
        self.mask = torch.zeros(rows, length, dtype=torch.bool, device=device)  # a written slot (prompt or new)
        self.types = set(getattr(text_config(model), "layer_types", None) or ["full_attention"])
        self.compiled = None  # the graphed step; None: not tried yet; False: the eager step (failed or not a GPU)
        self.how = "eager"

    def _masks(self, seen: torch.Tensor, recurrent: torch.Tensor | None) -> dict | torch.Tensor:
        """The layers' masks, made here rather than by transformers (whose padding checks read the mask on the host,
        which a CUDA graph cannot hold): attention's boolean [rows, 1, T, length] (`seen`: which slots each query
        sees), the linear-attention layers' 2-D padding mask of this forward's tokens (None: no padding, a decode step)."""
        if not self.types <= {"full_attention", "linear_attention"}:  # another model family: transformers' masks
            return self.mask.long() if recurrent is None else recurrent.long()
        return {"full_attention": seen, "linear_attention": recurrent}

    def _step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        masks = self._masks(self.mask[:, None, None, :], None)
        out = self.model(input_ids=tok, attention_mask=masks, position_ids=pos, past_key_values=self.cache,
                         use_cache=True, logits_to_keep=1)  # fmt: skip
        return out.logits[:, -1].float()

    def prefill(self, prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-pad `prompts` (one per row) to their bucket, prefill, and return the last logits [rows, V] and each
        row's next position [rows, 1]."""
        self.cache.reset()
        self.steps = 0
        width = _bucket(max(map(len, prompts)))
        ids = torch.full((self.rows, width), pad, dtype=torch.long)
        self.mask.zero_()
        mask = torch.zeros(self.rows, self.length, dtype=torch.bool)
        for r, p in enumerate(prompts):
            ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[r, width - len(p) : width] = True  # the prompt; each new token's slot is opened before its step
        self.mask.copy_(mask)
        self.width = width
        ids = ids.to(self.device)
        pos = (self.mask[:, :width].long().cumsum(-1) - 1).clamp(min=0)
        slots = torch.arange(self.length, device=self.device)
        causal = slots[None, :] <= slots[:width, None]  # [width, length]: a query sees its own slot and before
        seen = causal[None, None] & self.mask[:, None, None, :]
        masks = self._masks(seen, self.mask[:, :width])
        out = self.model(input_ids=ids, attention_mask=masks, position_ids=pos, past_key_values=self.cache,
                         use_cache=True, logits_to_keep=1)  # fmt: skip
        return out.logits[:, -1].float(), pos[:, -1:] + 1

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The next logits [rows, V] after `tok` [rows] at positions `pos` [rows, 1]."""
        tok = tok[:, None]
        self.mask[:, self.width + self.steps] = True  # this token's slot (the buffer keeps its address for the graphs)
        self.steps += 1
        if self.compiled is None:
            self.compiled = self._compile(tok, pos)
        if self.compiled:
            return self.compiled(tok, pos).float().clone()  # a CUDA graph's output is overwritten by its next replay
        return self._step(tok, pos)

    def _compile(self, tok: torch.Tensor, pos: torch.Tensor):
        """The fastest step that passes the check of the module doc: the step compiled with CUDA graphs, else the
        eager step captured in one CUDA graph, else False (the eager step), each failure said once."""
        if self.device.type != "cuda":
            return False
        saved = _state(self.cache)
        want = self._step(tok, pos)
        _restore(self.cache, saved)
        for how, make in (("compiled, CUDA graphs", self._compiled), ("one CUDA graph", self._captured)):
            try:
                fn = make(tok, pos, saved)
                got = fn(tok, pos)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - any failure: the next way, said once
                _restore(self.cache, saved)
                lines = str(e).splitlines()
                why = lines[0][:200] if lines else type(e).__name__
                where = [x.strip() for x in lines if x.strip().startswith("File ")][-1:]  # Dynamo's user frame
                logger.warning(
                    "rollout decoder: the %s step failed (%s%s)", how, why, f"; at {where[0]}" if where else ""
                )
                logger.debug("rollout decoder: the %s step's failure", how, exc_info=True)
                continue
            _restore(self.cache, saved)
            err = (got.float() - want).abs().max().item()
            scale = want.abs().max().item() or 1.0
            if not err <= CHECK_TOLERANCE * scale:  # NaN fails too
                logger.warning("rollout decoder: the %s step's logits differ from the eager step's (max %.3g of %.3g)",
                               how, err, scale)  # fmt: skip
                continue
            self.how = how
            logger.info("rollout decoder: %d rows x %d tokens, %s (checked against the eager step: max logit "
                        "difference %.3g of %.3g)", self.rows, self.length, how, err, scale)  # fmt: skip
            return fn
        logger.warning("rollout decoder: decoding eagerly, a kernel launch per op per token (slower)")
        return False

    def _compiled(self, tok, pos, saved):
        """The step compiled as one graph with inductor's CUDA graphs (cudagraph trees), keeping eager's roundings
        (`compiled_step`), warmed up on the saved state."""
        fn = compiled_step(self._step, "reduce-overhead")
        for _ in range(3):  # cudagraph trees record on the second or third call
            fn(tok, pos)
            _restore(self.cache, saved)
        return fn

    def _captured(self, tok, pos, saved):
        """The eager step recorded once as a CUDA graph over static input buffers (autocast's weight cache off: a
        cached cast made inside the capture would be freed after it)."""
        static_tok, static_pos = tok.clone(), pos.clone()
        amp = torch.is_autocast_enabled("cuda")
        dtype = torch.get_autocast_dtype("cuda")

        def run():
            with torch.autocast("cuda", dtype=dtype, enabled=amp, cache_enabled=False):
                return self._step(static_tok, static_pos)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # Triton autotuning and lazy allocations happen before the capture
                run()
                _restore(self.cache, saved)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        _restore(self.cache, saved)

        def replay(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
            static_tok.copy_(t)
            static_pos.copy_(p)
            graph.replay()
            return out

        return replay


# Inductor's options for the decode step on top of its mode's: a fused kernel rounds to bf16 where eager rounds
# between the ops it fuses (`emulate_precision_casts`; inductor's default keeps fp32 there: the gate's sigmoid, the
# conv's SiLU, the gated RMSNorm's product each one bf16 rounding apart, which compound over the layers and steps to a
# few percent of the logits). With it, the compiled step gives the eager step's numbers (docs/FAST_PATHS.md).
STEP_INDUCTOR_OPTIONS = {"emulate_precision_casts": True}


def compiled_step(fn, mode: str | None = None):
    """`fn` (a decode step) compiled by inductor as one graph of fixed shapes, under `mode`'s options (None:
    inductor's default; "reduce-overhead": CUDA graphs) and STEP_INDUCTOR_OPTIONS."""
    from torch._inductor import list_mode_options

    options = {**list_mode_options(mode or "default"), **STEP_INDUCTOR_OPTIONS}
    return torch.compile(fn, fullgraph=True, dynamic=False, options=options)


def _state(cache) -> list[tuple[object, str, object]]:
    """Copies of every tensor the cache's layers hold (to undo one step)."""
    saved = []
    for layer in cache.layers:
        for name, value in vars(layer).items():
            if isinstance(value, torch.Tensor):
                saved.append((layer, name, value.clone()))
            elif isinstance(value, dict):
                for k, v in value.items():
                    if isinstance(v, torch.Tensor):
                        saved.append((value, k, v.clone()))
    return saved


def _restore(cache, saved) -> None:
    """Writes the copies back in place (the buffers keep their addresses)."""
    for owner, name, value in saved:
        (owner[name] if isinstance(owner, dict) else getattr(owner, name)).copy_(value)


def decoder(model: torch.nn.Module, rows: int, length: int, device: torch.device) -> Decoder:
    """The model's decoder of this size: kept on the model, so the next rollout of the same size reuses its buffers
    and compiled step; one of another size replaces it."""
    kept = getattr(model, "_hybridtune_decoder", None)
    if kept is not None and (kept.rows, kept.length, kept.device) == (rows, length, device):
        return kept
    made = Decoder(model, rows, length, device)
    object.__setattr__(model, "_hybridtune_decoder", made)  # not a submodule: not in state_dict or parameters
    return made


@torch.no_grad()
def sample_rows(
    model: torch.nn.Module,
    prompts: list[list[int]],
    generators: list[torch.Generator | None],
    max_new_tokens: int,
    stop: list[int],
    temperature: float = 1.0,
    top_p: float = 1.0,
    pad_token_id: int = 0,
) -> list[Rollout]:
    """One completion of each row's prompt (`prompts[i]` sampled with `generators[i]`), all rows decoded together.
    A row that has ended keeps decoding `pad_token_id` (its tokens after the end are dropped)."""
    device = next(model.parameters()).device
    rows = len(prompts)
    with evaluating(model):
        dec = decoder(model, rows, _bucket(max(map(len, prompts))) + max_new_tokens, device)
        logits, pos = dec.prefill(prompts, pad_token_id)
        stops = torch.tensor(stop or [-1], device=device)
        out = torch.empty(rows, max_new_tokens, dtype=torch.long, device=device)
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        n = 0
        for step in range(max_new_tokens):
            tok = torch.where(done, pad_token_id, next_tokens(logits, temperature, top_p, generators))
            out[:, step] = tok
            n = step + 1
            done = done | torch.isin(tok, stops)
            if step == max_new_tokens - 1 or (step % 16 == 15 and bool(done.all())):  # a host sync every 16 tokens
                break
            logits = dec.step(tok, pos + step)
    result = []
    for row in out[:, :n].tolist():
        end = next((i for i, t in enumerate(row) if t in stop), None)
        result.append(Rollout(row, True) if end is None else Rollout(row[: end + 1], False))
    return result


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
    """len(generators) completions of `prompt` (token ids)."""
    rows = [prompt] * len(generators)
    return sample_rows(model, rows, generators, max_new_tokens, stop, temperature, top_p, pad_token_id)


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
    """`num_generations` completions of each prompt, every row decoded together; row j of prompt i draws from its own
    generator, seeded `seed + i * num_generations + j` (a rollout is reproducible from the seed alone, and equals its
    rows generated one by one)."""
    device = next(model.parameters()).device
    gens, rows = [], []
    for i, prompt in enumerate(prompts):
        for j in range(num_generations):
            g = torch.Generator(device=device)
            g.manual_seed(seed + i * num_generations + j)
            gens.append(g)
            rows.append(prompt)
    flat = sample_rows(model, rows, gens, max_new_tokens, stop, temperature, top_p, pad_token_id)
    return [flat[i * num_generations : (i + 1) * num_generations] for i in range(len(prompts))]
