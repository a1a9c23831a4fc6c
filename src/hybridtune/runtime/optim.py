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

import torch

from hybridtune.config import TrainConfig
from hybridtune.errors import ConfigError
from hybridtune.runtime.distributed import ONE, Dist
from hybridtune.runtime.masters import MasterAdamW, merged

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
    return cfg.adapter == "full" and bf16 and optim_name(cfg) == "adamw" and d.engine != "fsdp"


def model_dtype(cfg: TrainConfig, bf16: bool) -> torch.dtype | None:
    """The dtype the optimizer asks a full fine-tune's weights to be held in (None: the model's rule): bf16 weights
    and states under `adamw_bf16_sr` when bf16 computes."""
    return torch.bfloat16 if cfg.adapter == "full" and bf16 and optim_name(cfg) == "adamw_bf16_sr" else None


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
    params: list[torch.nn.Parameter], cfg: TrainConfig, device: torch.device, bf16: bool = False, d: Dist = ONE
) -> torch.optim.Optimizer:
    """The run's optimizer over the trainable parameters (see the module doc)."""
    name, lr, wd = optim_name(cfg), cfg.learning_rate, cfg.weight_decay
    fused = device.type == "cuda"
    if name == "adamw" and uses_masters(cfg, bf16, d):
        return MasterAdamW(params, lr=lr, weight_decay=wd, fused=fused, accumulate=not d.enabled)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd, fused=fused)
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


def hyperparameters(optimizer: torch.optim.Optimizer, scheduler) -> dict:
    """The optimizer's groups' hyperparameters and the schedule's base rates as the run's config built them: taken
    before a resume loads a checkpoint over them (`reapply_config`)."""
    groups = [{k: v.clone() if torch.is_tensor(v) else v for k, v in g.items() if k != "params"}
              for g in optimizer.param_groups]  # fmt: skip
    return {"groups": groups, "base_lrs": list(scheduler.base_lrs)}


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        a, b = (x.tolist() if torch.is_tensor(x) else x for x in (a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return type(a) is type(b) and a == b
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def _set(group: dict, key: str, value) -> None:
    held = group.get(key)
    if torch.is_tensor(held) and held.numel() == 1 and not isinstance(value, (tuple, list)):
        held.fill_(float(value))  # torchao's tensor lr: its compiled step reads the same tensor
    else:
        group[key] = value.clone() if torch.is_tensor(value) else value


def reapply_config(optimizer: torch.optim.Optimizer, scheduler, fresh: dict, step: int) -> list[str]:
    """After a checkpoint's optimizer and schedule are loaded: the run's config is what trains, not what the files
    say. Every hyperparameter of every group and the schedule's base rates are set back to `fresh` (the config's,
    from `hyperparameters`) and the rate recomputed for `step`; each saved value that differed is returned as a line
    (a changed config, or a checkpoint edited by hand: either way the config's value is the one used, said once).
    The caller has checked that the groups match in number and the schedule's step is the checkpoint's
    (run/checkpoint.py)."""
    said = []
    for i, (group, want) in enumerate(zip(optimizer.param_groups, fresh["groups"])):
        for key, value in want.items():
            if key == "lr":
                continue  # the schedule's: recomputed below
            if key not in group or not _same(group[key], value):
                said.append(f"{key} {value} (the checkpoint held {group.get(key, 'none')!r}, group {i})")
            _set(group, key, value)
    for i, (saved, want) in enumerate(zip(scheduler.base_lrs, fresh["base_lrs"])):
        if not _same(saved, want):
            said.append(f"learning rate {want:g} (the checkpoint's schedule held {saved!r}, group {i})")
    scheduler.base_lrs = list(fresh["base_lrs"])
    rates = [base * f(step) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, rate in zip(optimizer.param_groups, rates):
        _set(group, "lr", rate)
    scheduler._last_lr = [float(r) for r in rates]
    return said
