"""fp32 master weights held by the optimizer, bf16 weights in the model (a full fine-tune under bf16, one process or
DDP; FSDP2 keeps its own fp32 shards with a bf16 all-gather).

`split` casts the trainable weights to bf16 once, keeping each fp32 tensor as loaded for `MasterAdamW`'s state, so the
forward and backward compute on bf16 weights with no cast per use. `MasterAdamW` runs torch's AdamW (its functional
kernel: fused on a GPU) on the fp32 masters and copies them into the bf16 weights once per step: its update is an fp32
AdamW's, rounded to bf16 only where the model reads it. In one process each micro-batch's bf16 gradient is added into
an fp32 gradient on the master as soon as it is complete (a post-accumulate hook; the bf16 one is freed), so
gradient_accumulation_steps accumulate in fp32; under DDP the bf16 gradient DDP reduced is taken at the step. The
masters are the truth: they are optimizer state (`master`), saved and restored by DCP exactly.
"""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw

from hybridtune.errors import ModelError
from hybridtune.runtime.optim_state import tensor_problem

MASTER = "master"
_HELD = "_hybridtune_master"  # a split parameter's fp32 tensor, until the optimizer takes it


def split(model: torch.nn.Module) -> int:
    """Cast every trainable fp32 weight of `model` to bf16 in place, keeping its fp32 tensor for the optimizer (the
    checkpoint's own values, not a bf16 round trip); weights the model keeps in fp32 (`_keep_in_fp32_modules`) stay.
    Returns the number of weights split."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ()) | set(
        getattr(model, "_keep_in_fp32_modules_strict", None) or ()
    )
    n = 0
    for name, p in model.named_parameters():
        if not p.requires_grad or p.dtype != torch.float32 or any(k in name.split(".") for k in keep):
            continue
        fp32 = p.data
        p.data = fp32.to(torch.bfloat16)
        setattr(p, _HELD, fp32)
        n += 1
    return n


def merged(model: torch.nn.Module, optimizer) -> None:
    """Put the fp32 masters back into the model's weights (the end of training: the export writes the truth)."""
    if isinstance(optimizer, MasterAdamW):
        for p, m in optimizer.masters():
            if p is not m:
                p.data = m.detach()


class MasterAdamW(torch.optim.Optimizer):
    """torch's AdamW over fp32 masters of (bf16) parameters; see the module doc. `accumulate`: fp32 gradients on the
    masters through post-accumulate hooks (one process); off, the parameters' own gradients are read at the step."""

    def __init__(self, params, lr: float, weight_decay: float, fused: bool = False, accumulate: bool = True):
        defaults = dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay, fused=fused)
        super().__init__(params, defaults)
        self.accumulate = accumulate
        for group in self.param_groups:
            for p in group["params"]:
                held = getattr(p, _HELD, None)
                if held is not None:
                    delattr(p, _HELD)
                elif p.dtype != torch.float32:
                    held = p.detach().float()
                on_device = dict(dtype=torch.float32, device=p.device) if fused else dict(dtype=torch.float32)
                like = p if held is None else held
                st = {"step": torch.zeros((), **on_device), "exp_avg": torch.zeros_like(like)}
                st["exp_avg_sq"] = torch.zeros_like(like)
                if held is not None:  # (a fp32 parameter is its own master)
                    st[MASTER] = held
                    if accumulate:
                        p.register_post_accumulate_grad_hook(self._accumulate)
                self.state[p] = st

    def _accumulate(self, p: torch.Tensor) -> None:
        master = self.state[p][MASTER]
        if master.grad is None:
            master.grad = p.grad.float()
        else:
            master.grad.add_(p.grad)
        p.grad = None

    def masters(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, its fp32 master) of every parameter; a fp32 parameter is its own master."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                out.append((p, self.state[p].get(MASTER, p)))
        return out

    def grad_tensors(self) -> list[torch.Tensor]:
        """What holds each parameter's gradient between backward and step (what clipping and the norm read): the
        fp32 master under `accumulate`, else the parameter itself."""
        return [m for _, m in self.masters()] if self.accumulate else [p for p, _ in self.masters()]

    def _grad(self, p: torch.Tensor, master: torch.Tensor) -> torch.Tensor | None:
        if master is not p and master.grad is not None:
            return master.grad
        return None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "MasterAdamW takes no closure"
        for group in self.param_groups:
            ps, ms, grads, avgs, sqs, steps = [], [], [], [], [], []
            for p in group["params"]:
                st = self.state[p]
                m = st.get(MASTER, p)
                g = self._grad(p, m)
                if g is None:
                    continue
                ps.append(p), ms.append(m), grads.append(g)
                avgs.append(st["exp_avg"]), sqs.append(st["exp_avg_sq"]), steps.append(st["step"])
            if not ms:
                continue
            beta1, beta2 = group["betas"]
            fused = group["fused"] or None
            adamw(
                ms, grads, avgs, sqs, [], steps, fused=fused, amsgrad=False, beta1=beta1, beta2=beta2,
                lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
            )  # fmt: skip
            low = [(p, m) for p, m in zip(ps, ms) if p is not m]
            if low:  # once per step: the fp32 update rounded into the weights the model computes with
                torch._foreach_copy_([p for p, _ in low], [m for _, m in low])

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for p, m in self.masters():
            if m is not p:
                m.grad = None

    def load_state_dict(self, state_dict: dict) -> None:
        """The saved state copied into this optimizer's own tensors, dtype kept (torch's casts state to the
        parameter's dtype: bf16 here, which would round the masters and moments)."""
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        if len(ids) != len(params):
            raise ValueError(f"the saved optimizer state has {len(ids)} parameters, this one {len(params)}")
        for k, (p, i) in enumerate(zip(params, ids)):
            saved = state_dict["state"].get(i, {})
            for key, mine in self.state[p].items():
                _check_saved(saved.get(key), mine, key, k)
        for p, i in zip(params, ids):
            saved = state_dict["state"].get(i, {})
            for key, mine in self.state[p].items():
                mine.copy_(saved[key].to(mine.device))
        for g, saved in zip(self.param_groups, state_dict["param_groups"]):
            g.update({k: v for k, v in saved.items() if k != "params"})
        for p, m in self.masters():  # the weights the model computes with, from the restored masters
            if m is not p:
                p.data.copy_(m)


def _check_saved(saved, mine: torch.Tensor, key: str, k: int) -> None:
    """A saved state tensor must be there, of this optimizer's shape (never broadcast), a float, and finite: else a
    resume would go on silently from the wrong weights (a missing master kept this run's initial weights) or NaN."""
    where = f"the checkpoint's optimizer state of parameter {k}"
    fix = "resume from a checkpoint a run with the same optim and bf16 wrote, or start the run again"
    if not isinstance(saved, torch.Tensor):
        raise ModelError(f"{where} has no '{key}' (a run with another optim or precision wrote it?); {fix}")
    if saved.shape != mine.shape or not (saved.is_floating_point() or key == "step"):
        raise ModelError(
            f"{where}: '{key}' is {saved.dtype} {tuple(saved.shape)}, this optimizer's {mine.dtype} "
            f"{tuple(mine.shape)}; {fix}"
        )
    if why := tensor_problem(key, saved):  # NaN, Inf, a negative second moment, a step that is no count
        raise ModelError(f"{where}: {why}; {fix}")
