"""LoRA through peft: target resolution, wrapping, and what gets trained; on a base built on the meta device (FSDP2
fills it after sharding) the adapter drawn on the host as on a plain base, and kept for the fill (`hold_adapter`);
the adapters switched off as data (`adapters_off`: a runtime scale, so a compiled forward serves both)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re

import torch
from torch.overrides import TorchFunctionMode

from hybridtune.config import ALL_LINEAR
from hybridtune.errors import ConfigError
from hybridtune.models import experts
from hybridtune.models.anatomy import text_model
from hybridtune.models.meta import Overlay

logger = logging.getLogger(__name__)


def text_prefix(model: torch.nn.Module) -> str:
    """The name of the decoder stack inside `model` (`model` for a causal LM, `model.language_model` for a
    vision-language model)."""
    stack = text_model(model)
    return next(n for n, m in model.named_modules() if m is stack)


def present_targets(model: torch.nn.Module, wanted: list[str]) -> tuple[list[str], list[str]]:
    """Split `wanted` module names into those the text model has (as a Linear's last name part) and those it lacks.
    `[all-linear]`: every Linear of the text model's decoder layers, as peft's all-linear (never lm_head, never a
    vision tower)."""
    if list(wanted) == [ALL_LINEAR]:
        layers = text_model(model).layers
        return sorted({n.rsplit(".", 1)[-1] for n, m in layers.named_modules() if isinstance(m, torch.nn.Linear)}), []
    names = {n.rsplit(".", 1)[-1] for n, m in text_model(model).named_modules() if isinstance(m, torch.nn.Linear)}
    found = [w for w in wanted if w in names]
    missing = [w for w in wanted if w not in names]
    return found, missing


def target_regex(model: torch.nn.Module, names: list[str]) -> str:
    """peft's `target_modules` as a regex (peft full-matches it against module names): the named Linear layers
    inside the text model only, so a vision tower's layers of the same names are not adapted."""
    alternatives = "|".join(re.escape(n) for n in names)
    return rf"{re.escape(text_prefix(model))}\.(?:.*\.)?(?:{alternatives})"


def check_parameters(model: torch.nn.Module, wanted: list[str]) -> None:
    """Every `lora_target_parameters` entry must name a parameter of the text model: its full name or the end of
    one (after a dot), as peft matches them."""
    prefix = text_prefix(model) + "."
    names = [n for n, _ in model.named_parameters() if n.startswith(prefix)]
    for w in wanted:
        if any(n == w or n.endswith("." + w) for n in names):
            continue
        # The fused expert weights are bare 3-D parameters (a conv's 3-D `weight` is not one).
        fused = sorted({n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.dim() == 3 and n in names})
        fused = [f for f in fused if f != "weight"]
        hint = f"e.g. {', '.join(fused)} (the routed experts' weights)" if fused else "it has no 3-D expert weights"
        raise ConfigError(
            f"config key 'lora_target_parameters' entry {w!r} names no parameter of this model's text model; {hint}"
        )


def apply_lora(
    model: torch.nn.Module,
    r: int,
    alpha: int,
    dropout: float,
    targets: list[str],
    target_parameters: list[str] | tuple[str, ...] = (),
):
    """Wrap `model` with a peft LoRA adapter on the named Linear modules of its text model and on the named
    parameters (peft's `target_parameters`: the fused 3-D weights of MoE experts); everything else is frozen.
    Experts that hybridtune routed (`models.experts.route_experts`) compute their LoRA as grouped GEMMs too."""
    from peft import LoraConfig, get_peft_model

    found, missing = present_targets(model, targets)
    if not found and not target_parameters:
        raise ConfigError(
            f"none of lora_target_modules {targets} names a Linear layer of this model; "
            f"e.g. {sorted(present_targets(model, ['q_proj', 'in_proj_qkv', 'out_proj', 'gate_proj'])[0])}"
        )
    if missing:
        logger.info("LoRA targets not in this model (skipped): %s", ", ".join(missing))
    check_parameters(model, list(target_parameters))
    # all-linear takes narrow layers too (a gate of one output): only a rank above the widest one is refused.
    check_rank(model, r, found, list(target_parameters), widest=list(targets) == [ALL_LINEAR])
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_regex(model, found) if found else [],
        target_parameters=list(target_parameters) or None,
        task_type="CAUSAL_LM",
        bias="none",
    )
    try:
        meta = any(p.is_meta for p in model.parameters())
        with AdaptersOnHost() if meta else contextlib.nullcontext():
            peft_model = get_peft_model(model, cfg)
    except ValueError as e:
        if "lora_dropout" not in str(e):
            raise
        # peft moved MLP names onto expert parameters (see below), and its LoRA on parameters has no dropout.
        raise ConfigError(
            f"config key 'lora_dropout' = {dropout}: peft adapts this model's {', '.join(found)} as expert "
            "parameters, whose LoRA has no dropout; set lora_dropout: 0"
        ) from None
    grouped = experts.route_lora(peft_model)
    if grouped:
        logger.info(
            "LoRA on the routed experts as grouped GEMMs in %d layer(s): %s", len(grouped), next(iter(grouped.values()))
        )
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    applied, params = applied_targets(peft_model)
    logger.info(
        "LoRA r=%d alpha=%d on %s: %s trainable of %s parameters",
        r,
        alpha,
        ",".join(applied + [f"{p} (expert parameter)" for p in params]),
        f"{trainable:,}",
        f"{total:,}",
    )
    rewritten = [t for t in found if t not in applied]
    if rewritten:
        # peft maps MLP names onto the fused 3-D expert weights of some MoE models (e.g. Qwen3-Next, as it loads
        # adapters trained on transformers 4) and then no longer targets the Linear layers of those names (the
        # shared expert's): say so, never silently.
        logger.warning(
            "peft adapted %s as expert parameters %s, not as the Linear layers of those names (e.g. a shared "
            "expert's MLP gets no LoRA); peft does the same when it loads the adapter",
            ",".join(rewritten),
            ",".join(params) or "(none)",
        )
    return peft_model


