"""Compile strategy "loop": the text model's forward (embeddings out, decoder loop, final norm) as one graph.

`compile_loop(model)` finds the text model by structure (the outermost module owning `embed_tokens` and a `layers`
ModuleList), routes its mixers through hybridtune ops (`patch_model`) and replaces its forward, on this instance
only, by a wrapper that runs the embedding lookup eagerly, calls the forward written in the class body (behind its
decorators) through `torch.compile(fullgraph=True)`, marks the pack-layout sizes dynamic (T, documents N, chunks C;
under a static layout only C), runs every decoder layer through `compiler.regions` (`regional=True`: each distinct
layer traced once) and puts an MoE model's router logits into the output's `router_logits`. With a cache, requested
hidden states / attentions, or forward hooks on a decoder layer, it calls the upstream forward instead.

Gradient checkpointing is switched to non-reentrant `torch.utils.checkpoint`. `handle.undo()` restores the forward.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridtune.batch import DYNAMIC_DIM0_KEYS, INT_KEYS
from hybridtune.compiler import recompute, region_schema, regions
from hybridtune.compiler.introspect import resolve_method
from hybridtune.mixers import registry
from hybridtune.models.anatomy import text_model
from hybridtune.models.patching import is_patched, patch_model

logger = logging.getLogger(__name__)
HANDLE_ATTR = "_hybridtune_loop"
_INT_KWARGS = INT_KEYS


@dataclass
class LoopHandle:
    """What `compile_loop` installed. `compiled` is the `torch.compile`d class-body forward."""

    text_model: Any = field(repr=False)
    compiled: Any = field(repr=False)
    patch_report: Any = None
    regions: Any = field(default=None, repr=False)  # compiler.regions.Regions, or None
    strategy: str = "loop"
    calls: int = 0
    eager_calls: int = 0
    warned: set = field(default_factory=set)  # the eager fallbacks already said once

    def undo(self) -> bool:
        """Put the text model's forward back; True if it was ours."""
        d = self.text_model.__dict__
        if getattr(d.get("forward"), HANDLE_ATTR, None) is self:
            del d["forward"]
            if self.regions is not None:
                self.regions.undo()
            return True
        return False


def class_body_forward(cls: type):
    """The `forward` written in `cls`, behind its decorators."""
    attr = vars(cls).get("forward")
    if attr is None:
        raise ValueError(f"{cls.__qualname__} does not define forward itself")
    fn = inspect.unwrap(attr)  # functools.wraps chains (capture_outputs, merge_with_config_defaults, ...)
    if getattr(fn, "__qualname__", "") == f"{cls.__qualname__}.forward":
        return fn
    # A bare-closure decorator somewhere in the stack: let the module compiler's resolver find the function.
    fn = resolve_method(cls, "forward")
    fn = inspect.unwrap(fn)
    if getattr(fn, "__qualname__", "") != f"{cls.__qualname__}.forward":
        raise ValueError(f"could not find the forward written in {cls.__qualname__} behind its decorators")
    return fn


def _use_non_reentrant_checkpointing(model: torch.nn.Module, keep_cores: bool = False) -> int:
    """Re-point every gradient-checkpointing layer at non-reentrant checkpointing (keeping the mixers' cores with
    `keep_cores`: compiler/recompute.py); returns how many."""
    from torch.utils.checkpoint import checkpoint

    wanted = recompute.checkpoint_kwargs(keep_cores)
    n = 0
    for m in model.modules():
        if getattr(m, "gradient_checkpointing", False) and hasattr(m, "_gradient_checkpointing_func"):
            func = m._gradient_checkpointing_func
            if getattr(func, regions.ATTR, None) is not None:
                continue  # a region's: non-reentrant already
            if getattr(func, "func", None) is checkpoint and func.keywords == wanted:
                continue
            m._gradient_checkpointing_func = recompute.checkpoint_fn(keep_cores)
            n += 1
    if n:
        logger.info("compile strategy 'loop': %d checkpointed layer(s) switched to non-reentrant checkpointing", n)
    return n


def _uses_flash(text_model) -> bool:
    impl = getattr(getattr(text_model, "config", None), "_attn_implementation", "") or ""
    return impl.startswith("flash_attention")


