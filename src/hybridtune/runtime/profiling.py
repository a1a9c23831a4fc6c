"""Where a step's time goes: torch.profiler over a few steps, summarised by kernel group.

Shared by `hybridtune bench --profile` and `hybridtune train` (`profile_steps`). The summary is per step:
wall time, GPU busy time (the union of kernel intervals, so kernels on two streams are not counted twice),
GPU time by kernel group and by kernel, host time by op, and, where collectives ran (DDP, FSDP2), the
communication's time and the part of it no compute kernel overlapped ("exposed"): the part a faster
overlap could win back.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from pathlib import Path

import torch

from hybridtune.files import atomic_write_text
from hybridtune.mixers import registry
from hybridtune.runtime import distributed

logger = logging.getLogger(__name__)

PROFILE_FILE = "profile-{first}-{last}.json"

# First match wins: NCCL's kernels are named for their collective ("ReduceScatter"), so they come first; the
# registered mixers' own kernels (`MixerSpec.profile_patterns`, `kernel_groups`) after attention, before inductor's.
KERNEL_GROUPS_BEFORE_MIXERS = (
    ("communication", ("nccl",)),
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "sm90_", "cublas")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
)
KERNEL_GROUPS_AFTER_MIXERS = (
    ("inductor fused", ("triton_",)),
    ("optimizer", ("adam", "multi_tensor")),
    ("reduction", ("reduce", "logsumexp", "norm")),
    ("copy / cast", ("copy", "cast", "to_copy")),
    ("elementwise (eager)", ("elementwise", "vectorized", "unrolled")),
)
COMM = KERNEL_GROUPS_BEFORE_MIXERS[0][0]


@functools.cache
def kernel_groups() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(group, kernel-name substrings), first match wins; the registered mixers' as they are now (cleared with
    `kernel_group`'s cache when one is registered: `registry.on_change`)."""
    return (*KERNEL_GROUPS_BEFORE_MIXERS, *registry.profile_groups(), *KERNEL_GROUPS_AFTER_MIXERS)


# torch's grouped GEMMs (the routed experts' kernels: CUTLASS's GroupProblemShape, Triton's grouped_mm templates),
# matched on the full kernel name: the kernel table keeps 120 characters, which cut "GroupProblemShape" short.
GROUPED_GEMM_KEYS = ("grouped", "groupproblem", "group_gemm")
# inductor names its generated kernels after the aten ops they came from: the copies and scalings it fuses around
# `_grouped_mm` are "triton_poi_fused__grouped_mm_..." (pointwise) or "..._red_"/"..._per_" (reductions), and on
# the CPU "cpp_fused_..."; only its templates ("triton_tem_") are GEMMs.
NOT_GEMM_PREFIXES = ("triton_poi_", "triton_red_", "triton_per_", "cpp_fused")


def grouped_gemm(name: str) -> bool:
    low = name.lower()
    return not low.startswith(NOT_GEMM_PREFIXES) and any(k in low for k in GROUPED_GEMM_KEYS)


@functools.lru_cache(maxsize=4096)
def kernel_group(name: str) -> str:
    low = name.lower()
    for group, keys in kernel_groups():
        if any(k in low for k in keys):
            return group
    return "other"