def lora_from_config(model: torch.nn.Module, cfg):
    """`apply_lora` with a run config's `lora_*` keys."""
    return apply_lora(
        model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules, cfg.lora_target_parameters
    )


def check_rank(
    model: torch.nn.Module, r: int, targets: list[str], parameters: list[str] = (), widest: bool = False
) -> None:
    """Refuse a rank above min(in, out) of the smallest targeted Linear (or expert matrix; `widest`: of the widest):
    such a rank adds nothing a full-rank update would not give, and a huge one would try to allocate its A and B
    matrices before failing."""
    shapes = [
        (n, (m.in_features, m.out_features))
        for n, m in text_model(model).named_modules()
        if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in targets
    ]
    shapes += [
        (n, tuple(p.shape[-2:][::-1]))
        for n, p in text_model(model).named_parameters()
        if p.dim() >= 2 and any(n == w or n.endswith("." + w) for w in parameters)
    ]
    if not shapes:
        return
    name, (fan_in, fan_out) = (max if widest else min)(shapes, key=lambda s: min(s[1]))
    largest = min(fan_in, fan_out)
    if r > largest:
        raise ConfigError(
            f"config key 'lora_r' = {r} is larger than the largest sensible rank {largest}: the targeted layer "
            f"'{name}' is {fan_in} -> {fan_out}, and a rank above min(in, out) adds nothing "
            f"a full-rank update would not give; set lora_r to at most {largest}"
        )


def applied_targets(peft_model) -> tuple[list[str], list[str]]:
    """(module names, parameter names) the adapter really targets, as peft placed it: the last parts of the names
    of the modules and parameters it wrapped."""
    tuner = peft_model.base_model
    modules = sorted({n.rsplit(".", 1)[-1] for n in getattr(tuner, "targeted_module_names", [])})
    params = sorted({n.rsplit(".", 1)[-1] for n in getattr(tuner, "targeted_parameter_names", [])})
    return modules, params


def strip_base_layer(name: str) -> str:
    """A parameter's name in the model peft wraps: every `.base_layer` peft inserted removed (peft nests one wrapper
    per adapted parameter of a module, e.g. `experts.base_layer.base_layer.gate_up_proj` when both expert weights
    are adapted), as peft itself unwraps names."""
    while ".base_layer." in name:
        head, _, tail = name.rpartition(".base_layer.")
        name = f"{head}.{tail}"
    return name