def _mark_layout_dynamic(inputs_embeds, position_ids, attention_mask, kwargs) -> None:
    """T, the number of documents and the number of chunks: dynamic, so a new pack layout does not recompile."""
    torch._dynamo.maybe_mark_dynamic(inputs_embeds, 1)
    if position_ids is not None:
        torch._dynamo.maybe_mark_dynamic(position_ids, position_ids.dim() - 1)
    if attention_mask is not None and isinstance(attention_mask, torch.Tensor):
        torch._dynamo.maybe_mark_dynamic(attention_mask, attention_mask.dim() - 1)
    for k in registry.dynamic_keys(DYNAMIC_DIM0_KEYS):
        if isinstance(kwargs.get(k), torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(kwargs[k], 0)


@contextlib.contextmanager
def _capture_hooks_idle(text):
    """transformers' output-capturing hooks, once on a model (any call that asked for hidden states, attentions or
    router logits installed them for good), run on every layer call and read a ContextVar, which dynamo cannot
    trace. transformers' own compiled path switches that variable to a plain attribute while compiling
    (`CompileableContextVar`); this does the same around our compiled call, with no collector set, so the
    hooks trace to nothing. Yields False where this transformers has no such variable (the caller then runs
    upstream). The variable is process-wide, as in transformers' own compiled path: a capture running in another
    thread at the same moment would collect nothing."""
    if not getattr(text, "_output_capturing_hooks_installed", False):
        yield True
        return
    try:
        from transformers.utils.output_capturing import _active_collector as var
    except ImportError:
        var = None
    if var is None or not (hasattr(var, "compiling") and hasattr(var, "global_var")):
        yield False
        return
    saved = (var.compiling, var.global_var)
    var.compiling, var.global_var = True, None
    try:
        yield True
    finally:
        var.compiling, var.global_var = saved


def _mark_chunks_dynamic(kwargs) -> None:
    """The static layout fixes T and N; the mixers' metadata rows (`registry.dynamic_keys`: a chunk count) vary per
    batch and only their opaque ops read them."""
    for k in registry.dynamic_keys():
        if isinstance(kwargs.get(k), torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(kwargs[k], 0)


# Inductor settings the regional loop needs: with buffer reuse on, inductor (torch 2.11-2.13) lets a reused region's
# backward write into a buffer a later invocation still reads, so the stamped-out layers get wrong gradients (where
# it was measured: docs/INTERNALS.md, compiler/loop.py). Off, the freed buffers go back to the caching allocator (or
# the CUDA-graph pool) instead of being overwritten in place: the same memory, a few more allocator calls.
# tests/compiler/test_loop_regions.py shows both (a strict xfail says when torch fixes it).
REGIONAL_INDUCTOR_OPTIONS = {"allow_buffer_reuse": False}


def inductor_settings(backend: Any, mode: str | None, regional: bool) -> dict:
    """torch.compile's `mode` / `options` for the loop: `mode` as given, except that a regional loop compiled by
    inductor gets REGIONAL_INDUCTOR_OPTIONS on top of the mode's own options (torch.compile takes one or the other)."""
    if not (regional and backend == "inductor" and REGIONAL_INDUCTOR_OPTIONS):
        return {"mode": mode}
    from torch._inductor import list_mode_options

    return {"options": {**list_mode_options(mode or "default"), **REGIONAL_INDUCTOR_OPTIONS}}


def compile_loop(
    model: torch.nn.Module,
    *,
    backend: str = "inductor",
    mode: str | None = None,
    fullgraph: bool = True,
    patch: bool = True,
    static_shapes: bool = False,
    regional: bool = False,
    keep_cores: bool = False,
) -> LoopHandle:
    """Compile the decoder loop of `model` (a transformers model, peft-wrapped or not) as one graph.

    Returns a `LoopHandle`; calling `model(**batch)` afterwards runs the compiled loop whenever no cache
    is in use. Batch tensors: input_ids/position_ids [1, T], cu_seq_lens_q/k [N + 1] and the mixers' metadata
    (`registry.model_keys`, e.g. chunk indices [C, 2]; see `hybridtune.data.collator`).

    `static_shapes=True` (batches of a static layout, `hybridtune.data.collator.StaticLayout`): only the
    mixers' metadata rows (`registry.dynamic_keys`, e.g. a chunk count) are marked dynamic (their opaque ops alone
    read them), so T and N are traced as constants (less to trace than the dynamic graph, and fit for CUDA graphs,
    which record once per distinct count); a batch of another T or N would then recompile.

    `regional=True` traces and compiles each distinct decoder layer once and stamps it out for the identical
    layers (`hybridtune.compiler.regions`); False (the default) inlines every layer into the one graph. Under
    dynamo's eager and AOT autograd's aot_eager backends both give the eager result; under inductor the
    regional loop compiles with inductor's buffer reuse off (REGIONAL_INDUCTOR_OPTIONS: with it on, torch's
    inductor gives the stamped-out layers wrong gradients).
    Either way the layers return their routers' logits when the model asks for them (`output_router_logits`),
    so an MoE model's router loss stays in the one graph.

    `keep_cores=True`: under gradient checkpointing each layer keeps its mixer's core outputs (`core_ops`: the
    linear-attention delta rule's, SDPA's attention kernels) from the forward and the backward's recompute skips them (compiler/recompute.py).
    """
    report = None
    if patch and not is_patched(model):
        report = patch_model(model)
    text = text_model(model)
    existing = getattr(text.__dict__.get("forward"), HANDLE_ATTR, None)
    if existing is not None:
        return existing
    fn = class_body_forward(type(text))
    if mode in ("reduce-overhead", "max-autotune") and torch.cuda.is_available():
        # CUDA graphs: what the mixers' ops need there (FLA's identity cache would keep pool tensors alive across
        # replays); process-wide and kept, as the compiled graphs are.
        registry.graph_setup(registry.CUDA_GRAPHS)
    # dynamo's "eager" backend compiles nothing a region could reuse, and runs each region eagerly once more on
    # uninitialised inputs to learn its outputs (ops that check their index inputs then fail): no regions there.
    regs = regions.install(text, regional=regional and backend != "eager", keep_cores=keep_cores)
    regional = regs is not None and regs.regional  # (None: a layer's forward is another wrapper's; inlined then)
    if regional:
        logger.info("%s", region_schema.memoize())  # else AOT re-traces every layer's body (region_schema.py)
    settings = inductor_settings(backend, mode, regional)
    compiled = torch.compile(fn, fullgraph=fullgraph, backend=backend, **settings)
    upstream = text.forward
    handle = LoopHandle(text_model=text, compiled=compiled, patch_report=report, regions=regs)
    recordable = regs is not None and regs.recordable
    keep_ints = _uses_flash(text)

    def eager(why: str | None, message: str, **call):
        """The upstream forward, for a call the compiled loop cannot take; `message` said once per `why`."""
        if why is not None and why not in handle.warned:
            handle.warned.add(why)
            logger.warning("compile strategy 'loop': %s", message)
        handle.eager_calls += 1
        if regs is not None:
            regs.record = False  # transformers' own hooks record, as upstream does
        return upstream(**call)

    def forward(
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        use_cache=None,
        **kwargs,
    ):
        wants_extra = kwargs.get("output_hidden_states") or kwargs.get("output_attentions")
        router = kwargs.get("output_router_logits")
        router = getattr(text.config, "output_router_logits", False) if router is None else router
        upstream_call = dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )  # the call as it came, for the eager fallbacks below (before kwargs is trimmed for the graph)
        if regs is not None and regs.foreign_hooks():
            return eager(
                "hooks on layers",
                "forward hooks on the decoder layers, which the compiled layers do not run; the forward runs "
                "eagerly (slow)",
                **upstream_call,
            )
        if past_key_values is not None or use_cache or wants_extra or (router and not recordable):
            return eager(
                "router" if router and not wants_extra else None,
                "the model records its routers' logits (output_router_logits, for its router loss) in a way the "
                "one-graph loop cannot; its forward runs eagerly (slow). Use the per-class strategy (compile: "
                "modules) for this model",
                **upstream_call,
            )
        if regs is not None:
            regs.keep_checkpointing()  # (checkpointing switched on since compile_loop installed the regions)
        if text.gradient_checkpointing or any(getattr(m, "gradient_checkpointing", False) for m in text.layers):
            _use_non_reentrant_checkpointing(text, keep_cores)
        if inputs_embeds is None:
            inputs_embeds = text.embed_tokens(input_ids)  # eager: its hooks (requires_grad_) stay out of the graph
        for k in ("output_hidden_states", "output_attentions", "return_dict", "output_router_logits"):
            kwargs.pop(k, None)
        if not keep_ints:
            for k in _INT_KWARGS:
                kwargs.pop(k, None)
        if static_shapes:
            _mark_chunks_dynamic(kwargs)
        else:
            _mark_layout_dynamic(inputs_embeds, position_ids, attention_mask, kwargs)
        with _capture_hooks_idle(text) as traceable:
            if traceable:
                handle.calls += 1
                if regs is not None:
                    regs.record = bool(router)
                    regs.take()
                out = compiled(
                    text,
                    input_ids=None,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    past_key_values=None,
                    inputs_embeds=inputs_embeds,
                    use_cache=False,
                    **kwargs,
                )
                if router:
                    out["router_logits"] = regs.take()
                return out
        return eager(
            "hooks",
            "transformers' output-capturing hooks are on this model and this transformers gives no way to trace "
            "them; its forward runs eagerly (slow)",
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=False,
            **kwargs,
        )

    setattr(forward, HANDLE_ATTR, handle)
    text.forward = forward
    setattr(model, HANDLE_ATTR, handle)
    how = ""
    if regional:
        how = "each distinct layer traced once (regions" + (
            ", inductor's buffer reuse off)" if "options" in settings else ")"
        )
    logger.info(
        "compile strategy 'loop': %s.forward compiled as one graph (fullgraph=%s)%s",
        type(text).__name__,
        fullgraph,
        f"; {how}" if how else "",
    )
    return handle
