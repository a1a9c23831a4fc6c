"""`hybridtune doctor [--model M] [--json]`: versions, GPU, the path each mixer takes, and how to fix each gap.

Without `--model` it also lists the model presets (name, family, parameters, what each is for; their weights
are random) and the example configs shipped with hybridtune (`hybridtune train hybridtune:configs/NAME.yaml`).

Doctor never installs anything: it runs the provisioning logic under `check` and says what `kernels: auto`
would do. With `--model` (a preset name or a local checkpoint directory) it parses what the architecture
asks for, builds the model on the meta device (no memory, no weights) to report each mixer's path, and on a
GPU runs the kernel self-test for the model's head layouts (cached; a pass lifts a kernel's guard, FLA's Hopper
guard, for that layout in this process only).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from hybridtune.compiler.modules.plan import plan_model
from hybridtune.config import TrainConfig, bundled_configs
from hybridtune.errors import ModelError, did_you_mean
from hybridtune.kernels import gates
from hybridtune.kernels.environment import dist_version, environment
from hybridtune.kernels.needs import kernel_spec, read_config
from hybridtune.kernels.paths import report
from hybridtune.kernels.provision import ENV_POLICY, ENV_REQUIRE, backend_lines, provision_kernels
from hybridtune.kernels.selftest import suites
from hybridtune.mixers import MIXERS
from hybridtune.models.hub import looks_like_hub_id, resolve_source
from hybridtune.models.presets import PRESETS, preset_config

logger = logging.getLogger(__name__)


def attention_backend() -> dict[str, Any]:
    """What packed (varlen) attention can run on here, in the order hybridtune prefers them."""
    try:
        import torch

        cuda = torch.cuda.is_available()
        varlen = importlib.util.find_spec("torch.nn.attention.varlen") is not None
    except ImportError:
        cuda, varlen = False, False
    flash = dist_version("flash-attn")
    if cuda and flash:
        chosen = f"flash_attention_2 varlen (flash-attn {flash}): cu_seq_lens passed, no per-layer nonzero"
    elif cuda and varlen:
        chosen = "torch varlen_attn (torch.nn.attention.varlen): documents kept apart, no padding"
    else:
        chosen = "sdpa with a per-document block mask (reference speed; CPU or no varlen kernel)"
    return {"flash_attn": flash, "torch_varlen_attn": varlen, "cuda": cuda, "packed_path": chosen}


def resolve_model(spec: str) -> tuple[str, Any]:
    """(label, transformers config) for a preset name, a local checkpoint directory or a hub id (its config.json)."""
    if spec in PRESETS:
        preset = PRESETS[spec]
        # Vocabulary size changes no kernel decision; a fixed one keeps doctor off the tokenizer.
        return f"preset {spec}", preset_config(spec, vocab_size=256 if preset.uses_bundled_tokenizer else None)
    path = Path(spec).expanduser()
    if path.is_dir() or path.name == "config.json":
        return f"checkpoint {path}", read_config(path)
    if looks_like_hub_id(spec):  # its config.json alone, from the hub cache (or the hub, unless HF_HUB_OFFLINE)
        source = resolve_source(spec, files=["config.json"])
        return f"hub model {spec} ({source.path})", read_config(source.path)
    raise ModelError(
        f"--model '{spec}' is neither a preset, a local checkpoint directory nor a hub id (org/name).{did_you_mean(spec, PRESETS)} Presets: {', '.join(PRESETS)}."
    )


FAMILIES = {"qwen3_5_text": "Qwen3.5 dense", "qwen3_5_moe_text": "Qwen3.5 MoE", "qwen3_next": "Qwen3-Next MoE"}


def preset_table() -> list[dict[str, Any]]:
    """Every preset: name, family, parameters, what it is for; all of them are random weights, never downloaded."""
    default = TrainConfig().base_model
    return [
        {
            "name": p.name,
            "family": FAMILIES.get(p.model_type, p.model_type),
            "model_type": p.model_type,
            "parameters": p.parameters,
            "for": p.description,
            "random_weights": True,
            "default": p.name == default,
        }
        for p in PRESETS.values()
    ]


def _count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def _build_meta(config: Any) -> tuple[Any | None, str]:
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    errors = []
    for auto in (AutoModelForCausalLM, AutoModel):
        try:
            with torch.device("meta"):
                return auto.from_config(config), ""
        except (ValueError, KeyError, TypeError, RuntimeError, NotImplementedError) as e:
            errors.append(f"{auto.__name__}: {str(e).splitlines()[0][:160]}")
    return None, "; ".join(errors)


def _patched_paths(model: Any) -> dict[str, Any]:
    """The per-mixer paths `hybridtune train` runs: the same model after `patch_model` (on meta, no weights)."""
    try:
        # why here: patching imports torch and the ops; doctor still reports where they do not import
        from hybridtune.models.patching import patch_model
    except ImportError as e:
        return {"error": f"hybridtune.models.patching unavailable ({e})"}
    try:
        patched = patch_model(model)
    except Exception as e:  # doctor reports; a patching bug must not hide the rest of the diagnosis
        return {"error": f"patch_model failed: {type(e).__name__}: {e}"}
    d = report(model).to_dict()
    d["attention"] = patched.attention
    d["skipped"] = dict(patched.skipped)
    return d


def _compile_plan(model: Any) -> list[dict[str, Any]] | dict[str, str]:
    """What `compile: modules` would do per class of the patched model (compile, eager, routed, left)."""
    try:
        return [p.to_dict() for p in plan_model(model)]
    except Exception as e:  # doctor reports; a planning bug must not hide the rest of the diagnosis
        return {"error": f"plan_model failed: {type(e).__name__}: {e}"}


def config_about(path: Path) -> str:
    """What a bundled example config is for: the first line of its opening comment."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def diagnose(model: str | None = None) -> dict[str, Any]:
    """Everything doctor reports, as one JSON-able dict."""
    out: dict[str, Any] = {"environment": environment(), "attention": attention_backend()}
    for suite in suites():  # each suite's `guard_key`
        out[suite.guard_key] = suite.guard_active()
    out["kernel_backends"] = backend_lines(None, suites())  # the pin and what is installed; per layout below
    out["presets"] = preset_table()
    out["bundled_configs"] = {name: str(path) for name, path in bundled_configs().items()}
    out["bundled_configs_about"] = {name: config_about(path) for name, path in bundled_configs().items()}
    if model is None:
        return out
    label, config = resolve_model(model)
    env = {k: v for k, v in os.environ.items() if k not in (ENV_POLICY, ENV_REQUIRE)}
    prov = provision_kernels("check", False, config, env=env, log=False)  # doctor checks; it never installs
    out["model"] = {"spec": model, "source": label, "model_type": getattr(config, "model_type", None)}
    out["provision"] = prov.to_dict()
    out["kernel_backends"] = backend_lines(config, suites())  # what FLA dispatches to, what the ops run, per layout
    for spec in MIXERS.values():  # each mixer's self-test layouts, as `<kind>_layouts`
        if spec.selftest is not None:
            out["model"][f"{spec.kind}_layouts"] = [str(lay) for lay in spec.selftest().layouts(config)]
    built, err = _build_meta(config)
    if built is None:
        out["mixers"] = {"error": f"could not build the model on the meta device: {err}"}
    else:
        out["mixers"] = report(built).to_dict()
        out["mixers_hybridtune"] = _patched_paths(built)
        out["compile_plan"] = _compile_plan(built)
    hooks = gates.active()
    if hooks is not None:  # gate-style transformers: what each gate answered at the modeling import
        out["gate_hooks"] = hooks.to_dict()
    auto_would = {}
    for name, st in prov.kernels.items():
        if st.state == "missing":
            spec = kernel_spec(name)
            auto_would[name] = (
                "install " + " ".join(spec.distributions) if spec.distributions else f"nothing (no wheel): {spec.fix}"
            )
    out["under_auto"] = auto_would
    return out


