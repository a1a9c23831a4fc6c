"""The composition root of a training step, shared by `hybridtune train` (train/trainer.py) and `hybridtune bench`'s
hybridtune modes (bench/worker.py): one place that turns a run's config and resolved choices into the objects that
train.

`compose`: after the model is built (runtime/model.py) and the choices resolved (runtime/choices.py), the
checkpointing the memory estimate asked for, CUDA graphs' process settings (runtime/cudagraphs.py), the compile with
`compile_options` (a full fine-tune's frozen dpo reference compiled beside it: `compile_reference`), and the engine
(`distributed.LossModule` over the model and the objective, DDP/FSDP2-wrapped under torchrun). `backward` runs one
optimizer step's micro-batches (each `[1, T]` packed, on the device) forward and backward; `clip` clips the
gradients to `max_grad_norm` and returns their global norm (a 0-d tensor). `optimization`: the optimizer (fp32
masters where the model's weights were split for them), what holds its gradients and the learning-rate schedule,
the one builder of train's and the bench's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from hybridtune.compiler.strategies import compile_model
from hybridtune.config import TrainConfig, compile_overrides
from hybridtune.runtime import cudagraphs, distributed, engines
from hybridtune.runtime.choices import cuda_graph_keys
from hybridtune.runtime.facts import Choices
from hybridtune.runtime.model import RunModel, enable_checkpointing
from hybridtune.runtime.objective import Objective
from hybridtune.runtime.optim import build_optimizer, build_scheduler, grad_tensors


def compile_options(cfg: TrainConfig, choices: Choices) -> tuple[str, dict]:
    """(strategy, the keyword arguments `compile_model` gets) for these choices."""
    strategy, opts = choices.compile.value, {}
    if strategy == "modules" and cfg.compile_overrides:
        opts["overrides"] = compile_overrides(cfg)
    if strategy == "loop":
        opts["static_shapes"] = choices.pack_layout.value is not None
        opts["regional"] = choices.compile_regions.value
        opts["keep_cores"] = choices.keep_mixer_cores.value
    if choices.cuda_graphs.value:
        opts["mode"] = cudagraphs.MODE
    return strategy, opts


def compile_reference(objective: Objective, strategy: str, opts: dict, backend: str | None = None):
    """A full fine-tune's frozen reference model (dpo's copy of the starting model: other weights, no gradients)
    compiled as the policy is, without CUDA graphs (its log-probabilities are summed at once): one graph more than
    the policy's, instead of an eager forward every step. Returns the handle, None without such a reference."""
    reference = getattr(objective, "reference", None)
    if strategy == "off" or not isinstance(reference, torch.nn.Module):
        return None
    kept = {k: v for k, v in opts.items() if k != "mode"}
    return compile_model(reference, strategy, **kept, **({"backend": backend} if backend else {}))


@dataclass
class Composed:
    """What trains: the model (peft-wrapped under LoRA), the engine that computes the objective's loss, how it was
    compiled, and the CUDA-graph state (`conv_before`: the undo of `cudagraphs.before_compile`'s settings)."""

    run: RunModel
    engine: torch.nn.Module
    eval_model: object
    device: torch.device
    bf16: bool
    strategy: str = "off"
    compile_options: dict = field(default_factory=dict)
    compile_handle: object = None
    cuda_graphs: bool = False
    graph_log: cudagraphs.GraphLog | None = None
    conv_before: str | None = None

    @property
    def model(self) -> torch.nn.Module:
        return self.run.model

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.engine.parameters() if p.requires_grad]


