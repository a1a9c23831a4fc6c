"""A resumed optimizer's state, checked before it trains: every state tensor of its parameter's shape and finite, a
second moment never negative (its square root is the update's divisor), `step` a whole count no greater than its
checkpoint's step (a checkpoint saved before the first step: `drop_fake_step`). A tampered or damaged state otherwise
trained on: NaN weights blamed on the learning rate, or a traceback from the square root of a negative number. For
every optim: torch's AdamW, `MasterAdamW` (masters.py, which checks its own load with `tensor_problem` too) and
torchao's; torchao's 8-bit state (a code table times a scale per block) is read through its scales and table, never
dequantised. Each finding is a phrase for the caller's one line.
"""

from __future__ import annotations

import math

import torch

from hybridtune.runtime.distributed import ONE, Dist, gather_objects

STEP = "step"
SECOND_MOMENTS = frozenset({"exp_avg_sq", "max_exp_avg_sq"})
FIX = (
    "its files were changed after the save or are damaged: resume from a checkpoint you trust, or start the run again "
    "with --overwrite"
)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP2's DTensor: this rank's shard


def extremes(t: torch.Tensor) -> torch.Tensor | None:
    """The smallest and largest value `t` holds, as two float32 numbers on its device, from one pass over it (no copy
    of it); None when it holds none. A quantised state (torchao's: `codes` into a table `qmap`, times a `scale` per
    block): the extremes of its scales and table, whose products are its values (finite when both are, never negative
    when neither is)."""
    t = _local(t).detach()
    if hasattr(t, "codes") and hasattr(t, "scale"):
        parts = [t.scale] + [x for x in (getattr(t, "qmap", None),) if x is not None]
        parts += [t.codes] if t.codes.is_floating_point() else []
    else:
        parts = [t]
    pairs = [torch.stack(torch.aminmax(p)).float() for p in parts if p.numel()]
    if not pairs:
        return None
    both = torch.stack(pairs)
    return torch.stack([both[:, 0].min(), both[:, 1].max()])


def value_problem(key: str, lo: float, hi: float) -> str | None:
    """What is wrong with a state tensor `key` whose values lie in [lo, hi], or None."""
    if math.isnan(lo) or math.isnan(hi):
        return f"'{key}' holds NaN"
    if math.isinf(lo) or math.isinf(hi):
        return f"'{key}' holds Inf"
    if key in SECOND_MOMENTS and lo < 0:
        return f"'{key}' holds a negative value ({lo:g}), which a second moment never is"
    if key == STEP and (lo < 0 or lo != int(lo)):
        return f"'{key}' is {lo:g}, not a count of steps"
    return None


def tensor_problem(key: str, t: torch.Tensor) -> str | None:
    """`value_problem` of one state tensor (one wait for its device)."""
    pair = extremes(t)
    return None if pair is None else value_problem(key, *pair.tolist())


def _form_problem(key: str, t, param) -> str | None:
    if not isinstance(t, torch.Tensor):
        return f"'{key}' is a {type(t).__name__}, not a tensor"
    if key == STEP:
        return None if t.numel() == 1 else f"'{key}' has shape {tuple(t.shape)}, not one number"
    if param is not None and tuple(t.shape) != tuple(param.shape):
        return f"'{key}' has shape {tuple(t.shape)} where the parameter's is {tuple(param.shape)}"
    if not hasattr(_local(t), "codes") and not t.is_floating_point():
        return f"'{key}' is {t.dtype}, not a float"
    return None


def drop_fake_step(osd: dict, step: int, unstepped: bool) -> None:
    """A checkpoint saved before the first step (Ctrl-C in it: `step` 0) of an optimizer that makes its state at its
    first step (torch's and torchao's AdamW; `unstepped`: it held none before the load's `get_state_dict`) holds the
    state torch's `get_state_dict` made for it by a step at lr 0 with zero gradients: every `step` 1, the moments 0.
    Kept, the optimizer's count ran one ahead of the trainer's (Adam's bias correction with it) and the next
    checkpoint was refused ('step' 2 at step 1). Dropped from the loaded `osd`: the optimizer starts as one never
    stepped, as the interrupted run's did. (MasterAdamW makes its state when built: no fake step, its `step` is 0.)"""
    if unstepped and step == 0:
        osd["state"] = {}


def state_problem(osd: dict, params: dict, step: int | None, d: Dist = ONE) -> str | None:
    """Why the optimizer state `osd` (torch's `get_state_dict` form, as a checkpoint loaded it: by parameter name)
    must not train the parameters `params` (the model state dict beside it) on from step `step`, or None.

    Every tensor is read once, with one wait per device. A parameter's `step` counts the steps it had a gradient in:
    never more than the checkpoint's, and the largest is the checkpoint's (a part without a gradient in some steps,
    say a vision tower under text rows, lags). Under torchrun each rank checks its shard and every rank returns the
    first rank's finding (a collective)."""
    found, entries = None, []
    for name, held in (osd.get("state") or {}).items():
        for key, t in held.items():
            if why := _form_problem(key, t, params.get(name)):
                found = f"parameter '{name}': {why}"
                break
            if (pair := extremes(t)) is not None:
                entries.append((name, key, pair))
        if found:
            break
    if found is None:
        found = _values_problem(entries, step)
    if d.enabled:
        found = next((f for f in gather_objects(found, d) if f), None)
    return None if found is None else f"its optimizer state of {found}; {FIX}"


def _values_problem(entries: list, step: int | None) -> str | None:
    by_device: dict = {}
    for i, (_, _, pair) in enumerate(entries):
        by_device.setdefault(pair.device, []).append(i)
    values: list = [None] * len(entries)
    for idx in by_device.values():
        for i, v in zip(idx, torch.stack([entries[i][2] for i in idx]).tolist()):  # one wait per device
            values[i] = v
    largest = None
    for (name, key, _), (lo, hi) in zip(entries, values):
        if why := value_problem(key, lo, hi):
            return f"parameter '{name}': {why}"
        if key == STEP and step is not None:
            if hi > step:
                return f"parameter '{name}': 'step' is {hi:g} but the checkpoint is at step {step}"
            largest = hi if largest is None else max(largest, hi)
    if largest is not None and step and largest != step:
        return f"every parameter: 'step' is at most {largest:g} but the checkpoint is at step {step}"
    return None