def render(d: dict[str, Any]) -> str:
    env = d["environment"]
    lines = [f"hybridtune {env['hybridtune']} ({env['git_commit'] or 'no git'}) python {env['python']}"]
    vers = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    missing = ", ".join(k for k, v in env["versions"].items() if not v)
    lines.append(f"  installed: {vers}")
    lines.append(f"  not installed: {missing or 'none'}")
    gpu = env["gpu"]
    if gpu["available"]:
        for dev in gpu["devices"]:
            lines.append(
                f"  gpu {dev['index']}: {dev['name']} sm{dev['capability']} {dev['memory_gib']} GiB (CUDA {gpu['cuda']})"
            )
    else:
        lines.append(f"  gpu: none ({gpu['reason']})")
    lines += [f"  {s.guard_note}" for s in suites() if d.get(s.guard_key)]
    lines.append(f"packed attention: {d['attention']['packed_path']}")
    lines += d.get("kernel_backends", [])
    if "model" not in d:
        lines.append(
            "presets (base_model: NAME; random weights, built here, never downloaded: demos, tests, benchmarks):"
        )
        width = max(len(p["name"]) for p in d["presets"])
        lines.append(f"  {'name':<{width}}  {'family':<14} {'params':>6}  for")
        for p in d["presets"]:
            default = " (the default base_model)" if p["default"] else ""
            lines.append(f"  {p['name']:<{width}}  {p['family']:<14} {_count(p['parameters']):>6}  {p['for']}{default}")
        lines.append("  a real model: base_model: a local checkpoint directory or a hub id org/name")
        lines.append("example configs (hybridtune train NAME; copy the file to start your own):")
        for name, path in d["bundled_configs"].items():
            lines.append(f"  {name}  {path}")
            lines.append(f"      {d['bundled_configs_about'][name]}")
        lines.append("(pass --model PRESET_OR_DIR for the per-mixer paths and the self-test)")
        return "\n".join(lines)
    m, prov = d["model"], d["provision"]
    arch = prov["architecture"]
    lines.append(
        f"model: {m['source']} (model_type {m['model_type']}, modeling {arch['modeling_module']}, {arch['style']})"
    )
    lines.append(
        f"  needs: {', '.join(arch['needs']) or 'nothing (no kernel gates or fallbacks in its modeling module)'}"
    )
    for u in arch["uses"]:
        lines.append(f"    line {u['line']}: {u['via']}")
    for name, st in prov["kernels"].items():
        sub = f", covered by {st['substitute']} on hybridtune's path" if st.get("substitute") else ""
        lines.append(f"  {name}: {st['state']}{' ' + st['version'] if st['version'] else ''}{sub}")
        if not st["covered"]:
            lines.append(f"    cost: {st['cost']}")
    for key, title in (("mixers", "stock transformers"), ("mixers_hybridtune", "hybridtune train (patched)")):
        mix = d.get(key, {})
        if "error" in mix:
            lines.append(f"mixers, {title}: {mix['error']}")
            continue
        lines.append(f"mixers, {title}:")
        for row in mix.get("mixers", []):
            lines.append(f"  {row['count']:>3} x {row['cls']}: {row['path']}")
        for name, why in mix.get("skipped", {}).items():
            lines.append(f"  {name}: kept upstream ({why})")
        if mix.get("attention"):
            lines.append(f"  attention: {mix['attention']}")
    for ev in d.get("gate_hooks", {}).get("events", []):
        what = "installed" if ev["provisioned"] else "not provisioned (policy check)"
        lines.append(
            f"  gate {ev['gate']}() at the modeling import: {ev['first']}" + ("" if ev["first"] else f", {what}")
        )
    if not prov["selftest"]:
        gpu_ok = env["gpu"]["available"]
        why = "no mixer with a self-test, or its kernel package missing" if gpu_ok else "no CUDA device"
        lines.append(f"self-test: not run ({why})")
    else:
        lines.append("self-test:")
        if prov.get("kernel_configs"):
            lines.append(f"  {prov['kernel_configs']}")
        for v in prov["selftest"]:
            lines.append(
                f"  {v['kernel']:<14} {v['layout']:<26} {v['verdict']}{' (cached)' if v.get('cached') else ''}"
            )
    for name, what in d.get("under_auto", {}).items():
        lines.append(f"  under `kernels: auto`, {name}: {what}")
    plan = d.get("compile_plan")
    if isinstance(plan, list) and plan:
        lines.append("compile plan (`compile: modules`), per class:")
        width = max(len(p["class"]) for p in plan)
        for p in plan:
            full = " fullgraph" if p.get("fullgraph") else ""
            lines.append(f"  {p['class']:<{width}}  {p['decision'] + full:<18} {p['reason']}")
    elif isinstance(plan, dict):
        lines.append(f"compile plan: {plan['error']}")
    lines.append(f"fast path: {'yes' if prov['fast_path'] else 'NO'}")
    for g in prov["gaps"]:
        lines.append(f"  gap: {g}")
    for f in prov["fixes"]:
        lines.append(f"  fix: {f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="hybridtune doctor", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="preset name or local checkpoint directory")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args(argv)
    if args.json:  # keep stdout for the JSON object: log lines and anything a library prints go to stderr
        logging.getLogger("hybridtune").handlers[:] = [logging.StreamHandler(sys.stderr)]
        with contextlib.redirect_stdout(sys.stderr):
            d = diagnose(args.model)
    else:
        d = diagnose(args.model)
    if args.json:
        json.dump(d, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    else:
        print(render(d))
    return 0
