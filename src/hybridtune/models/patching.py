"""`patch_model(model) -> PatchReport`: route every supported mixer of a built transformers model
through hybridtune ops (each registered mixer's families, `hybridtune.mixers.MIXERS`; the routed MoE experts as
grouped GEMMs, `experts.py`).

Mixers are found by structure (a family's `matches`), never by class or model name. Each matched module gets an
instance-level `forward` that:
    - with a cache (`cache_params` given: generation) calls the upstream forward unchanged;
    - otherwise (training, or evaluation without a cache) runs its family's `forward` on hybridtune ops,
      reading the collator's packing metadata from the kwargs the decoder layer already forwards.
Full-attention layers keep their module; an SDPA/eager model's attention implementation becomes
`hybridtune_varlen` (`attention.py`: varlen kernel for packed CUDA batches, SDPA with a document mask
otherwise); flash-attention, when chosen, is kept. `config.use_cache` is turned off (the decoder would
otherwise build a cache on every training forward); `generate()` still asks for one explicitly.
`unpatch_model` restores everything.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field

import torch

from hybridtune.mixers import MIXERS, registry
from hybridtune.mixers.attention import varlen as attention
from hybridtune.models import experts
from hybridtune.models.anatomy import PATCHED_FORWARD_ATTR

_ORIGINAL = PATCHED_FORWARD_ATTR
_FORWARD = "_hybridtune_forward"  # the routed family's forward, set on the module


@dataclass
class PatchReport:
    """What `patch_model` did. `routed`/`skipped`: module name -> path or reason."""

    routed: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    attention: str = ""
    backend: str = ""
    experts: dict[str, str] = field(default_factory=dict)  # module name -> path of the routed MoE experts

    @property
    def num_routed(self) -> int:
        return len(self.routed)

    def __str__(self) -> str:
        lines = [f"hybridtune patch: {self.num_routed} mixer(s) routed; ops backend: {self.backend}"]
        lines += [f"  {name}: {path}" for name, path in self.routed.items()]
        lines += [f"  {name}: kept upstream ({why})" for name, why in self.skipped.items()]
        if self.experts:
            lines.append(f"  routed experts: {len(self.experts)} layer(s), {next(iter(self.experts.values()))}")
        lines.append(f"  attention: {self.attention}")
        return "\n".join(lines)


def _patched_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    if cache_params is not None:
        return getattr(self, _ORIGINAL)(
            hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs
        )
    return getattr(self, _FORWARD)(self, hidden_states, attention_mask, kwargs)


def find_mixers(model: torch.nn.Module):
    """Yield (name, module, spec, family) for every module a registered mixer's family recognises."""
    pairs = registry.families()
    for name, module in model.named_modules():
        for spec, family in pairs:
            if family.matches(module):
                yield name, module, spec, family
                break


def _configs(model: torch.nn.Module):
    seen = set()
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and id(cfg) not in seen and hasattr(cfg, "_attn_implementation"):
            seen.add(id(cfg))
            yield cfg


def _route_attention(model: torch.nn.Module) -> str:
    impls = sorted({cfg._attn_implementation or "default" for cfg in _configs(model)})
    if any(i.startswith("flash_attention") for i in impls):
        return f"{'/'.join(impls)} (kept: flash-attention reads the varlen kwargs itself)"
    if impls == [attention.IMPLEMENTATION]:
        return f"{attention.IMPLEMENTATION} (already routed)"
    if any(i not in ("sdpa", "eager", "default") for i in impls):
        return f"{'/'.join(impls)} (kept: custom implementation)"
    name = attention.register()
    for cfg in _configs(model):
        _remember(model, cfg, "_attn_implementation")
        cfg._attn_implementation = name
    ok, why = attention.varlen_available()
    cuda = why if ok else f"SDPA with a document mask ({why})"
    return f"{name}: packed CUDA batches -> {cuda}; otherwise SDPA with a document mask (was {'/'.join(impls)})"


def patch_model(model: torch.nn.Module) -> PatchReport:
    """Route the mixers of `model` that a registered mixer's family recognises (the Qwen3.5- and Qwen3-Next-layout
    linear-attention modules, among others) through hybridtune ops. Idempotent. Returns a `PatchReport`."""
    report = PatchReport()
    routed_kinds = set()
    for mod_name, module, spec, family in find_mixers(model):
        reason = family.unsupported(module)
        if reason:
            report.skipped[mod_name] = f"{type(module).__name__}: {reason}"
            continue
        if _ORIGINAL not in module.__dict__:
            module.__dict__[_ORIGINAL] = module.forward
            module.__dict__[_FORWARD] = family.forward
            module.__dict__[registry.MIXER_ATTR] = spec.kind
            module.forward = types.MethodType(_patched_forward, module)
        report.routed[mod_name] = family.describe(module) or f"{family.name} -> hybridtune ops"
        routed_kinds.add(spec.kind)
    # The trainer patches before moving the model, so say what each device will run.
    backends = [s for s in MIXERS.values() if s.backend is not None and (s.kind in routed_kinds or not routed_kinds)]
    report.backend = "; ".join(
        f"{dev}: {s.backend(dev)}" if len(backends) == 1 else f"{s.kind} on {dev}: {s.backend(dev)}"
        for s in backends
        for dev in ("cpu", "cuda")
    )
    report.attention = _route_attention(model)
    report.experts = experts.route_experts(model)
    if report.routed:
        # The decoder builds a cache whenever use_cache is on, and with a cache the mixers take the upstream
        # path; training never wants one. generate() passes use_cache explicitly, so generation still caches.
        for cfg in _configs(model):
            if getattr(cfg, "use_cache", False):
                _remember(model, cfg, "use_cache")
                cfg.use_cache = False
    model._hybridtune_patch_report = report
    return report


def _remember(model: torch.nn.Module, cfg, attr: str) -> None:
    saved = model.__dict__.setdefault("_hybridtune_saved_config", [])
    if not any(c is cfg and a == attr for c, a, _ in saved):
        saved.append((cfg, attr, getattr(cfg, attr)))


@contextlib.contextmanager
def original_config(model: torch.nn.Module):
    """The config fields patch_model changed (use_cache, the attention implementation) as the model came, for the
    duration: a save inside writes the checkpoint's own config, not the training settings."""
    saved = model.__dict__.get("_hybridtune_saved_config", [])
    now = [(cfg, attr, getattr(cfg, attr)) for cfg, attr, _ in saved]
    for cfg, attr, old in saved:
        setattr(cfg, attr, old)
    try:
        yield
    finally:
        for cfg, attr, value in now:
            setattr(cfg, attr, value)


def is_patched(model: torch.nn.Module) -> bool:
    return any(_ORIGINAL in m.__dict__ for _, m, _, _ in find_mixers(model))


def unpatch_model(model: torch.nn.Module) -> int:
    """Restore the upstream forwards and the config fields patch_model changed; returns how many mixers
    were restored."""
    experts.unroute_lora(model)
    experts.unroute_experts(model)
    for cfg, attr, old in model.__dict__.pop("_hybridtune_saved_config", []):
        setattr(cfg, attr, old)
    n = 0
    for m in model.modules():
        if _ORIGINAL in m.__dict__:
            m.__dict__.pop(_ORIGINAL)
            m.__dict__.pop("forward", None)
            m.__dict__.pop(_FORWARD, None)
            m.__dict__.pop(registry.MIXER_ATTR, None)
            n += 1
    return n
