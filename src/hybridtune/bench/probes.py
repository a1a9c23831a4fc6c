"""What a benchmark mode measures beside its step time: the model and hardware FLOPs of the timed steps and their MFU
/ HFU (`flops`), three profiled steps by kernel group with the routed experts' GEMM rate on an MoE shape and one
step's host syncs (`profile`), where the compile's seconds went (`compile_phases`) and whether Triton started cold
(`triton_cache_state`). The worker (worker.py) calls them after the timed steps, so a failing probe loses no time."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import torch
from torch._dynamo.utils import compile_times

from hybridtune.bench import pairs as bench_pairs
from hybridtune.bench import vl_modes
from hybridtune.models.anatomy import text_config
from hybridtune.models.flops import linear_terms, step_flops
from hybridtune.runtime.profiling import grouped_gemm, profile_run


def triton_cache_state() -> str:
    """ "cold" when the Triton cache is empty at start (every kernel compiled and autotuned in this run)."""
    d = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    n = sum(1 for _ in d.iterdir()) if d.is_dir() else 0
    return f"warm ({n} entries)" if n else "cold"


def compile_phases(least: float = 0.5) -> dict[str, float]:
    """Where the compile's seconds went so far, by torch's timed compile phases (`compile_times`, summed over the
    graphs; nested phases overlap: dynamo's `_compile.compile_inner` holds the rest), those of `least` s or more."""
    names, values = compile_times(repr="csv", aggregate=True)
    return {n: round(float(v), 2) for n, v in zip(names, values) if float(v) >= least}


def can_profile(device: torch.device) -> bool:
    """The profile reads CUDA kernels and CUDA's sync debugging: a GPU run only."""
    return device.type == "cuda"


def profile(spec: dict, gc: bool, cfg, batches: list[dict], step, device: torch.device, result: dict) -> None:
    """Three profiled steps (kernel time by group), the expert GEMMs' rate on an MoE shape, and one step's host
    syncs. Its own function so nothing here can rebind what the step closes over (an MoE run once handed
    `clip_grad_norm_` the expert parameters' names this way)."""
    result["profile"] = profile_run(lambda i: step(batches[i % len(batches)]), 3, device)
    if getattr(text_config(cfg), "num_experts", 0):
        rows = statistics.fmean(batches[i % len(batches)]["input_ids"].numel() for i in range(3))
        names = result.get("lora_parameters", [])
        lora = (spec["lora_r"], names) if spec["adapter"] == "lora" else (0, [])
        result["expert_gemms"] = expert_gemm_rate(result["profile"], cfg, spec["adapter"], *lora, gc, rows)
    result["host_syncs"] = find_syncs(lambda: step(batches[0]))


def expert_gemm_rate(
    profile: dict, cfg, adapter: str, lora_r: int, lora_parameters: list[str], gc: bool, tokens: float
) -> dict:
    """The routed experts' GEMMs in a profile: their kernels' time per step (grouped GEMMs, summed over full kernel
    names by the profile; from its kernel table in a profile made before it did) and the
    FLOP/s it implies from the experts' share of the step's FLOPs (`tokens` rows of the batch, filler included:
    the experts compute them too; top-k experts per token, LoRA on them included, recompute under checkpointing).
    Plain transformers' `grouped_mm` experts run the same kernels, so modes compare; a loop over experts does not."""
    ms = profile.get("grouped_gemm_ms_per_step")
    if ms is None:
        ms = sum(m for name, m, _ in profile.get("kernels_ms_per_step", []) if grouped_gemm(name))
    terms = [t for t in linear_terms(cfg) if t.stored > 1]  # routed experts' 3-D weights
    recompute = 2.0 if gc else 0.0
    per = (6.0 if adapter == "full" else 4.0) + recompute
    flops = per * sum(t.active_params for t in terms) * tokens
    lora = [t for t in terms if any(t.path.endswith("." + p) for p in lora_parameters)]
    flops += (6.0 + recompute) * sum(lora_r * (t.in_features + t.out_features) * t.active for t in lora) * tokens
    out = {"kernel_ms_per_step": ms, "flops_per_step": flops}
    if ms > 0:
        out["tflops_per_s"] = flops / (ms / 1e3) / 1e12
    return out


def find_syncs(run_step) -> dict:
    """Run one step with CUDA sync debugging on: every host-device synchronisation it makes, by source line.

    A sync inside the step stalls the CPU until the GPU drains, which exposes every kernel launch's latency."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_step()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    where: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            key = f"{w.filename}:{w.lineno}"
            where[key] = where.get(key, 0) + 1
    return {"count": sum(where.values()), "by_line": dict(sorted(where.items(), key=lambda kv: -kv[1])[:15])}


def flops(spec, checkpointing: bool, keep_mixer_cores: bool, cfg, batches, timed, result, reference=False) -> None:
    """FLOPs per step (models/flops.py) of the timed steps as this mode ran them, with dpo's reference forward
    (`reference`: bench/pairs.py's `reference_flops`); MFU and HFU against the peak."""
    n = len(batches)
    warmup = spec["warmup"]
    steps = [batches[i % n]["doc_lens"] for i in range(warmup, warmup + spec["steps"])]
    per = [
        step_flops(
            cfg,
            lens,
            adapter=spec["adapter"],
            lora_r=spec["lora_r"],
            lora_targets=result.get("lora_modules", spec["lora_targets"]),
            lora_parameters=result.get("lora_parameters", spec.get("lora_parameters", ())),
            gradient_checkpointing=checkpointing,
            keep_mixer_cores=keep_mixer_cores,
        )
        for lens in steps
    ]
    for f, i in zip(per, range(warmup, warmup + spec["steps"])):  # a vision bench's tower (bench/vl_modes.py)
        tower = batches[i % n].get(vl_modes.VISION_FLOPS, 0.0)
        f.model, f.hardware = f.model + tower, f.hardware + tower
    if reference:
        refs = [bench_pairs.reference_flops(cfg, lens) for lens in steps]
        result["reference_flops_per_step"] = sum(refs) / len(refs)
        for f, r in zip(per, refs):
            f.model, f.hardware = f.model + r, f.hardware + r
    model_f, hw_f = sum(f.model for f in per), sum(f.hardware for f in per)
    result["model_flops_per_step"] = model_f / len(per)
    result["hardware_flops_per_step"] = hw_f / len(per)
    peak = spec.get("peak_flops_per_s")
    if peak:
        # Steady state, as tokens/s: the median over timed steps of each step's FLOPs over its time (a step
        # that records a CUDA graph for a new chunk count, or recompiles, is not the steady state). The
        # means over all timed steps are kept beside them.
        result["mfu"] = statistics.median(f.model / t for f, t in zip(per, timed)) / peak
        result["hfu"] = statistics.median(f.hardware / t for f, t in zip(per, timed)) / peak
        result["mfu_mean"] = model_f / sum(timed) / peak
        result["hfu_mean"] = hw_f / sum(timed) / peak
