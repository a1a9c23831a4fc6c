"""CUDA graphs in training (`cuda_graphs`, decided in choices.py): the compiled loop under torch.compile's
"reduce-overhead" mode, recorded once per input size (under a static pack layout: per distinct count of the mixers'
metadata rows, `registry.size_key`), replayed.

- `before_compile`: each mixer's settings for a step under CUDA graphs (`registry.graph_setup`, e.g. FLA's tensor
  cache off), and inductor's warning limit for graphs per dynamic size raised to the run's bound
  (`choices.cuda_graph_keys`); `restore` undoes the mixers' settings;
- `step_begin`, `StepMarked`: a new cudagraph-trees step before every forward, training and eval alike;
- `kept`, `stable_grads`: the loss copied out of the graphs' memory pool, and gradients accumulated over micro-batches
  in buffers allocated outside the graphs, so the next replay does not overwrite them;
- `GraphLog`: the number of graphs recorded, logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from hybridtune.mixers import registry

logger = logging.getLogger(__name__)

MODE = "reduce-overhead"  # torch.compile's mode with CUDA graphs (cudagraph trees)


def before_compile(bound: int) -> Callable[[], None]:
    """Process-wide settings for CUDA graphs (see the module doc); returns the undo of the mixers' settings, for
    `restore`."""
    import torch._inductor.config as inductor_config  # why here: inductor loads only for a compiled run

    undo = registry.graph_setup(registry.CUDA_GRAPHS_STEP)
    limit = getattr(inductor_config.triton, "cudagraph_dynamic_shape_warn_limit", None)
    if limit is not None and limit < bound:
        inductor_config.triton.cudagraph_dynamic_shape_warn_limit = bound
    return undo


def restore(undo: Callable[[], None]) -> None:
    """Put back what `before_compile` set for the mixers (returns None, for the caller's field)."""
    undo()


def step_begin(on: bool) -> None:
    """Mark a new step for cudagraph trees before a forward (training or eval) when CUDA graphs are on."""
    if on:
        torch.compiler.cudagraph_mark_step_begin()


def kept(loss: torch.Tensor) -> torch.Tensor:
    """A detached fp32 copy of a micro-batch's loss, owned outside any graph's pool."""
    return loss.detach().float().clone()


def stable_grads(params: list[torch.nn.Parameter]) -> None:
    """Zero gradient buffers, allocated here (outside the graphs), for every trainable parameter without one: the
    backward of each micro-batch then adds into them instead of handing `.grad` a tensor of the graphs' pool."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


class StepMarked:
    """A model whose every call starts a new CUDA-graph step (for evaluation, whose loop is not the trainer's);
    everything else is the model's."""

    def __init__(self, model):
        self.model = model

    def __call__(self, *args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def recorded(device: torch.device) -> int | None:
    """CUDA graphs recorded so far on `device` (every compiled graph, every size), or None where torch does not
    say (no graph recorded yet, or its cudagraph trees changed shape)."""
    try:
        from torch._inductor import cudagraph_trees  # why here: inductor loads only for a compiled run

        manager = cudagraph_trees.get_manager(device.index or 0, create_if_none_exists=False)
        if manager is None:
            return None
        nodes = [n for roots in manager.roots.values() for n in roots]
        count = 0
        while nodes:
            node = nodes.pop()
            count += 1
            nodes += [c for children in node.children.values() for c in children]
        return count
    except Exception:  # a private structure of torch's: report nothing rather than fail a run
        return None


class GraphLog:
    """The log lines of the CUDA graphs recorded against the run's bound (`keys` distinct sizes of the mixers'
    metadata): at a logged step when the number changed since the last line, and at the end of the run."""

    def __init__(self, device: torch.device, keys: int):
        self.device, self.keys, self.said = device, keys, -1

    def changed(self) -> str | None:
        n = recorded(self.device)
        if n == self.said:
            return None
        self.said = n
        return self.line(n)

    def line(self, n: int | None) -> str:
        got = "an unknown number of" if n is None else str(n)
        sized = " x ".join(s.size_name for s in registry.MIXERS.values() if s.size is not None) or "input size"
        return (
            f"cuda graphs: {got} recorded (at most {self.keys} per compiled graph, one per distinct {sized} count: "
            "forward, backward and eval each)"
        )

    def final(self) -> str:
        return self.line(recorded(self.device))
