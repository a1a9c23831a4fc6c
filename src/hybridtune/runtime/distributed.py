"""Multi-process training through PyTorch's own engine: torchrun starts the ranks, DDP or FSDP2 wraps the model.

`torch.distributed` moves every tensor; this module joins the process group (`init`: nccl on CUDA, gloo on the CPU),
says where this process stands (`Dist`), shares the work out and holds the collectives. One process: no process group,
nothing wrapped beyond `LossModule`, the unit DDP or FSDP2 wraps (runtime/engines.py: `distributed: ddp`, LoRA's
default, or `fsdp`, a full fine-tune's, on the units `fsdp_units` names).

Each rank's loss is multiplied by the world size, so the averaged gradient is that of the global loss (the sum over
the window's trained tokens / their count). A rank runs micro-batches `rank, rank + N, ...` of the window and eval
packs likewise (`eval_share`), so the global batch and the schedule do not depend on N; eval sums are all-reduced,
and the memory a step logs is the peak over ranks (`all_max`).
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import sys
from dataclasses import dataclass

import torch

from hybridtune.errors import ConfigError, UserError
from hybridtune.runtime.adapter_kind import AdapterKind
from hybridtune.runtime.objective import Objective
from hybridtune.runtime.step import model_inputs

logger = logging.getLogger(__name__)

# NVLink SHARP (NVLS) multicast hangs or fails on machines whose fabric manager does not grant it; the
# plain NVLink ring / tree paths lose little for data parallelism. Set unless the user set them.
GPU_ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TIMEOUT_ENV = "HYBRIDTUNE_DIST_TIMEOUT_S"
# A collective that waits longer than this ends the run (a stuck rank, not a slow step). The first
# collectives wait for every rank's model load, so this also bounds how unequal those may be.
DEFAULT_TIMEOUT_S = 600
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class Dist:
    """Where this process stands: rank, world size, local rank (GPU index on its host)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    engine: str = "none"  # "none" (one process), "ddp" or "fsdp"
    units: str = "layer"  # FSDP2's units: "layer" (each decoder layer), "group:K" (K layers) or "model" (all as one)

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


ONE = Dist()  # a single process


def from_env() -> Dist:
    """The ranks torchrun announced in the environment (RANK, WORLD_SIZE, LOCAL_RANK); one process without them."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return ONE
    return Dist(rank=int(os.environ["RANK"]), world=world, local_rank=int(os.environ.get("LOCAL_RANK", "0")))


def timeout() -> datetime.timedelta:
    raw = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        return datetime.timedelta(seconds=float(raw))
    except ValueError:
        raise ConfigError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None


def choose_engine(setting: str, kind: AdapterKind) -> str:
    """`distributed: auto` is the adapter kind's engine: DDP for LoRA (small gradients, whole model fits) and FSDP2
    for a full fine-tune."""
    if setting != "auto":
        return setting
    return kind.default_engine


def init(setting: str, kind: AdapterKind, device_kind: str) -> Dist:
    """Join the process group torchrun set up (nccl on CUDA, gloo on CPU); a no-op in one process.

    Must run before anything touches the GPU: on CUDA it selects device `cuda:LOCAL_RANK`.
    """
    d = from_env()
    if not d.enabled:
        return d
    d = Dist(d.rank, d.world, d.local_rank, choose_engine(setting, kind))
    _end_with_launcher()
    if torch.distributed.is_initialized():
        return d
    cuda = device_kind == "cuda" or (device_kind == "auto" and torch.cuda.is_available())
    kw: dict = {"timeout": timeout()}
    if cuda:
        for k, v in GPU_ENV_DEFAULTS.items():
            os.environ.setdefault(k, v)  # read by NCCL when the communicator is created, below
        if d.local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"rank {d.rank} has LOCAL_RANK {d.local_rank} but only {torch.cuda.device_count()} GPU(s) are "
                "visible; use --nproc-per-node <= the GPU count"
            )
        torch.cuda.set_device(d.local_rank)
        kw.update(backend="nccl", device_id=torch.device("cuda", d.local_rank))
    else:
        kw.update(backend="gloo")
    torch.distributed.init_process_group(**kw)
    if not d.is_main:
        # One voice: rank 0 logs (its warnings are the same on every rank); the others speak only to fail.
        logging.getLogger("hybridtune").setLevel(logging.ERROR)
    machines = d.world // int(os.environ.get("LOCAL_WORLD_SIZE", d.world))
    logger.info(
        "distributed: %d processes%s (%s, %s), engine %s",
        d.world,
        f" on {machines} machines" if machines > 1 else "",
        kw["backend"],
        "cuda" if cuda else "cpu",
        d.engine,
    )
    return d


def _end_with_launcher() -> None:
    """A rank is stopped (SIGTERM: it saves and exits, see runtime/signals.py) when the torchrun launcher that started
    it dies, even by SIGKILL; otherwise the ranks live on as orphans that keep writing into the output directory.
    Linux only (prctl PR_SET_PDEATHSIG); elsewhere the ranks rely on torchrun's own stop."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl")
    except (OSError, AttributeError) as e:
        logger.warning("ranks will not stop with their launcher on this system (prctl: %s)", e)
        return
    if os.getppid() != parent:  # the launcher died before the line above: nothing would send the signal now
        os.kill(os.getpid(), signal.SIGTERM)