registry.on_change(kernel_groups.cache_clear)
registry.on_change(kernel_group.cache_clear)


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by `intervals` ([start, end) pairs), overlaps counted once.

    >>> union_length([(0, 4), (2, 6), (8, 9)])
    7
    """
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def exposed_length(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """The time some `comm` interval runs while no `compute` interval does.

    >>> exposed_length([(0, 10)], [(2, 5), (4, 6)])
    6
    """
    return union_length(comm + compute) - union_length(compute)


class StepProfiler:
    """torch.profiler between `start()` and `stop(n)`, over `n` steps run in between; `stop` returns the
    per-step summary (see the module doc). Without CUDA the GPU fields are absent."""

    def __init__(self, device: torch.device | None = None):
        self.cuda = torch.cuda.is_available() and (device is None or device.type == "cuda")
        self.prof = None
        self.t0 = 0.0

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        if self.cuda:
            torch.cuda.synchronize()
        self.prof = profile(activities=activities)
        self.prof.start()
        self.t0 = time.perf_counter()

    def stop(self, n: int) -> dict:
        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.t0
        self.prof.stop()
        return summarize(self.prof, n, wall, self.cuda)

    def cancel(self) -> None:
        """Stop recording without a summary (an interrupted or failed window)."""
        try:
            self.prof.stop()
        except Exception:  # already stopped, or torch's profiler in a bad state: nothing to keep either way
            pass


def profile_run(run_step, n: int, device: torch.device | None = None) -> dict:
    """Run `run_step(i)` for i in range(n) under torch.profiler; the per-step summary."""
    p = StepProfiler(device)
    p.start()
    for i in range(n):
        run_step(i)
    return p.stop(n)


def _kernel(e) -> bool:
    """A GPU kernel (or memcpy/memset), not a GPU-side user annotation: kineto reports `record_function` ranges
    (FSDP's "FSDP::all_gather", "Optimizer.step#AdamW.step") on the GPU timeline too, spanning the kernels
    they launch; counted as kernels they would count time twice and hide the collectives under "compute"."""
    return e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)


def _top(rows, n: int) -> tuple[list, float]:
    """[name, ms per step, calls per step] rows, largest first: the first `n`, and the total ms of all."""
    rows = sorted(rows, key=lambda x: -x[1])
    return [[k[:120], round(ms, 3), c] for k, ms, c in rows[:n]], sum(ms for _, ms, _ in rows)


def summarize(prof, n: int, wall: float, cuda: bool) -> dict:
    """The per-step summary of `n` steps that took `wall` seconds under the (stopped) profiler `prof`."""
    avgs = prof.key_averages()
    cpu_rows = [
        (e.key, e.self_cpu_time_total / 1e3 / n, e.count // n)
        for e in avgs
        if e.device_type == torch.autograd.DeviceType.CPU and e.self_cpu_time_total > 0
    ]
    cpu_top, cpu_total = _top(cpu_rows, 30)
    out = {
        "steps": n,
        "wall_ms_per_step": wall * 1e3 / n,
        "cpu_self_ms_per_step": cpu_top,
        "cpu_self_ms_total_per_step": cpu_total,
    }
    if not cuda:
        return out
    kernel_rows = [
        (e.key, e.self_device_time_total / 1e3 / n, e.count // n)
        for e in avgs
        if _kernel(e) and e.self_device_time_total > 0
    ]
    groups: dict[str, float] = {}
    for name, ms, _ in kernel_rows:
        groups[kernel_group(name)] = groups.get(kernel_group(name), 0.0) + ms
    comm, compute = [], []
    for e in prof.events():
        if _kernel(e) and e.time_range.end > e.time_range.start:
            (comm if kernel_group(e.name) == COMM else compute).append((e.time_range.start, e.time_range.end))
    busy = union_length(comm + compute) / 1e3 / n  # profiler times are in microseconds
    out.update(
        gpu_ms_per_step=busy,
        gpu_idle_share=max(0.0, 1 - busy / (wall * 1e3 / n)),
        groups_ms_per_step=dict(sorted(groups.items(), key=lambda kv: -kv[1])),
        kernels_ms_per_step=_top(kernel_rows, 60)[0],
        grouped_gemm_ms_per_step=sum(ms for name, ms, _ in kernel_rows if grouped_gemm(name)),
    )
    if comm:
        out.update(
            comm_ms_per_step=union_length(comm) / 1e3 / n,
            comm_exposed_ms_per_step=exposed_length(comm, compute) / 1e3 / n,
        )
    return out


def summary_line(p: dict) -> str:
    """One log line for a `profile_steps` result."""
    text = f"{p['wall_ms_per_step']:.1f} ms/step wall, host ops {p['cpu_self_ms_total_per_step']:.1f} ms"
    if "gpu_ms_per_step" in p:
        top = ", ".join(f"{g} {ms:.1f}" for g, ms in list(p["groups_ms_per_step"].items())[:5])
        text += f"; GPU busy {p['gpu_ms_per_step']:.1f} ms ({top})"
    if "comm_ms_per_step" in p:
        text += f"; communication {p['comm_ms_per_step']:.1f} ms, {p['comm_exposed_ms_per_step']:.1f} ms not overlapped"
    return text


def profile_window(n: int, total_steps: int, done: int) -> tuple[int, int] | None:
    """The steps `profile_steps: n` profiles, first and last: from step 11 (past compilation and the first
    shapes' recompiles), or the last n of a shorter run, never this process's first step (`done` steps were
    done before it: a resumed run); None when n is 0. A run too short for all n profiles fewer, with a warning.

    >>> profile_window(3, 100, 0), profile_window(3, 8, 0), profile_window(3, 100, 50), profile_window(3, 1, 0)
    ((11, 13), (6, 8), (52, 54), None)
    """
    if n <= 0:
        return None
    first = max(done + 2, min(11, total_steps - n + 1))
    last = min(first + n - 1, total_steps)
    if last - first + 1 < n:
        if first > last:
            logger.warning(
                "profile_steps %d: no step to profile (%d steps, the first compiles); skipped", n, total_steps
            )
            return None
        logger.warning("profile_steps %d: the run has room for %d (steps %d-%d)", n, last - first + 1, first, last)
    return first, last


def write_profile(profiler: StepProfiler, first: int, last: int, out: Path, d: distributed.Dist) -> None:
    """Every rank's profile of steps first..last into profile-<first>-<last>.json (rank 0 writes; a resumed
    run's profile does not replace an earlier one); rank 0's summary in the log. A rank whose summary
    failed sends its error instead, so no rank waits in the gather for it; profiling never ends the run."""
    try:
        summary = profiler.stop(last - first + 1)
    except Exception as e:
        summary = {"error": f"{type(e).__name__}: {e}"}
    ranks = distributed.gather_objects(summary, d)
    if not d.is_main:
        return
    path = out / PROFILE_FILE.format(first=first, last=last)
    doc = {"steps": [first, last], "world": d.world, "ranks": ranks}
    atomic_write_text(path, json.dumps(doc, indent=2))
    failed = [f"rank {r}: {p['error']}" for r, p in enumerate(ranks) if "error" in p]
    if failed:
        logger.warning("profile of steps %d-%d failed on %s; %s", first, last, "; ".join(failed), path)
    else:
        logger.info("profile of steps %d-%d (rank 0): %s; all ranks in %s", first, last, summary_line(summary), path)


class ProfileWindow:
    """The steps a run profiles (`profile_steps`, see `profile_window`): the profiler starts before the first and is
    written after the last, or earlier rather than profile an evaluation, a checkpoint or a stop (the same step on
    every rank)."""

    def __init__(self, n: int, total_steps: int, done: int, device: torch.device, out: Path, d: distributed.Dist):
        self.window = profile_window(n, total_steps, done)
        self.device, self.out, self.d = device, out, d
        self.profiler: StepProfiler | None = None

    def before(self, step: int) -> None:
        if self.window and step == self.window[0]:
            self.profiler = StepProfiler(self.device)
            self.profiler.start()

    def after(self, step: int, cut: bool) -> float:
        """Write the window's profile when `step` ends it (or `cut` does); returns the seconds that took."""
        if self.profiler is None or not (step == self.window[1] or cut):
            return 0.0
        t = time.perf_counter()
        write_profile(self.profiler, self.window[0], step, self.out, self.d)
        self.profiler = None
        return time.perf_counter() - t

    def cancel(self) -> None:
        if self.profiler is not None:
            self.profiler.cancel()
            self.profiler = None
