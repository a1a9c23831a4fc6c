"""`profile_steps`: a profile of a few training steps that does not change the run, and its interval sums."""

from __future__ import annotations

import json
import logging
import random

from hybridtune.runtime.profiling import (
    PROFILE_FILE,
    exposed_length,
    kernel_group,
    profile_window,
    summarize,
    union_length,
)
from train_runs import make_cfg, run


def _covered(intervals, length):
    on = [False] * length
    for s, e in intervals:
        for t in range(s, e):
            on[t] = True
    return on


def test_union_and_exposed_lengths_against_a_timeline():
    seed = random.randrange(2**32)  # fresh intervals each run: the sums must hold for any (seed in the message)
    rng = random.Random(seed)
    for _ in range(200):
        comm, compute = [], []
        for group in (comm, compute):
            for _ in range(rng.randrange(0, 7)):
                s = rng.randrange(0, 97)
                group.append((s, s + rng.randrange(1, 20)))
        c, k = _covered(comm, 120), _covered(compute, 120)
        assert union_length(comm + compute) == sum(a or b for a, b in zip(c, k)), (seed, comm, compute)
        assert exposed_length(comm, compute) == sum(a and not b for a, b in zip(c, k)), (seed, comm, compute)


def test_collectives_are_communication_not_reductions():
    assert kernel_group("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == (
        "communication"
    )
    assert kernel_group("ncclDevKernel_AllGather_RING_LL") == "communication"
    assert kernel_group("triton_red_fused__to_copy_logsumexp_2") == "inductor fused"
    assert kernel_group("void at::native::reduce_kernel<512, 1>") == "reduction"


class _Ev:
    """A profiler event as `summarize` reads it (FunctionEvent and FunctionEventAvg share these fields)."""

    def __init__(self, name, start, end, cuda=True, annotation=False):
        import torch

        self.name = self.key = name
        self.device_type = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        self.is_user_annotation = annotation
        self.time_range = type("R", (), {"start": start, "end": end})()
        self.self_device_time_total = (end - start) if cuda else 0
        self.self_cpu_time_total = 0 if cuda else (end - start)
        self.count = 1


class _Prof:
    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events

    def key_averages(self):
        return self._events