def shutdown(d: Dist) -> None:
    if d.enabled and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def check_window(d: Dist, gradient_accumulation_steps: int) -> None:
    if gradient_accumulation_steps % d.world:
        raise ConfigError(
            f"config key 'gradient_accumulation_steps' = {gradient_accumulation_steps} is not a multiple of the "
            f"{d.world} processes: the micro-batches of an optimizer step are split evenly over the ranks, so the "
            f"global batch stays what the config says; use a multiple of {d.world} (e.g. "
            f"{gradient_accumulation_steps + (-gradient_accumulation_steps) % d.world})"
        )


def my_share(d: Dist, items: list) -> list:
    """This rank's micro-batches of a window: items rank, rank + N, ..."""
    return items[d.rank :: d.world]


def eval_share(n: int, d: Dist) -> list[tuple[int, bool]]:
    """This rank's packs of an `n`-pack evaluation, as `(index, counted)`: indices rank, rank + N, ...

    The shares are disjoint and cover every pack once. Under FSDP2 the forward is a collective (each
    layer's parameters are all-gathered), so every rank must run the same number of forwards, ceil(n / N):
    a rank short of one runs a pack again (its first, or pack 0) with `counted` False, i.e. weight 0.
    DDP evaluates the unwrapped module (no collective in its forward), so short ranks just stop.

    >>> eval_share(3, Dist(rank=1, world=2, engine="fsdp"))
    [(1, True), (1, False)]
    """
    mine = [(i, True) for i in range(d.rank, n, d.world)]
    if d.engine == "fsdp" and n:
        mine += [(mine[0][0] if mine else 0, False)] * (-(-n // d.world) - len(mine))
    return mine


class LossModule(torch.nn.Module):
    """The unit DDP / FSDP2 wrap: its forward is the objective's micro-batch loss (or the logits for eval).

    An objective may bypass the model's own forward (the fused loss calls the decoder stack and reads
    `lm_head.weight` itself); wrapping this module instead makes every engine see the real computation.
    `objective` may be None where the module only carries weights (loading a checkpoint, evaluation).
    """

    def __init__(self, model: torch.nn.Module, objective: Objective | None = None):
        super().__init__()
        self.model = model
        self.objective = objective

    def forward(self, batch: dict, num_items: int | None = None):
        if num_items is None:  # eval: the logits [1, T, vocab]
            return self.model(**model_inputs(batch, labels=False, model=self.model)).logits
        if self.objective is None:
            raise RuntimeError("LossModule built without an objective was asked for a loss")
        return self.objective.loss(self.model, batch, num_items)


def all_sum(values: list[float], d: Dist) -> list[float]:
    """Sum of `values` over ranks (float64), element-wise; the values themselves in one process."""
    if not d.enabled:
        return values
    return all_sum_(torch.tensor(values, dtype=torch.float64, device=_comm_device()), d).tolist()


def all_sum_(t: torch.Tensor, d: Dist) -> torch.Tensor:
    """`t` (on the training device, which is the collective's: CUDA under nccl, CPU under gloo) summed over
    ranks in place, without a host wait; `t` itself in one process."""
    if d.enabled:
        torch.distributed.all_reduce(t)
    return t


def all_max(value: float, d: Dist) -> float:
    """The largest `value` over ranks (one all-reduce of a scalar); `value` itself in one process."""
    if not d.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_comm_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def _comm_device() -> torch.device:
    backend = torch.distributed.get_backend()
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def total_grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """L2 norm of all gradients, over every rank's shard (FSDP2 gradients are DTensors)."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    full = getattr(norm, "full_tensor", None)
    return full() if callable(full) else norm


def broadcast_object(obj, d: Dist):
    """Rank 0's `obj` on every rank."""
    if not d.enabled:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj, d: Dist) -> list:
    """Every rank's `obj`, in rank order, on every rank; `[obj]` in one process."""
    if not d.enabled:
        return [obj]
    box = [None] * d.world
    torch.distributed.all_gather_object(box, obj)
    return box


def barrier(d: Dist) -> None:
    if d.enabled:
        torch.distributed.barrier()


def main_only(d: Dist, fn):
    """`fn()` on rank 0; its result, or its exception, on every rank.

    Without this, rank 0 would exit with (say) an output_dir error while the others wait at the next
    collective; now every rank raises the same error and the run ends with one message.
    """
    if not d.enabled:
        return fn()
    result, error, sent = None, None, None
    if d.is_main:
        try:
            result = fn()
        except Exception as e:  # re-raised below, on every rank
            error = e
            sent = e if isinstance(e, UserError) else RuntimeError(f"rank 0: {type(e).__name__}: {e}")
    result, sent = broadcast_object((result, sent), d)
    if error is not None:
        raise error
    if sent is not None:
        raise sent
    return result
