"""`hybridtune bench`: several training modes side by side on the same model, data and seeds.

Each mode runs in a fresh subprocess (`hybridtune.bench.worker`), so one mode's compiled graphs,
patched classes, allocator state or crash never touch the next. A mode that has not finished its first
step within `--startup_timeout` seconds is stopped and reported as "no first step within N s"; a mode
that crashes is reported with its error. The matmul peak used for FLOP utilisation is measured first,
in its own process, on the same device.

Output in `--output_dir`: bench.json (command, commit, versions, device, settings, every mode's raw
numbers), bench.md (the table), bench.png (bar chart), logs/<mode>.log (each worker's output). With
`--results TABLE` each mode also becomes a row of that append-only table (`hybridtune.bench.results`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from hybridtune.bench import pairs, report, results, vl_data
from hybridtune.bench.data import MIN_DOC, pack_layouts
from hybridtune.bench.flags import OneLineParser, file_path, folder, number, seconds, whole
from hybridtune.bench.modes import OPTION_KEYS, cudagraph_warmup, parse_mode, split_modes
from hybridtune.bench.runner import STOP_SIGNALS, run_worker
from hybridtune.config import DEFAULT_LORA_TARGETS, MAX_LEARNING_RATE, MAX_SEED, objective_traits
from hybridtune.errors import ConfigError, did_you_mean
from hybridtune.files import atomic_write_text
from hybridtune.kernels.environment import environment
from hybridtune.models.presets import PRESETS
from hybridtune.runtime.signals import deferring, interrupting

logger = logging.getLogger(__name__)

GPU_MODES = "hf-eager,hf-compile,hf-liger,ht-eager,ht-loop,ht-modules"
CPU_MODES = "hf-eager,ht-eager,ht-loop"
VISION_GPU_MODES = "hf-eager,hf-pf,ht-eager,ht-loop"
VISION_CPU_MODES = "hf-eager,hf-pf,ht-eager"
# The flags' ranges (bench/flags.py says a value outside one in a line). Below MIN_DOC tokens a pack holds no document
# of the bench's; a pack, a rank or a count past these is a typo, not a bench.
TOKENS, STEP, LAYOUTS, RANK = whole(MIN_DOC, 2**20), whole(1, 10_000), whole(1, 256), whole(1, 65_536)
LR, SEED = number(0, MAX_LEARNING_RATE), whole(0, MAX_SEED)


# Spellings of earlier releases (recorded in benchmarks/results.jsonl's commands), still accepted and not listed.
OLD_FLAGS = {
    "base_model": ["preset"],
    "sequence_len": ["seq-len"],
    "lora_target_modules": ["lora-targets"],
    "learning_rate": ["lr"],
    "output_dir": ["out-dir"],
}


def _flag(ap: argparse.ArgumentParser, key: str, **kw) -> None:
    """`--key` as `hybridtune train` spells its config keys (snake_case), listed with its help; the dashed form
    (`--key-name`, which train also accepts) and the old spellings of OLD_FLAGS work too, unlisted."""
    ap.add_argument(f"--{key}", **kw)
    names = [key, *OLD_FLAGS.get(key, [])]
    hidden = sorted({f"--{s}" for n in names for s in (n.replace("_", "-"), n.replace("-", "_"))} - {f"--{key}"})
    if hidden:
        same = {k: v for k, v in kw.items() if k in ("type", "action", "choices")}
        ap.add_argument(*hidden, dest=key, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **same)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = OneLineParser(
        prog="hybridtune bench",
        description=__doc__.split("\n\n")[0],
        epilog="Flags are spelled as `hybridtune train`'s config keys where they mean the same; the dashed "
        "spellings (--sequence-len) and those of earlier releases (--preset, --seq-len, --lr, --lora-targets, "
        "--out-dir) still work.",
    )
    _flag(
        ap,
        "base_model",
        default=None,
        help="a preset (random weights; `hybridtune doctor` lists them), or NAME@layers=N for its first N layers "
        "(default: qwen3_5-2b on a GPU, tiny-qwen3_5 on the CPU)",
    )
    _flag(
        ap,
        "modes",
        default=None,
        help="comma-separated MODE[:key=value,...], keys "
        + ", ".join(f"{k}={'|'.join(v)}" for k, v in OPTION_KEYS.items())
        + f" (default GPU: {GPU_MODES}; CPU: {CPU_MODES})",
    )
    _flag(
        ap,
        "vision",
        action="store_true",
        help="vision-language: a random-weight Qwen3.5 VL checkpoint of the preset's text shape and synthetic "
        "image-text documents (1-4 images of 256-1,280 visual tokens each; bench/vl_data.py); hf-eager then runs "
        f"padded batches, hf-pf transformers' padding-free path (default modes GPU: {VISION_GPU_MODES}; CPU: "
        f"{VISION_CPU_MODES}; sequence_len 8192 on a GPU, 512 on the CPU)",
    )
    _flag(ap, "sequence_len", type=TOKENS, default=None, help="tokens per pack (default 4096 on a GPU, 256 on the CPU)")
    _flag(
        ap, "steps", type=STEP, default=None, help="timed steps after the warm-up (default 20 on a GPU, 3 on the CPU)"
    )
    _flag(ap, "warmup", type=STEP, default=None, help="warm-up steps, not timed (default 3 on a GPU, 1 on the CPU)")
    _flag(ap, "layouts", type=LAYOUTS, default=8, help="distinct pack layouts, cycled through the steps (default 8)")
    _flag(
        ap,
        "adapter",
        choices=("lora", "full"),
        default="lora",
        help="lora (default here, as in the published tables; `hybridtune train` defaults to full) or full",
    )
    _flag(ap, "lora_r", type=RANK, default=16, help="LoRA rank (alpha is twice the rank) (default 16)")
    _flag(
        ap,
        "lora_target_modules",
        default=",".join(DEFAULT_LORA_TARGETS),
        help="comma-separated module names that get LoRA (default: train's, " + ",".join(DEFAULT_LORA_TARGETS) + ")",
    )
    _flag(
        ap,
        "lora_target_parameters",
        default="",
        help="comma-separated MoE expert parameters that get LoRA (peft target_parameters), e.g. "
        "gate_up_proj,down_proj (default: none)",
    )
    _flag(ap, "learning_rate", type=LR, default=1e-4, help="AdamW learning rate, constant (default 1e-4)")
    _flag(ap, "seed", type=SEED, default=0, help="seed of the weights, the packs and the adapters (default 0)")
    _flag(
        ap,
        "startup_timeout",
        type=seconds,
        default=600.0,
        help="seconds a mode may take to its first step before it is stopped (default 600)",
    )
    _flag(ap, "mode_timeout", type=seconds, default=1800.0, help="seconds a whole mode may take (default 1800)")
    _flag(
        ap,
        "compile_backend",
        default="inductor",
        help="torch.compile backend (default inductor; aot_eager for a quick CPU check)",
    )
    _flag(ap, "profile", action="store_true", help="GPU: also profile 3 steps per mode (kernel time table)")
    _flag(
        ap,
        "save_kernel_configs",
        type=file_path,
        default=None,
        help="GPU: after each hybridtune mode, add the mixers' kernel autotuning choices to this table (JSON; ship "
        "it as <GPU>.json in the mixer's tuned/ folder so that a fresh machine of that kind skips cold autotuning)",
    )
    _flag(
        ap,
        "output_dir",
        type=folder,
        default="outputs/bench",
        help="where bench.json, bench.md, bench.png and logs/ go",
    )
    _flag(ap, "title", default=None, help="title of the markdown table and the chart (default: from the settings)")
    _flag(
        ap,
        "results",
        type=file_path,
        default=None,
        help="append one row per mode to this results table (e.g. benchmarks/results.jsonl)",
    )
    return ap.parse_args(argv)


def _check(args: argparse.Namespace, settings: dict) -> None:
    """What the flags' types cannot say alone: --vision's pack length, LoRA's targets, the compile backend."""
    import torch._dynamo  # why here: main has imported torch; its backends are what a worker can compile with

    if args.vision and settings["seq_len"] > vl_data.MAX_SEQUENCE_LEN:
        raise ConfigError(
            f"--sequence_len {settings['seq_len']}: --vision draws its documents as images; give {MIN_DOC} to "
            f"{vl_data.MAX_SEQUENCE_LEN}"
        )
    if args.adapter == "lora" and not settings["lora_targets"] + settings["lora_parameters"]:
        raise ConfigError(
            f"--lora_target_modules {args.lora_target_modules!r} names no module; give at least one (e.g. q_proj)"
        )
    known = torch._dynamo.list_backends(exclude_tags=())
    if args.compile_backend not in known:
        raise ConfigError(
            f"--compile_backend {args.compile_backend!r} is not a torch.compile backend."
            f"{did_you_mean(args.compile_backend, known)} Give inductor (the default), aot_eager or eager, or "
            "another of torch._dynamo.list_backends()."
        )