def test_summary_counts_kernels_not_annotations_and_finds_exposed_communication():
    """Timeline in microseconds, one step: an all-gather 0-1000 with a GEMM 200-500 and a Triton kernel 400-600
    beside it, a reduce-scatter 1500-1800 alone; FSDP's GPU-side annotation spans the whole all-gather (kineto
    reports it as a CUDA event) and must count neither as compute nor as a kernel."""
    events = [
        _Ev("ncclDevKernel_AllGather_RING_LL", 0, 1000),
        _Ev("nvjet_sm90_tst_256x128_64x4_2x1_v_bz_coopA_NNT", 200, 500),
        _Ev("triton_poi_fused_add_mul_0", 400, 600),
        _Ev("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 1500, 1800),
        _Ev("FSDP::all_gather", 0, 1000, annotation=True),
        _Ev("aten::mm", 0, 300, cuda=False),
    ]
    p = summarize(_Prof(events), 1, wall=2e-3, cuda=True)
    assert p["gpu_ms_per_step"] == 1.3  # union of kernels: 0-1000 and 1500-1800
    assert p["comm_ms_per_step"] == 1.3 and p["comm_exposed_ms_per_step"] == 0.9  # 1.3 minus the 0.4 of compute
    assert p["groups_ms_per_step"] == {"communication": 1.3, "gemm": 0.3, "inductor fused": 0.2}
    assert "FSDP::all_gather" not in [k for k, _, _ in p["kernels_ms_per_step"]]
    assert p["gpu_idle_share"] == 1 - 1.3 / 2 and p["cpu_self_ms_per_step"] == [["aten::mm", 0.3, 1]]


def test_summary_sums_grouped_gemms_by_their_full_names():
    """The routed experts' grouped GEMMs are found on the kernel's full name: the kernel table keeps 120
    characters, and CUTLASS's mangled grouped-GEMM names carry "GroupProblemShape" past that point."""
    long_name = (
        "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversalIN"
        + "S5_17GroupProblemShapeIN4cute5tupleIJiiiEEEEENS_4gemm10collective13CollectiveMmaINS_13MainloopSm90"
    )
    assert "groupproblemshape" not in long_name[:120].lower()  # what the table keeps
    events = [
        _Ev(long_name, 0, 400),
        _Ev("triton_tem_fused__grouped_mm_0", 400, 500),
        _Ev("nvjet_sm90_tst_256x128_64x4_2x1_v_bz_coopA_NNT", 500, 800),  # a dense GEMM: not grouped
    ]
    p = summarize(_Prof(events), 2, wall=2e-3, cuda=True)
    assert p["grouped_gemm_ms_per_step"] == 0.25  # (400 + 100) us over 2 steps
    assert p["groups_ms_per_step"]["gemm"] == 0.35  # CUTLASS + nvjet; the Triton template counts as inductor fused
    assert p["kernels_ms_per_step"][0][0] == long_name[:120]


def test_profile_window():
    assert profile_window(0, 100, 0) is None
    assert profile_window(3, 100, 0) == (11, 13)  # past the compile and the first shapes' recompiles
    assert profile_window(3, 8, 0) == (6, 8)  # a short run: its last steps
    assert profile_window(3, 100, 50) == (52, 54)  # resumed at 50: never this process's first step
    assert profile_window(5, 4, 0) == (2, 4)  # room for 3 of 5 (warned)
    assert profile_window(3, 1, 0) is None


def test_profiled_run_writes_its_profile_and_trains_the_same(tmp_path, small_data, caplog):
    plain = run(make_cfg(tmp_path / "plain", small_data, max_steps=5))
    with caplog.at_level(logging.INFO, logger="hybridtune"):
        profiled = run(make_cfg(tmp_path / "prof", small_data, max_steps=5, profile_steps=2))
    assert profiled.losses == plain.losses  # the profiler watches; it changes nothing
    doc = json.loads((tmp_path / "prof" / PROFILE_FILE.format(first=4, last=5)).read_text())
    assert doc["steps"] == [4, 5] and doc["world"] == 1 and len(doc["ranks"]) == 1
    p = doc["ranks"][0]
    assert p["steps"] == 2 and p["wall_ms_per_step"] > 0 and p["cpu_self_ms_total_per_step"] > 0
    assert {"aten::addmm", "aten::mm"} & {name for name, _, _ in p["cpu_self_ms_per_step"]}
    assert "gpu_ms_per_step" not in p  # CPU: no GPU fields rather than zeros
    assert any("profile of steps 4-5 (rank 0)" in r.getMessage() for r in caplog.records)
    assert not list((tmp_path / "plain").glob("profile-*.json"))


def test_an_eval_inside_the_window_ends_it_early(tmp_path, small_data, caplog):
    with caplog.at_level(logging.INFO, logger="hybridtune"):
        run(make_cfg(tmp_path / "e", small_data, max_steps=6, profile_steps=3, eval_steps=5))
    doc = json.loads((tmp_path / "e" / PROFILE_FILE.format(first=4, last=5)).read_text())
    assert doc["steps"] == [4, 5] and doc["ranks"][0]["steps"] == 2  # steps 4-6 asked; the eval after 5 ends it


def test_grouped_gemm_counts_gemm_kernels_not_the_pointwise_kernels_fused_around_them():
    """Inductor names every generated kernel after the aten ops it came from: the layout copy / cast / scale it
    emits around `aten._grouped_mm` in the experts' backward is `triton_poi_fused__grouped_mm_...` on CUDA
    (`cpp_fused__grouped_mm_...` on the CPU). Only GEMMs count into grouped_gemm_ms_per_step (expert_gemms'
    TFLOP/s): among inductor's kernels only its templates (`triton_tem_...grouped_mm...`) are GEMMs."""
    from hybridtune.runtime.profiling import grouped_gemm

    assert grouped_gemm("triton_tem_fused__grouped_mm_0")  # inductor's grouped-GEMM template: a GEMM
    assert grouped_gemm("_ZN7cutlass13device_kernelIN2at4cuda6detail...GroupProblemShapeIN4cute5tupleIJiiiEEEE")
    assert not grouped_gemm("triton_poi_fused__grouped_mm_expand_mul_transpose_0")  # a copy/scale, not a GEMM
    assert not grouped_gemm("triton_red_fused__grouped_mm_sum_1")