class AdaptersOnHost(TorchFunctionMode):
    """Inside `get_peft_model` on a base built on the meta device: peft draws each adapter on the host (nn.Linear's
    init, then its own: lora_A kaiming-uniform, lora_B zeros), then moves it to its base layer's device and dtype.
    Onto the meta device that move would drop the values just drawn; here it does the dtype cast alone and the
    tensor stays on the host, so the adapter holds what it holds on a plain base (the same draws in the same order
    under the run's seed, the same casts)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and isinstance(args[0], torch.Tensor) and not args[0].is_meta:
            # (`_parse_to` reads no `copy`; a call it cannot read is left to `to` itself, as outside this mode.)
            try:
                device, dtype, _, _ = torch._C._nn._parse_to(
                    *args[1:], **{k: v for k, v in kwargs.items() if k != "copy"}
                )
            except (TypeError, RuntimeError):
                return func(*args, **kwargs)
            if device is not None and device.type == "meta":
                return func(args[0], dtype or args[0].dtype, copy=bool(kwargs.get("copy", False)))
        return func(*args, **kwargs)


def hold_adapter(loaded) -> None:
    """A base built on the meta device with LoRA applied (`apply_lora`): the adapter, drawn on the host, is the only
    part with values. Filling the model (`models.loading.materialize`, after `fully_shard`) gives every parameter new
    storage, so the adapter is kept here, whole on every rank (a LoRA adapter is small), and written back shard by
    shard; the base is read or drawn as without LoRA, under its name before peft wrapped it. No-op for a model
    that holds its values (`loaded.reader` None)."""
    if loaded.reader is None:
        return
    drawn = {n: p.detach().clone() for n, p in loaded.model.named_parameters() if not p.is_meta}
    base = loaded.reader
    loaded.reader = lambda: Overlay(base(), drawn, strip_base_layer)


SCALES_ATTR = "_hybridtune_scales"  # on a LoRA layer: {adapter: Scale}


@dataclasses.dataclass
class Scale:
    """One adapter's scale as data: `on` (peft's float as a 0-d fp32 tensor) and `off` (a 0-d zero of its own: every
    layer keeps distinct tensors either way, as the compiled code was traced with), swapped into peft's `scaling`."""

    owner: dict
    name: str
    on: torch.Tensor
    off: torch.Tensor
    value: float

    def put(self, on: bool) -> None:
        self.owner[self.name] = self.on if on else self.off


def _lora_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """peft's LoRA layers of `model` (Linear and ParamWrapper alike: a `scaling` dict beside `lora_A`)."""
    return [m for m in model.modules() if isinstance(getattr(m, "scaling", None), dict) and hasattr(m, "lora_A")]


def live_scales(model: torch.nn.Module) -> list[Scale] | None:
    """Each LoRA layer's scale as data (`Scale`), its `on` tensor put in peft's `scaling` in place of the float peft
    multiplies by (the same numbers); None where the adapters cannot be switched off by their scale (no LoRA layer,
    or DoRA, whose scale 0 is not the base). Idempotent: a float peft put back (`set_scale`) or a device change
    gets new tensors."""
    layers = _lora_layers(model)
    if not layers or any(any(getattr(m, "use_dora", {}).values()) for m in layers):
        return None
    out = []
    for m in layers:
        held = m.__dict__.setdefault(SCALES_ATTR, {})
        for name, s in list(m.scaling.items()):
            device = m.lora_A[name].weight.device
            kept = held.get(name)
            if kept is None or s is not kept.on or kept.on.device != device:
                value = float(s)
                on = torch.tensor(value, dtype=torch.float32, device=device)
                kept = held[name] = Scale(m.scaling, name, on, torch.zeros_like(on), value)
                kept.put(True)
            out.append(kept)
    return out


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """The LoRA adapters of `model` off for the block: every layer's scale a zero tensor, so a compiled forward runs
    its own code with them off (peft's `disable_adapter` flips a flag the compiled code guards on, compiling it
    again). LoRA adds scale x B(A(dropout(x))): at 0 the base's output, exactly (a dropout still draws). The `on`
    tensors are never written (a policy forward's backward may still read them). peft's `disable_adapter` where
    the scale cannot do it (`live_scales` None)."""
    scales = live_scales(model)
    if scales is None:
        with model.disable_adapter():
            yield
        return
    for s in scales:
        s.put(False)
    try:
        yield
    finally:
        for s in scales:
            s.put(True)