def versions(env: dict) -> dict:
    """Python, hybridtune and every installed distribution the doctor tracks, from `kernels.environment.environment()`."""
    out = {"python": env["python"], "hybridtune": env["hybridtune"]}
    out.update({name: v for name, v in env["versions"].items() if v})
    if env["gpu"].get("cuda"):
        out["cuda"] = env["gpu"]["cuda"]
    return out


def _installed(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def main(argv: list[str]) -> int:
    import torch

    args = parse_args(argv)
    if args.results:
        results.read(args.results)  # a damaged table is said now, not after the run
    gpu = torch.cuda.is_available()
    preset = args.base_model or ("qwen3_5-2b" if gpu else "tiny-qwen3_5")
    if preset not in PRESETS:
        raise ConfigError(
            f"--base_model '{preset}' is not a preset (bench builds random weights of a preset's shape)."
            f"{did_you_mean(preset, PRESETS)} Presets: {', '.join(PRESETS)}."
        )
    PRESETS[preset]  # a bad NAME@layers=N is said now, before any mode runs
    default_modes = (
        (VISION_GPU_MODES if gpu else VISION_CPU_MODES) if args.vision else (GPU_MODES if gpu else CPU_MODES)
    )
    modes = [parse_mode(s) for s in split_modes(args.modes or default_modes)]
    labels = [m.label for m in modes]
    if args.vision and (PRESETS[preset].model_type != "qwen3_5_text" or any(m.objective != "sft" for m in modes)):
        raise ConfigError(
            "--vision benches sft on a dense Qwen3.5 preset (qwen3_5-0.8b, qwen3_5-2b, qwen3_5-9b, tiny-qwen3_5) with "
            f"the hf-* and ht-* modes; got {preset} and {','.join(labels)}"
        )
    if len(set(labels)) != len(labels):
        raise ConfigError(f"--modes names a mode twice: {','.join(labels)}")
    settings = {
        "preset": preset,
        "seq_len": args.sequence_len or ((8192 if gpu else 512) if args.vision else (4096 if gpu else 256)),
        "steps": args.steps if args.steps is not None else (20 if gpu else 3),
        "warmup": args.warmup if args.warmup is not None else (3 if gpu else 1),
        "layouts": args.layouts,
        "adapter": args.adapter,
        "lora_r": args.lora_r,
        "lora_targets": [t for t in args.lora_target_modules.split(",") if t],
        "lora_parameters": [t for t in args.lora_target_parameters.split(",") if t],
        "lr": args.learning_rate,
        "seed": args.seed,
        "compile_backend": args.compile_backend,
        "dtype": "bf16 weights + bf16 autocast" if gpu else "fp32",
        "profile": args.profile,
    }
    _check(args, settings)
    stretched = cudagraph_warmup(settings["warmup"], settings["layouts"], modes)
    if stretched != settings["warmup"]:
        settings.update(warmup_asked=settings["warmup"], warmup=stretched)
    out = Path(args.output_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    vision = _vision(settings, out, gpu) if args.vision else None
    lay = vl_data_layouts(out) if vision else pack_layouts(settings["seq_len"], settings["layouts"], settings["seed"])
    env = environment()
    doc = {
        "what": "hybridtune bench: training step per mode, same model, data and seeds, each mode in a fresh process",
        "command": "hybridtune bench " + " ".join(argv),
        "git_commit": env["git_commit"] or "unknown",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(),
        "versions": versions(env),
        "settings": settings,
        "data": {
            "layouts": lay,
            "docs_per_pack_mean": sum(map(len, lay)) / len(lay),
            "distribution": "log-normal document lengths, median 400, sigma 0.9, packs filled exactly",
        },
        "modes": {},
    }
    if vision:
        doc["data"]["distribution"] = vision.pop("distribution")
        doc["vision"] = vision
    if any(objective_traits(m.objective).unit == "pairs" for m in modes):  # (pairs' lengths: any vocabulary's)
        doc["pairs"] = pairs.describe(
            pairs.make_pairs(settings["seq_len"], settings["layouts"], 2, args.seed), settings["seq_len"]
        )
    if any(m.trl for m in modes):
        doc["versions"]["trl"] = _installed("trl")
    logger.info(
        "bench: %s on %s, %d-token packs, modes %s", preset, doc["device"], settings["seq_len"], ", ".join(labels)
    )
    interrupted = _run_modes(doc, modes, settings, out, args)
    with deferring("SIGINT", *STOP_SIGNALS) as late:  # the records of what ran are written whole, rows first
        _write_json(out / "bench.json", doc)
        table = report.markdown(doc, title=args.title)
        atomic_write_text(out / "bench.md", table)
        if args.results:
            added = results.append(results.bench_rows(doc, source="hybridtune bench"), args.results)
            logger.info("bench: rows %s appended to %s", ", ".join(str(r["id"]) for r in added), args.results)
        print(table)
        if not late.received:
            try:
                report.chart(doc, out / "bench.png", title=args.title)
            except ImportError as e:
                logger.warning("no chart: %s", e)
    logger.info("bench: wrote bench.json and bench.md in %s", out)
    return 130 if interrupted or late.received else 0


# Signals that stop a bench besides Ctrl-C: `timeout`'s and a scheduler's SIGTERM, a dropped terminal's SIGHUP.
STOPPED_BY_SIGNAL = "bench stopped by a signal (Ctrl-C, SIGTERM or SIGHUP) during this mode"
STOPPED_IN_PEAK = "bench stopped by a signal during the peak measurement"


def _run_modes(doc: dict, modes: list, settings: dict, out: Path, args) -> bool:
    """The peak measurement, then each mode in its worker, into `doc` (bench.json rewritten after each). A Ctrl-C,
    SIGTERM or SIGHUP stops the worker in flight and the modes after it; the modes done keep their results and
    become rows as in a whole run; the mode in flight is marked stopped, those not started are listed
    (`not_run`). True when so stopped."""
    doc["peak"], label = {"error": STOPPED_IN_PEAK}, None
    with interrupting(*STOP_SIGNALS):
        try:
            doc["peak"] = run_worker(
                {"kind": "peak"}, out / "logs" / "peak.log", args.startup_timeout, args.mode_timeout
            )
            for mode in modes:
                label = mode.label
                spec = {"kind": "mode", "mode": label, **settings, "peak_flops_per_s": doc["peak"].get("flops_per_s")}
                if args.save_kernel_configs is not None:
                    spec["save_kernel_configs"] = str(args.save_kernel_configs.resolve())
                logger.info("bench: running %s", label)
                log = out / "logs" / f"{label.replace(':', '_').replace('=', '-')}.log"
                doc["modes"][label] = run_worker(spec, log, args.startup_timeout, args.mode_timeout)
                label = None  # done: a signal from here on stops nothing of it
                logger.info("bench: %s", report.one_line(mode.label, doc["modes"][mode.label]))
                _write_json(out / "bench.json", doc)
        except KeyboardInterrupt:
            if label is not None:
                doc["modes"][label] = {"error": STOPPED_BY_SIGNAL, "stopped": True}
            doc["not_run"] = [m.label for m in modes if m.label not in doc["modes"]]
            logger.warning(
                "bench: stopped by a signal%s; the modes done are kept%s",
                f" during {label}" if label else "",
                f", not run: {', '.join(doc['not_run'])}" if doc["not_run"] else "",
            )
            return True
    return False


def _vision(settings: dict, out: Path, gpu: bool) -> dict:
    """--vision: the VL checkpoint and the image-text packs written under `out` (bench/vl_data.py) in a process of
    their own (the model's random draw on the GPU there, none held here); the settings name them for the workers."""
    cmd = [sys.executable, "-m", "hybridtune.bench.vl_data", str(out), settings["preset"]]
    cmd += ["--sequence_len", str(settings["seq_len"]), "--layouts", str(settings["layouts"])]
    cmd += ["--seed", str(settings["seed"]), "--dtype", "bfloat16" if gpu else "float32"]
    logger.info("bench: writing the vision-language checkpoint and documents under %s", out)
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ConfigError(f"--vision: the bench's VL model or data could not be written ({tail[0]})")
    settings.update(vision=True, vision_dir=str(out), model_dir=str(out / vl_data.MODEL_DIR))
    info = json.loads((out / vl_data.DATA_DIR / "describe.json").read_text())
    info["prepare_s"] = round(time.monotonic() - t0, 1)
    return info


def vl_data_layouts(out: Path) -> list[list[int]]:
    return [[len(d["ids"]) for d in p] for p in vl_data.load_packs(out)]


def _write_json(path: Path, doc: dict) -> None:
    atomic_write_text(path, json.dumps(doc, indent=1, default=str))