def compose(
    run: RunModel,
    cfg: TrainConfig,
    choices: Choices,
    objective: Objective,
    device: torch.device,
    dist: distributed.Dist = distributed.ONE,
    packs=(),
    backend: str | None = None,
) -> Composed:
    """Checkpointing (under `gradient_checkpointing: auto`, as chosen), CUDA graphs, the compile and the engine, in
    that order (the graph must see the checkpointing; see the module doc). `packs`: the document lengths of every
    pack the run collates (the CUDA graphs' bound); `backend`: torch.compile's (None: inductor)."""
    if cfg.gradient_checkpointing == "auto" and choices.checkpointing.value:
        enable_checkpointing(run.model)  # the memory estimate said so (choices.choose_checkpointing)
    strategy, opts = compile_options(cfg, choices)
    c = Composed(run, None, None, device, choices.bf16.value, strategy, opts)
    if choices.cuda_graphs.value:
        keys = len(cuda_graph_keys(choices.pack_layout.value, packs))
        c.cuda_graphs, c.graph_log = True, cudagraphs.GraphLog(device, keys)
        c.conv_before = cudagraphs.before_compile(keys)
    try:
        if strategy != "off":
            c.compile_handle = compile_model(run.model, strategy, **opts, **({"backend": backend} if backend else {}))
            compile_reference(objective, strategy, opts, backend)
        c.engine = engines.wrap(distributed.LossModule(run.model, objective), dist, device, c.bf16, run.loaded)
    except BaseException:
        if c.conv_before is not None:  # a failed setup leaves the process as it found it
            cudagraphs.restore(c.conv_before)
        raise
    eval_model = c.engine.module if dist.engine == "ddp" else c.engine
    c.eval_model = cudagraphs.StepMarked(eval_model) if c.cuda_graphs else eval_model
    return c


@dataclass
class Optimization:
    """What steps the weights: the optimizer, `params` (what holds the gradients the step reads: clipping, the norm,
    the health checks; `MasterAdamW`'s fp32 masters in one process) and the learning-rate schedule."""

    optimizer: torch.optim.Optimizer
    params: list
    scheduler: torch.optim.lr_scheduler.LRScheduler

    def step(self) -> None:
        """The update, the schedule's next rate, the gradients freed (train's order)."""
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)


def optimization(
    c: Composed, cfg: TrainConfig, total_steps: int, dist: distributed.Dist = distributed.ONE
) -> Optimization:
    """The optimizer over what `c` trains (fp32 masters where its model's weights were split for them:
    `RunModel.masters`), what holds its gradients, and the schedule over `total_steps`: `hybridtune train`'s and
    `hybridtune bench`'s, so that the bench steps what train steps."""
    trainable = c.trainable()
    optimizer = build_optimizer(trainable, cfg, c.device, c.bf16, dist, masters=c.run.masters)
    return Optimization(optimizer, grad_tensors(optimizer, trainable), build_scheduler(optimizer, cfg, total_steps))


def backward(
    c: Composed, batches: list[dict], n_tokens: int, params: list, dist: distributed.Dist = distributed.ONE
) -> list[torch.Tensor]:
    """Forward and backward of this rank's micro-batches of one optimizer step (on the device); `n_tokens`: the
    trained tokens of the whole window. Returns each micro-batch's loss, a copy outside any CUDA graph's pool."""
    losses = []
    if c.cuda_graphs and len(batches) > 1:
        cudagraphs.stable_grads(params)  # accumulated outside the graphs' pool
    for i, b in enumerate(batches):
        with engines.accumulation(c.engine, dist, last=i == len(batches) - 1):
            cudagraphs.step_begin(c.cuda_graphs)
            with c.autocast():
                loss = c.engine(b, n_tokens)
            # DDP and FSDP2 average over ranks; times N, that average is the sum the window's loss needs.
            (loss * dist.world if dist.enabled else loss).backward()
        losses.append(cudagraphs.kept(loss))  # (a copy: nothing a later replay may overwrite)
    return losses


def clip(params: list, max_grad_norm: float) -> torch.Tensor:
    """The gradients' global norm (over ranks), clipped to `max_grad_norm` when it is above 0."""
    norm = distributed.total_grad_norm(params)
    if max_grad_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norm)
    return norm
