"""Adapters that serving engines apply. vLLM and SGLang pack some projections of a layer into one module and stack
the LoRA of its members (facts, files and repositories in docs/RUNS.md, "Serving adapters"): an adapter that adapts
only some members of a packed group is completed with zero LoRA for the others (both factors zero: the model is
unchanged), so that every engine version finds each slice it stacks; what an engine does not apply to an adapter at
all is one warning line naming the engine and the group (`Plan.notes`), also written into the model card.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridtune.files import atomic_write_bytes, atomic_write_text
from hybridtune.models.anatomy import text_config, text_model, unwrap
from hybridtune.runtime.lora import target_regex

PEFT_PREFIX = "base_model.model."  # of every key in a saved adapter
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
# engine -> family -> the engine's module -> the checkpoint's (transformers') modules whose LoRA it stacks, as the
# engine runs with LoRA enabled (vLLM then keeps Qwen3.5's linear-attention in_proj_qkv and in_proj_z apart).
PACKED: dict[str, dict[str, dict[str, tuple[str, ...]]]] = {
    "vLLM": {
        "qwen3_5": {"qkv_proj": QKV, "gate_up_proj": GATE_UP, "in_proj_ba": ("in_proj_b", "in_proj_a")},
        "qwen3_next": {"qkv_proj": QKV, "gate_up_proj": GATE_UP},
    },
    "SGLang": {
        "qwen3_5": {
            "qkv_proj": QKV,
            "gate_up_proj": GATE_UP,
            "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
            "in_proj_ba": ("in_proj_b", "in_proj_a"),
        },
        "qwen3_next": {"qkv_proj": QKV, "gate_up_proj": GATE_UP},
    },
}
# (engine, family) -> its packed module -> why LoRA on it is not applied there.
NOT_APPLIED: dict[tuple[str, str], dict[str, str]] = {
    ("SGLang", "qwen3_5"): {
        "in_proj_ba": "not among its supported_lora_modules (docs/RUNS.md)",
        "in_proj_qkvz": "its loader maps no split in_proj_qkv/in_proj_z LoRA onto it (docs/RUNS.md)",
    },
}
# transformers' model_type (of the text config) -> the family the engines' model files implement.
FAMILIES = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5",
    "qwen3_next": "qwen3_next",
}


@dataclass(frozen=True)
class Plan:
    """What serving makes of an adapter: `adapted` (last names of the LoRA-adapted Linear layers of the text model),
    `added` (members of the packed groups it touches, completed with zero LoRA), `notes` (one line each: what an
    engine does not apply)."""

    family: str | None
    adapted: tuple[str, ...]
    added: tuple[str, ...]
    notes: tuple[str, ...]


def _linears(model: torch.nn.Module) -> tuple[set[str], set[str]]:
    """(adapted, plain): last names of the text model's LoRA-wrapped layers over a Linear and of its plain Linears."""
    adapted, plain = set(), set()
    for name, m in text_model(unwrap(model)).named_modules():
        leaf = name.rsplit(".", 1)[-1]
        base = m.get_base_layer() if hasattr(m, "lora_A") and hasattr(m, "get_base_layer") else None
        if isinstance(base, torch.nn.Linear):
            adapted.add(leaf)
        elif isinstance(m, torch.nn.Linear) and leaf != "base_layer":
            plain.add(leaf)
    return adapted, plain


def plan(model: torch.nn.Module) -> Plan:
    """The serving plan of the LoRA adapter in `model` (a peft model, or a base with LoRA layers injected)."""
    family = FAMILIES.get(getattr(text_config(model), "model_type", None))
    adapted, plain = _linears(model)
    added, notes = set(), []
    for engine, families in PACKED.items():
        for packed, members in families.get(family, {}).items():
            touched = sorted(adapted & set(members))
            if not touched:
                continue
            added |= {m for m in members if m not in adapted and m in plain}
            why = NOT_APPLIED.get((engine, family), {}).get(packed)
            if why is not None:
                notes.append(
                    f"{engine}: no LoRA on {packed} (its packing of {' + '.join(members)}), {why}: this adapter's "
                    f"{', '.join(touched)} LoRA does not apply there; serve it with vLLM, or merged (hybridtune merge)"
                )
    return Plan(family, tuple(sorted(adapted)), tuple(sorted(added)), tuple(notes))


def zero_lora(peft_model, added: tuple[str, ...], like: torch.Tensor) -> tuple[dict[str, torch.Tensor], str | None]:
    """(tensors, regex): zero lora_A/lora_B (rank of the adapter, dtype of `like`) for every plain Linear of the text
    model named in `added`, keyed as peft saves them, and the regex that makes peft adapt exactly those on load."""
    if not added:
        return {}, None
    base = unwrap(peft_model)
    regex = target_regex(base, list(added))
    r = peft_model.peft_config["default"].r
    tensors = {}
    for name, m in base.named_modules():
        if isinstance(m, torch.nn.Linear) and re.fullmatch(regex, name):
            key = f"{PEFT_PREFIX}{name}"
            tensors[f"{key}.lora_A.weight"] = torch.zeros(r, m.in_features, dtype=like.dtype)
            tensors[f"{key}.lora_B.weight"] = torch.zeros(m.out_features, r, dtype=like.dtype)
    return tensors, regex


def complete_saved(adapter_dir: Path, zeros: dict[str, torch.Tensor], regex: str | None) -> None:
    """Add `zeros` to the adapter peft saved in `adapter_dir` (inside the guarded temporary directory) and extend its
    `target_modules` by `regex`, each file rewritten atomically."""
    if not zeros:
        return
    from safetensors.torch import load_file, save

    weights = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(weights)
    tensors.update(zeros)
    atomic_write_bytes(weights, save(tensors, metadata={"format": "pt"}))
    config_file = adapter_dir / "adapter_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    old = config.get("target_modules")
    if isinstance(old, str) and old:
        config["target_modules"] = f"(?:{old})|(?:{regex})"
    else:  # a list (or none): peft matches each entry as a full name or a name's end
        names = [k.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight") for k in zeros if "lora_A" in k]
        config["target_modules"] = sorted({*(old or []), *names})
    atomic_write_text(config_file, json.dumps(config, indent=2, sort_keys=True) + "\n")
