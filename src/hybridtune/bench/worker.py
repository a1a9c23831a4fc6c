"""One benchmark mode (or the matmul peak) in a fresh process.

`python -m hybridtune.bench.worker SPEC.json RESULT.json`, started by `hybridtune bench`. The worker
prints `FIRST_STEP_MARKER` once its first step has finished, so the parent can stop a mode that does
not start within its time limit, and writes its result (or its error) as JSON.

A step is the trainer's optimizer step of one micro-batch (runtime/compose.py: forward and loss under bf16 autocast
on a GPU, backward, global-norm clipping at train's max_grad_norm, train's optimizer and learning-rate schedule over
the mode's steps from train's builder `compose.optimization` (fp32 masters where the model's weights were split for
them: an ht full fine-tune under bf16; an hf mode steps its weights as loaded), zero_grad); a hybridtune mode's
model, choices and compile are train's own (`build`). It is timed with the device synchronised on both sides; the
loss is read after the timer stops.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from hybridtune.batch import NUM_TOKENS
from hybridtune.bench import pairs as bench_pairs
from hybridtune.bench import probes, vl_modes
from hybridtune.bench.data import make_batches, pack_layouts
from hybridtune.bench.modes import parse_mode
from hybridtune.bench.trl_dpo import NotRun, build_trl
from hybridtune.config import TrainConfig, load_config
from hybridtune.data.build import PreparedData
from hybridtune.data.collator import StaticLayout
from hybridtune.data.packing import PackStats
from hybridtune.files import atomic_write_text
from hybridtune.kernels.provision import provision_kernels
from hybridtune.mixers import registry
from hybridtune.models import experts
from hybridtune.models.anatomy import text_config
from hybridtune.models.flops import measure_peak
from hybridtune.models.hub import resolve_source
from hybridtune.models.loading import load_model, tokenizer_for
from hybridtune.runtime import compose as compose_step
from hybridtune.runtime import cudagraphs, distributed
from hybridtune.runtime.adapter_kind import adapter_kind
from hybridtune.runtime.choices import choose_bf16, resolve
from hybridtune.runtime.compose import Composed, compose
from hybridtune.runtime.lora import applied_targets, lora_from_config
from hybridtune.runtime.measure import measure
from hybridtune.runtime.metrics import memory_gib
from hybridtune.runtime.model import RunModel
from hybridtune.runtime.model import build_model as build_run_model
from hybridtune.runtime.stream import to_device
from hybridtune.train.objectives import build_objective, spec_of

FIRST_STEP_MARKER = "HYBRIDTUNE_BENCH_FIRST_STEP"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _apply_liger(model_type: str) -> str:
    from liger_kernel import transformers as liger  # ImportError: mode skipped by the caller

    fn = getattr(liger, f"apply_liger_kernel_to_{model_type.removesuffix('_text')}", None)
    if fn is None:
        raise RuntimeError(f"liger-kernel has no patch for model type '{model_type}'")
    fn()
    return fn.__name__


def phase(what: str) -> None:
    """A line in the mode's log as each start-up phase ends, so that the log of a mode stopped before its first step
    says where its time went (a cold self-test, the model's build, the compile)."""
    print(f"phase {time.perf_counter() - _T0:.1f} s: {what}", flush=True)


_T0 = time.perf_counter()


def _kernels(mode, cfg, device: torch.device, result: dict) -> None:
    # `cfg`: the model's transformers config
    """hybridtune modes lift a kernel's guard (FLA's Hopper guard) through the kernel self-test; plain modes can only
    bypass it, for the whole process."""
    if device.type != "cuda":
        return

    if mode.patch:
        t0 = time.perf_counter()
        report = provision_kernels("check", False, cfg, log=False)
        result["kernel_selftest"] = report.selftest
        result["kernel_configs"] = report.kernel_configs
        result["kernel_selftest_s"] = time.perf_counter() - t0
        phase(f"kernel self-test done ({result['kernel_selftest_s']:.1f} s)")
        for suite in registry.selftests():
            result[suite.report_key] = suite.granted() or "no grant"
        return
    for suite in registry.selftests():
        note = suite.bypass()
        if note is not None:
            result[suite.report_key] = note


def train_config(spec: dict, mode) -> TrainConfig:
    """`hybridtune train`'s config for this run: the bench's shape, adapter, learning rate and seed, and a hybridtune
    mode's keys (`mode.train`) over train's defaults; one micro-batch per step, LoRA alpha twice the rank."""
    keys = {
        "base_model": spec.get("model_dir") or spec["preset"],  # (--vision: the bench's VL checkpoint)
        "adapter": spec["adapter"],
        "lora_r": spec["lora_r"],
        "lora_alpha": 2 * spec["lora_r"],
        "lora_dropout": 0.0,
        "lora_target_modules": list(spec["lora_targets"]),
        "lora_target_parameters": list(spec.get("lora_parameters", [])),
        "learning_rate": spec["lr"],
        "seed": spec["seed"],
        "sequence_len": spec["seq_len"],
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 1,
        **(mode.train or {}),
    }
    return load_config(None, keys, warn=False)


def _build_baseline(cfg: TrainConfig, mode, source, tokenizer, device: torch.device, backend: str, result: dict):
    """An hf mode's model: the preset's weights as train loads them (the same values: loss parity), plain
    transformers (liger's patches where asked), gradient checkpointing as users run it with peft, peft's LoRA,
    torch.compile(model) for hf-compile."""
    if mode.liger:
        result["liger"] = _apply_liger(source.config_ref.model_type)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(cfg.seed)  # (as `hybridtune train` seeds before its model: the same LoRA draws)
    loaded = load_model(source, tokenizer, seed=cfg.seed, dtype=dtype)
    model = loaded.model.to(device)
    if getattr(text_config(model.config), "num_experts", 0):
        result["experts"] = f"transformers' {model.config._experts_implementation!r} experts implementation"
    if mode.gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    if adapter_kind(cfg).lora:
        model = lora_from_config(model, cfg)
        _lora_result(model, cfg, result)
    model.train()
    if mode.compile == "torch":
        model = torch.compile(model, backend=backend, mode=cudagraphs.MODE if mode.cg else None)
    objective = build_objective(cfg, fused_loss=False)
    engine = distributed.LossModule(model, objective)
    return Composed(RunModel(loaded, model, None), engine, engine, device, device.type == "cuda", cuda_graphs=mode.cg)


def _lora_result(model, cfg: TrainConfig, result: dict) -> None:
    """What peft really adapted (for Qwen3-Next it moves MLP names onto the experts): the FLOP count follows it."""
    result["lora_modules"], result["lora_parameters"] = applied_targets(model)
    if cfg.lora_target_parameters:
        grouped = sum(1 for m in model.modules() if experts.ORIGINAL_FORWARD in m.__dict__)
        result["experts_lora"] = f"grouped in {grouped} layer(s)" if grouped else "peft's ParamWrapper forward"


def build(spec: dict, mode, device: torch.device, result: dict):
    """(train config, `Composed`, `Choices` or None for an hf mode, the packed batches on the device). A hybridtune
    mode is built as `hybridtune train` builds its step (runtime/model.py, runtime/choices.py, runtime/compose.py)."""
    cfg = train_config(spec, mode)
    result["compile_backend"] = spec.get("compile_backend", "inductor")
    source = resolve_source(cfg.base_model)
    tokenizer = tokenizer_for(source)
    _kernels(mode, source.config_ref, device, result)
    layouts, packs = pack_layouts(spec["seq_len"], spec["layouts"], spec["seed"]), None
    trains = spec_of(mode.objective)  # its own packs, the bench's pairs (bench/pairs.py) or its random documents
    if (make := trains.bench_packs or bench_pairs.packs_for(trains.traits)) is not None:
        packs = make(spec["seq_len"], layouts, len(tokenizer), spec["seed"])  # (the same for every mode)
        layouts = bench_pairs.doc_lens(packs)
    if spec.get("vision"):  # image-text documents (bench/vl_data.py), the same packs for every mode
        layouts = vl_modes.doc_layouts(spec)
    elif mode.flatten:
        raise NotRun("hf-pf is the vision bench's mode (--vision): the text hf modes train on packed rows already")
    if mode.trl:
        c, batches = build_trl(cfg, mode, source, tokenizer, device, packs, result)
        return cfg, c, None, batches
    if not mode.patch:
        c = _build_baseline(cfg, mode, source, tokenizer, device, result["compile_backend"], result)
        c = vl_modes.hf_engine(c) if spec.get("vision") else c
        layout = StaticLayout.fit(layouts, max_filler=1.0) if mode.static else None
        choices = None
    else:
        bf16 = choose_bf16(cfg, measure(cfg, device, distributed.ONE)).value
        torch.manual_seed(cfg.seed)  # (as `hybridtune train` seeds before its model)
        run = build_run_model(cfg, source, tokenizer, device, bf16)
        facts = measure(cfg, device, distributed.ONE, run.model, bf16, [tuple(p) for p in layouts])
        choices = resolve(cfg, facts)
        objective = trains.build(cfg, choices.fused_loss.value, run.model)  # (a full fine-tune's dpo: its reference)
        c = compose(run, cfg, choices, objective, device, distributed.ONE, facts.packs, result["compile_backend"])
        for key, form in mode.forms.items():  # (after compose, whose CUDA-graph settings pick forms; traced later)
            registry.graph_setup(f"{key}={form}")
        layout = choices.pack_layout.value
        result["choices"] = choices.lines()
        result["compile_options"] = {"strategy": c.strategy, **c.compile_options}
        result["patch_report"] = str(run.patch_report)
        if run.patch_report.experts:
            routed = run.patch_report.experts
            result["experts"] = f"{len(routed)} layer(s): {next(iter(routed.values()))}"
        if adapter_kind(cfg).lora:
            _lora_result(c.model, cfg, result)
    vocab = text_config(c.run.loaded.model.config).vocab_size
    if spec.get("vision"):
        vcfg = c.run.loaded.model.config.vision_config
        batches = [vl_modes.to_device(b, device) for b in vl_modes.batches(spec, mode, source, tokenizer, layout, vcfg)]
    elif packs is not None:
        collator = trains.collator(PreparedData(packs, [], PackStats()))
        batches = [to_device(b, device) for b in bench_pairs.pair_batches(packs, layout, collator)]
    else:
        batches = [to_device(b, device) for b in make_batches(layouts, vocab, spec["seed"], layout)]
    return cfg, c, choices, batches


def build_model(spec: dict, mode, device: torch.device, result: dict):
    """(the transformers config, the model) of a mode, as `build` makes them (benchmarks/moe_parity.py)."""
    _, c, _, _ = build(spec, mode, device, result)
    return c.run.loaded.model.config, c.model


def run_mode(spec: dict) -> dict:
    from torch._dynamo.utils import counters

    mode = parse_mode(spec["mode"])
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(spec.get("num_threads") or 1)
    result: dict = {"mode": mode.to_dict(), "device": str(device), "triton_cache": probes.triton_cache_state()}
    t0 = time.perf_counter()
    cfg, c, choices, batches = build(spec, mode, device, result)
    checkpointing = choices.checkpointing.value if choices else mode.gc
    keep = choices.keep_mixer_cores.value if choices else False
    graphs = c.cuda_graphs
    result["mode"]["gc"] = checkpointing  # (the report's GC column)
    warmup = spec["warmup"]  # the same for every mode (stretched for CUDA graphs by the parent: cudagraph_warmup)
    total = warmup + spec["steps"]
    params = c.trainable()
    opt = compose_step.optimization(c, cfg, total)  # train's optimizer, fp32 masters and schedule over the run
    result["setup_s"] = time.perf_counter() - t0
    compiled = c.strategy != "off" or mode.compile != "off"
    phase(f"model built ({result['setup_s']:.1f} s); first step next" + (" (it compiles)" if compiled else ""))
    result["trainable_params"] = sum(p.numel() for p in params)
    result["total_params"] = sum(p.numel() for p in c.model.parameters())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    counters.clear()
    if graphs:
        torch._logging.set_logs(cudagraphs=True, perf_hints=True)  # why a graph ran without CUDA graphs

    def step(b: dict) -> torch.Tensor:
        """One optimizer step of one micro-batch, as `hybridtune train` runs it (runtime/compose.py)."""
        items = c.engine.objective.window_items([b])  # what the loss averages over: trained tokens, pairs
        (loss,) = compose_step.backward(c, [b], items, opt.params)
        compose_step.clip(opt.params, cfg.max_grad_norm)
        opt.step()
        return loss

    if graphs:
        result["cudagraph_shapes"] = len({registry.batch_sizes(b) for b in batches})
    result["warmup_steps"] = warmup
    times, losses, graphs_after_warmup = [], [], 0
    for i in range(total):
        sync(device)
        start = time.perf_counter()
        loss = step(batches[i % len(batches)])
        sync(device)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        if i == 0:
            print(FIRST_STEP_MARKER, f"{times[0]:.2f}", flush=True)
            result["compile_phases_s"] = probes.compile_phases()
        if i == warmup - 1:
            graphs_after_warmup = counters["stats"]["unique_graphs"]
        print(f"step {i + 1}/{total} {times[-1] * 1e3:.1f} ms loss {losses[-1]:.5f}", flush=True)
    timed = times[warmup:]
    med = statistics.median(timed)
    tokens = [b[NUM_TOKENS] for b in batches]  # the documents' own tokens (a static layout adds filler)
    timed_tokens = [tokens[i % len(batches)] for i in range(warmup, total)]
    result.update(
        first_step_s=times[0],
        step_times_s=times,
        median_step_s=med,
        tokens_per_s=statistics.median(n / t for n, t in zip(timed_tokens, timed)),
        losses=losses,
        loss_step1=losses[0],
        loss_last10_mean=statistics.fmean(losses[-10:]),
        graph_breaks=sum(counters["graph_break"].values()),
        graph_break_reasons=[r for r, _ in counters["graph_break"].most_common(5)],
        graphs=counters["stats"]["unique_graphs"],
        recompiles_after_warmup=counters["stats"]["unique_graphs"] - graphs_after_warmup,
    )
    if graphs:
        # Inductor counts each graph it ran without CUDA graphs (the reason is in the mode's log).
        result["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
    if device.type == "cuda":
        result["peak_alloc_gib"] = memory_gib(device)
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    else:
        result["peak_rss_gib"] = memory_gib(device)
    model_config = c.run.loaded.model.config
    result["step_tokens"] = timed_tokens
    reference = getattr(c.engine.objective, "needs_reference", mode.trl)  # (TRL's DPOTrainer: dpo's reference)
    probes.flops(spec, checkpointing, keep, model_config, batches, timed, result, reference=reference)
    if spec.get("save_kernel_configs") and device.type == "cuda" and mode.patch:
        path = Path(spec["save_kernel_configs"])
        try:  # the timed steps are measured already: a table that cannot be written must not lose them
            name = torch.cuda.get_device_name(device)
            result["kernel_configs_saved"] = sum(suite.save_tuning(path, name) for suite in registry.selftests())
            print(f"kernel configs: {result['kernel_configs_saved']} entries in {path}", flush=True)
        except (OSError, ValueError) as e:
            result["kernel_configs_error"] = f"{type(e).__name__}: {e}"
            print(f"kernel configs not saved: {e}", flush=True)
    if spec.get("profile") and probes.can_profile(device):
        try:
            probes.profile(spec, checkpointing, model_config, batches, step, device, result)
        except Exception as e:  # the timed steps are measured already: a failing profile must not lose them
            result["profile_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"profile failed (the timed steps are kept): {traceback.format_exc()[-3000:]}", flush=True)
    return result


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    out = Path(argv[1])
    try:
        if spec["kind"] == "peak":
            dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
            result = measure_peak(dev)
        else:
            result = run_mode(spec)
    except (ImportError, NotRun) as e:
        result = {"skipped": f"{e}"}
    except Exception as e:  # reported in the table, never a hang or a lost run
        result = {"error": f"{type(e).__name__}: {str(e)[:500]}", "traceback": traceback.format_exc()[-6000:]}
        print(result["traceback"], file=sys.stderr, flush=True)
    atomic_write_text(out, json.dumps(result, indent=1, default=str))
    return 0


def exit_with_parent(parent: int, every: float = 1.0):
    """End this process's whole group (its compile workers too) once `parent` is gone. The worker runs in a session
    of its own, so a bench killed outright (SIGKILL: the OOM killer, a scheduler's grace period over), which can
    stop nothing, would otherwise leave it holding the GPU. A daemon thread; returned for tests."""
    import signal
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    thread = threading.Thread(target=watch, daemon=True, name="hybridtune-parent-watch")
    thread.start()
    return thread


if __name__ == "__main__":
    exit_with_parent(os.getppid())
    raise SystemExit(main(sys.argv[1:]))
