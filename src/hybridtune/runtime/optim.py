"""The optimizer and the learning-rate schedule of a run (warmup given in steps or as a share of the run).

`optim` names the optimizer (transformers' names of the same meaning accepted, `ALIASES`): `adamw` is torch's
(fused on a GPU; under a bf16 full fine-tune in one process or DDP, `masters.MasterAdamW` with fp32 masters in its
state); `adamw_8bit` and `adamw_bf16_sr` are torchao's (an optional dependency, imported here only when named).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from contextlib import contextmanager

import torch

from hybridtune.config import TrainConfig
from hybridtune.errors import ConfigError
from hybridtune.runtime.adapter_kind import adapter_kind
from hybridtune.runtime.defaults import recorded_values
from hybridtune.runtime.distributed import ONE, Dist
from hybridtune.runtime.masters import MASTER, MasterAdamW, merged

logger = logging.getLogger(__name__)


def lr_lambda(kind: str, warmup: int, total: int) -> Callable[[int], float]:
    """The learning-rate multiplier of step `step`: linear warmup, then constant, linear or cosine decay to 0.

    >>> f = lr_lambda("linear", 2, 10)
    >>> [round(f(s), 3) for s in (0, 1, 2, 6, 10)]
    [0.5, 1.0, 1.0, 0.5, 0.0]
    """

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        progress = min(max(progress, 0.0), 1.0)
        if kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


ALIASES = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_bnb_8bit": "adamw_8bit"}
TORCHAO = ("adamw_8bit", "adamw_bf16_sr")
INSTALL = "pip install 'hybridtune[optim]' (torchao)"


def optim_name(cfg: TrainConfig) -> str:
    """The run's optimizer, transformers' names read as ours (`adamw_bnb_8bit`: torchao's 8-bit AdamW serves)."""
    return ALIASES.get(cfg.optim, cfg.optim)


def uses_masters(cfg: TrainConfig, bf16: bool, d: Dist = ONE) -> bool:
    """Whether the model computes on bf16 weights with fp32 masters in `MasterAdamW` (masters.py)."""
    return adapter_kind(cfg).uses_masters(optim_name(cfg), bf16, d.engine)


def model_dtype(cfg: TrainConfig, bf16: bool) -> torch.dtype | None:
    """The dtype the optimizer asks a full fine-tune's weights to be held in (None: the model's rule): bf16 weights
    and states under `adamw_bf16_sr` (which needs them: `refuse_unrounded`, before the model loads)."""
    refuse_unrounded(cfg, bf16)
    return torch.bfloat16 if optim_name(cfg) == "adamw_bf16_sr" else None


def refuse_unrounded(cfg: TrainConfig, bf16: bool) -> None:
    """`adamw_bf16_sr` rounds bf16 weights: on fp32 ones (LoRA's adapters, a run without bf16) it would run as plain
    fp32 AdamW under its name. Refused in one line (ConfigError) saying why and what to set instead."""
    kind = adapter_kind(cfg)
    if optim_name(cfg) != "adamw_bf16_sr" or (not kind.lora and bf16):
        return
    why = [f"adapter: {kind.name}"] if kind.lora else []  # (as the user wrote it)
    if not bf16:
        why.append("bf16: false" + (" (auto: no GPU that computes in bf16)" if cfg.bf16 == "auto" else ""))
    raise ConfigError(
        f"optim: adamw_bf16_sr needs bf16: true and adapter: full (it rounds bf16 weights stochastically); this run "
        f"has {' and '.join(why)}, where its weights are fp32 and it would run as plain fp32 AdamW: set optim: adamw "
        "(or adamw_8bit for less optimizer memory), or run a full fine-tune with bf16: true"
    )


# torchao, once installed, is imported by transformers' model loading whatever the optimizer: its import logs a warning
# per C extension that does not load (CUDA kernels; its optimizers are Python and torch.compile) and "no triton" on
# the CPU, and torch warns about its pytree registrations. None of it is the user's to act on: errors still show.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)


def torchao_optim():
    """torchao.optim, or one line saying what to install."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (torch.jit.script_method, inside torchao)
            import torchao.optim  # optional dependency: only the runs that name its optimizers import it
    except ImportError as e:
        raise ConfigError(f"optim needs torchao, which is not installed ({e}): {INSTALL}") from None
    # Its compiled step says once that its 8-bit state class could cache better: advice for torchao's authors.
    warnings.filterwarnings("ignore", message=r".*does not implement _stable_hash_for_caching")
    return torchao.optim


def build_optimizer(
    params: list[torch.nn.Parameter],
    cfg: TrainConfig,
    device: torch.device,
    bf16: bool = False,
    d: Dist = ONE,
    masters: bool | None = None,
) -> torch.optim.Optimizer:
    """The run's optimizer over the trainable parameters (see the module doc). `masters`: whether the model's weights
    were split for fp32 masters (`RunModel.masters`, what `compose.optimization` passes); None: `uses_masters`."""
    name, lr, wd = optim_name(cfg), cfg.learning_rate, cfg.weight_decay
    fused = device.type == "cuda"
    if masters is None:
        masters = uses_masters(cfg, bf16, d)
    if name == "adamw" and masters:
        return MasterAdamW(params, lr=lr, weight_decay=wd, fused=fused, accumulate=not d.enabled)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd, fused=fused)
    refuse_unrounded(cfg, bf16)
    ao = torchao_optim()
    if name == "adamw_8bit":
        return ao.AdamW8bit(params, lr=lr, weight_decay=wd)
    return ao._AdamW(params, lr=lr, weight_decay=wd, bf16_stochastic_round=True)


def grad_tensors(optimizer: torch.optim.Optimizer, params: list) -> list:
    """What holds the gradients the step reads (clipping, the norm, the health checks): `MasterAdamW`'s fp32 masters
    in one process, else the parameters."""
    return optimizer.grad_tensors() if isinstance(optimizer, MasterAdamW) else params


def warmup_steps(cfg: TrainConfig, total_steps: int) -> int:
    """The run's warmup in steps: `warmup_ratio` of `total_steps` rounded up (as transformers rounds it) when set,
    else `warmup_steps`."""
    if cfg.warmup_ratio > 0:
        return math.ceil(cfg.warmup_ratio * total_steps)
    return cfg.warmup_steps


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    warmup = warmup_steps(cfg, total_steps)
    if cfg.warmup_ratio > 0:
        logger.info("warmup: %d of %d steps (warmup_ratio %g)", warmup, total_steps, cfg.warmup_ratio)
    return _Schedule(optimizer, lr_lambda(cfg.lr_scheduler, warmup, total_steps))


class _Schedule(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR whose `get_last_lr` is plain floats (torchao's optimizers hold `lr` as a tensor, so that a new value
    recompiles nothing; the step line and metrics.jsonl want a number)."""

    def get_last_lr(self) -> list[float]:
        return [float(v) for v in super().get_last_lr()]


def masters_into_model(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """At the end of training: `MasterAdamW`'s fp32 masters become the model's weights (what the export writes)."""
    merged(model, optimizer)


# A resume trains with the run's config (docs/RUNS.md): `hyperparameters` before the checkpoint loads,
# `schedule_problem` and `resumed_differences` on what it loaded (run/checkpoint.py refuses or warns), then
# `reapply_config`.
MACHINE_KEYS = frozenset({"fused", "foreach", "capturable", "differentiable"})  # how this machine runs the update
CONFIG_KEYS = frozenset({"weight_decay"})  # a group key the config sets, by its own name (the rates: the schedule's)
TOLERANCE = 1e-6  # relative: a float32 tensor's rate (torchao's) against the float it was made from


def hyperparameters(optimizer: torch.optim.Optimizer, scheduler) -> dict:
    """The optimizer's groups' hyperparameters and the schedule's base rates as the run's config built them: taken
    before a resume loads a checkpoint over them (`reapply_config`)."""
    groups = [{k: v.clone() if torch.is_tensor(v) else v for k, v in g.items() if k != "params"}
              for g in optimizer.param_groups]  # fmt: skip
    return {"groups": groups, "base_lrs": [v.clone() if torch.is_tensor(v) else v for v in scheduler.base_lrs]}


def recorded_hyperparameters(run) -> dict:
    """What a checkpoint's run record (checkpoint.json's `run`) says its run trained with, by config key:
    `learning_rate` (what its `auto` took) and `weight_decay`, each only where it records a number."""
    config = run.get("config") if isinstance(run, dict) else None
    out = {"learning_rate": recorded_values(run).get("learning_rate")}
    out["weight_decay"] = config.get("weight_decay") if isinstance(config, dict) else None
    return {k: v for k, v in out.items() if _number(v)}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _rate(v) -> bool:
    return _number(v) or (torch.is_tensor(v) and v.numel() == 1 and v.is_floating_point() and bool(v.isfinite()))


def _show(v) -> str:
    if torch.is_tensor(v) and v.numel() == 1:
        v = v.item()
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (tuple, list)) and v and all(isinstance(x, float) or torch.is_tensor(x) for x in v):
        inner = ", ".join(map(_show, v))
        return f"[{inner}]" if isinstance(v, list) else f"({inner})"
    return repr(v)[:80]


def schedule_problem(state, scheduler, step) -> str | None:
    """Why a checkpoint's saved schedule must not be loaded into `scheduler` (this run's, not yet loaded), or None.
    torch's load sets every saved key as an attribute: a key naming a method or the optimizer would replace it (a
    traceback mid-run, or another thing stepped), a counter of another type fails at the next step, and a saved
    rate function's state is copied onto ours. Its step must be the checkpoint's; its base and last rates (what
    `resumed_differences` compares) finite numbers, one a group."""
    fresh = scheduler.state_dict()
    if not isinstance(state, dict):
        return f"its learning-rate schedule is a {type(state).__name__}, not a saved schedule"
    for key, value in state.items():
        attr = getattr(type(scheduler), key, None) if isinstance(key, str) else None
        named = isinstance(key, str) and not key.startswith("__") and key != "optimizer"
        if not named or callable(attr) or isinstance(attr, property):
            return f"its learning-rate schedule sets {str(key)[:80]!r}, which is not a saved value"
        if isinstance(fresh.get(key), (bool, int)) and type(value) is not type(fresh[key]):
            kind = "a bool" if isinstance(fresh[key], bool) else "an int"
            return f"its learning-rate schedule's {key} is {_show(value)}, where {kind} belongs"
    if any(f is not None for f in state.get("lr_lambdas") or ()):
        return "its learning-rate schedule carries state for rate functions, which hybridtune's have none of"
    n = len(fresh["base_lrs"])
    for key in ("base_lrs", "_last_lr"):
        rates = state.get(key)
        if not isinstance(rates, list) or len(rates) != n or not all(map(_rate, rates)):
            return f"its learning-rate schedule's {key} is {_show(rates)}, not {n} finite rate(s)"
    if state.get("last_epoch") != step or type(step) is not int:
        return (
            f"its learning-rate schedule is at step {_show(state.get('last_epoch'))} but the checkpoint is at {step!r}"
        )
    return None


def resumed_differences(optimizer: torch.optim.Optimizer, scheduler, fresh: dict, recorded: dict):
    """What the optimizer's groups and the schedule loaded from a checkpoint hold that the run's config (`fresh`,
    from `hyperparameters`) does not, as `(unexplained, changed)` lines (`key saved where the config gives value`).

    `changed`: a learning rate or weight decay that the checkpoint's own run record gives (`recorded`, from
    `recorded_hyperparameters`; or that it records nothing of): the config was changed since that run, which the
    output directory's rules accept only under --overwrite, and the config's value is right. `unexplained`: anything
    else, which only a change to the files after the save makes: a constant of the optimizer (betas, eps, amsgrad,
    ...), a rate or weight decay its record does not give, or the optimizer's rates (`initial_lr`, `lr`) other than
    its own schedule's. How this machine runs the update (`MACHINE_KEYS`: fused on a GPU) is no difference."""
    unexplained, changed = [], []
    if len(fresh["groups"]) != len(optimizer.param_groups) or len(scheduler.base_lrs) != len(fresh["base_lrs"]):
        counts = f"{len(optimizer.param_groups)} optimizer groups and {len(scheduler.base_lrs)} scheduled rates"
        return [f"{counts}, this run {len(fresh['groups'])}"], []
    many = len(fresh["groups"]) > 1

    def compare(name: str, i: int, saved, want, config_key: str | None = None, whose: str = "the config") -> None:
        if not _same(saved, want):
            said = recorded.get(config_key) if config_key else None
            ok = config_key is not None and (said is None or _same(saved, said))
            group = f" (group {i})" if many else ""
            (changed if ok else unexplained).append(f"{name}{group} {_show(saved)} where {whose} gives {_show(want)}")

    bases = zip(scheduler.base_lrs, fresh["base_lrs"], scheduler._last_lr)  # (`schedule_problem` checked them)
    for i, (group, want, (base, config_base, rate)) in enumerate(zip(optimizer.param_groups, fresh["groups"], bases)):
        compare("learning_rate", i, base, config_base, "learning_rate")
        compare("initial_lr", i, group.get("initial_lr", base), base, whose="its schedule")
        compare("lr", i, group["lr"], rate, whose="its schedule")
        for key, value in want.items():
            if key not in MACHINE_KEYS and key not in ("lr", "initial_lr"):
                compare(key, i, group.get(key, "none"), value, key if key in CONFIG_KEYS else None)
    return unexplained, changed


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        a, b = (x.tolist() if torch.is_tensor(x) else x for x in (a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return type(a) is type(b) and a == b
    return math.isclose(a, b, rel_tol=TOLERANCE, abs_tol=0.0)


def _set(group: dict, key: str, value) -> None:
    held = group.get(key)
    if torch.is_tensor(held) and held.numel() == 1 and not isinstance(value, (tuple, list)):
        held.fill_(float(value))  # torchao's tensor lr: its compiled step reads the same tensor
    else:
        group[key] = value.clone() if torch.is_tensor(value) else value


def reapply_config(optimizer: torch.optim.Optimizer, scheduler, fresh: dict, step: int) -> None:
    """After a checkpoint's optimizer and schedule are loaded and checked (`resumed_differences`): the run's config
    is what trains, not what the files say. Every key of every group and the schedule's base rates are set back to
    `fresh` (the config's, from `hyperparameters`) and the rate recomputed for `step` by the config's schedule."""
    for group, want in zip(optimizer.param_groups, fresh["groups"]):
        for key, value in want.items():
            if key != "lr":  # the schedule's: recomputed below
                _set(group, key, value)
    scheduler.base_lrs = list(fresh["base_lrs"])
    rates = [base * f(step) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, rate in zip(optimizer.param_groups, rates):
        _set(group, "lr", rate)
    scheduler._last_lr = [float(r) for r in rates]


def optim_label(optimizer: torch.optim.Optimizer) -> str:
    """The `optim` that built `optimizer`, as a message names it (MasterAdamW: `adamw (fp32 masters)`)."""
    if isinstance(optimizer, MasterAdamW):
        return "adamw (fp32 masters)"
    if type(optimizer).__module__.startswith("torchao"):
        return "adamw_8bit" if type(optimizer).__name__ == "AdamW8bit" else "adamw_bf16_sr"
    return "adamw" if isinstance(optimizer, torch.optim.AdamW) else type(optimizer).__name__


def _saved_keys(saved) -> tuple[dict[str, set], dict[str, set]]:
    """The keys of a checkpoint's optimizer groups (by group index) and per-parameter state (by parameter name), from
    its DCP keys `saved`."""
    groups: dict[str, set] = {}
    states: dict[str, set] = {}
    for k in saved:
        if k.startswith("optim.param_groups."):
            i, _, key = k.removeprefix("optim.param_groups.").partition(".")
            groups.setdefault(i, set()).add(key)
        elif k.startswith("optim.state."):
            name, _, key = k.removeprefix("optim.state.").rpartition(".")
            states.setdefault(name, set()).add(key)
    return groups, states


def _tensor(saved, key: str) -> bool:
    return hasattr(saved.get(key), "chunks")  # (DCP's TensorStorageMetadata; a plain value's is BytesStorageMetadata)


@contextmanager
def saved_group_keys_only(osd: dict, saved):
    """While DCP loads a checkpoint whose DCP keys are `saved` into `osd` (this run's optimizer state, by parameter
    name): the keys of `osd`'s groups that the checkpoint's lack are taken out (DCP's strict load refused them in its
    own words: "Missing key in checkpoint state_dict"), then put back with this run's values. A checkpoint of an older
    torch (whose AdamW groups had no `decoupled_weight_decay`) resumes: every group key is the config's after the
    load anyway (`reapply_config`)."""
    groups, _ = _saved_keys(saved)
    taken = []
    for i, group in enumerate(osd.get("param_groups") or ()):
        for key in sorted(set(group) - groups.get(str(i), set(group))):
            taken.append((group, key, group.pop(key)))
    try:
        yield
    finally:
        for group, key, value in taken:
            group[key] = value


def layout_problem(osd: dict, optimizer: torch.optim.Optimizer, saved, run, strict: bool = True) -> str | None:
    """Why a checkpoint whose DCP keys are `saved` (with their storage metadata) cannot load into `optimizer`'s state
    `osd` (this run's, by parameter name, before the load) because another optimizer wrote it, or None: a parameter's
    state with other keys (MasterAdamW's `master`), or a group key it holds as a tensor where this run's is a number
    (torchao's lr), which DCP's strict load would refuse naming its own keys. A group key it lacks names no optimizer
    (an older torch's AdamW has no `decoupled_weight_decay`): group keys are the config's (`saved_group_keys_only`,
    `reapply_config`). Says the optim the checkpoint's run record `run` names and this run's."""
    _, states = _saved_keys(saved)
    detail = None
    for name, held in (osd.get("state") or {}).items() if strict else ():
        if name in states and states[name] != set(held):
            there, here = sorted(states[name] - set(held)), sorted(set(held) - states[name])
            said = [f"holds {', '.join(map(repr, there))}, which this run's has not"] if there else []
            said += [f"lacks {', '.join(map(repr, here))}"] if here else []
            detail = f"its state of parameter '{name}' {' and '.join(said)}"
            break
    for i, group in enumerate(osd.get("param_groups") or ()) if detail is None else ():
        held = [k for k, v in group.items() if not torch.is_tensor(v) and _tensor(saved, f"optim.param_groups.{i}.{k}")]
        if held:
            detail = f"its optimizer's group {i} holds {', '.join(map(repr, held))} as a tensor, this run's as a number"
            break
    if detail is None:
        return None
    config = run.get("config") if isinstance(run, dict) else None
    name = config.get("optim") if isinstance(config, dict) else None
    mine = optim_label(optimizer)
    if not isinstance(name, str):
        return (
            f"its optimizer state was written by another optimizer than this run's {mine} ({detail}); resume it with "
            "the optim it was written with, or start the run afresh (--overwrite without resume_from_checkpoint)"
        )
    masters = any(MASTER in keys for keys in states.values())
    theirs = ALIASES.get(name, name) + (" (fp32 masters)" if masters else "")
    same = theirs.split()[0] == mine.split()[0]
    keep = "the bf16, adapter and distributed settings it was written with" if same else f"optim: {theirs.split()[0]}"
    return (
        f"it was saved with optim {theirs} and this run's config asks for {mine}: its optimizer state does not carry "
        f"over ({detail}); keep {keep} to resume it, or start the run afresh (--overwrite without "
        "resume_from_checkpoint)"
    )
