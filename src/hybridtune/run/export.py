"""The final model: the adapter (with the preset's base weights when they exist only in memory) or the full model,
with its tokenizer and a model card (README.md), written atomically as safetensors that transformers and peft load.

- Form. A full fine-tune is written as its source checkpoint is (models/source.py): the original architecture and
  config, the source's dtype, every tensor training did not touch copied bit for bit (a frozen vision tower, the
  `mtp.*` weights transformers never loads), the source's processor and chat-template files. An adapter's keys
  follow the original tree; `base_model_name_or_path` is the base as the user named it (a hub id, with its
  `revision`, or the checkpoint directory), for a preset the `base_model/` written beside `final/`, relative to the
  adapter (run/adapter_base.py). A QLoRA run's base_model/ holds its NF4 weights dequantised (runtime/quant.py).

- Guarded (run/guarded.py): modes follow the umask (safetensors writes 0600); NaN or Inf weights are refused and
  the size (tensors plus tokenizer) checked against the free space before anything is written; a disk that fills
  midway is one line (`DiskFullError`) naming the last checkpoint, which is intact (a run resumed from it at its
  last step only evaluates and exports); the partial directory, or one a killed export left, is removed.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from hybridtune.files import atomic_write_text
from hybridtune.models import source
from hybridtune.models.anatomy import text_model, unwrap
from hybridtune.models.loading import LoadedModel
from hybridtune.models.patching import original_config
from hybridtune.run import adapter_base, disk, guarded, serving
from hybridtune.run import checkpoint as ckpt
from hybridtune.runtime import distributed, quant
from hybridtune.runtime.adapter_kind import AdapterKind
from hybridtune.runtime.lora import strip_base_layer

logger = logging.getLogger(__name__)

FINAL_DIR = ckpt.FINAL_DIR
BASE_DIR = adapter_base.BASE_DIR
INFO_FILE = ckpt.FINAL_META
QUANT = quant.QUANTIZATION
TOKENIZER_BYTES_PER_TOKEN = 96  # tokenizer.json (+ vocab/merges where written): about 75 bytes a token for Qwen's


def gathered_state(engine: torch.nn.Module, model: torch.nn.Module, d: distributed.Dist) -> dict | None:
    """Under FSDP2: the whole model's state dict on rank 0, on the CPU (a collective; empty on other ranks).
    Otherwise None: the model in memory is whole."""
    if d.engine != "fsdp":
        return None
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(engine, options=opts)
    # Tied weights (lm_head = embed_tokens) come back as two tensors; keep the first name, as the model's own
    # state_dict + save_pretrained would.
    seen, tied = set(), set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.add(id(p))
    state = {k.removeprefix("model."): v for k, v in state.items()}  # LossModule's prefix
    return {k: v for k, v in state.items() if k not in tied}


def unwrapped_base_state(base, peft_state: dict | None = None) -> dict:
    """The frozen base weights without LoRA layers: peft keeps the original Linear as `base_layer`.

    `peft_state`: the gathered state dict of the whole peft model (FSDP2), in place of `base`'s own.
    """
    prefix = "base_model.model."
    if peft_state is None:
        items = base.state_dict().items()
    else:
        items = ((k.removeprefix(prefix), v) for k, v in peft_state.items() if k.startswith(prefix))
    return {strip_base_layer(name): tensor for name, tensor in items if "lora_" not in name}


def _serving(model, adapter_state: dict) -> tuple[dict, str | None]:
    """The zero LoRA that completes each packed group the adapter touches (run/serving.py), and the regex that adds
    them to its target_modules; each engine's group it leaves out said in one line."""
    served = serving.plan(model)
    for note in served.notes:
        logger.warning("%s", note)
    like = next(iter(adapter_state.values()), torch.zeros(()))
    zeros, regex = serving.zero_lora(model, served.added, like)
    if zeros:
        logger.info(
            "serving engines stack packed projections (vLLM, SGLang): %s completed with zero LoRA (%d modules; the "
            "model is unchanged)", ", ".join(served.added), len(zeros) // 2,
        )  # fmt: skip
    return zeros, regex


# -- sizes and disk space ---------------------------------------------------------------------------------------


def tensor_bytes(state: dict, dtype: torch.dtype | None = None) -> int:
    """The bytes a safetensors file of `state` holds (its floating tensors in `dtype`, when given): each tensor's
    data once (tied weights share one), plus its header entry and some slack."""
    seen, total = set(), disk.SLACK_BYTES
    for t in state.values():
        if not isinstance(t, torch.Tensor):
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        ptr = local.data_ptr() if local.device.type != "meta" else 0
        key = (ptr, tuple(local.shape), local.dtype) if ptr else id(t)
        if key in seen:
            continue
        seen.add(key)
        size = dtype.itemsize if dtype is not None and local.is_floating_point() else local.element_size()
        total += local.numel() * size + disk.ENTRY_BYTES
    return total


def tokenizer_bytes(tokenizer) -> int:
    try:
        return len(tokenizer) * TOKENIZER_BYTES_PER_TOKEN
    except TypeError:
        return 0


def disk_full_message(out: Path, what: str, need: int, free: int | None, previous: Path | None) -> str:
    has = f"{disk.gib(free)} free" if free is not None else "no space left"
    if previous is not None:
        kept = f"the last checkpoint {previous.name} is intact"
        then = (
            "run again with --resume_from_checkpoint latest, which finishes the run (a run resumed at its last "
            "step only evaluates and exports)"
        )
    else:
        kept, then = "no checkpoint was saved", "run again"
    return (
        f"disk full: exporting {what} needs about {disk.gib(need)} and '{out}' has {has}; {kept}. Free some "
        f"space (or use an output_dir on a larger disk) and {then}"
    )


def _write_all(out: Path, parts: list[tuple[Path, int, Callable[[Path], None]]], previous: Path | None) -> None:
    """Write each `(target, bytes, write)` through the guarded layer, after checking that all of them fit; a write
    that runs out of space becomes DiskFullError, its partial temporary directory removed."""
    need = sum(n for _, n, _ in parts)
    what = " and ".join(f"{t.name}/" for t, _, _ in parts)
    out.mkdir(parents=True, exist_ok=True)

    def message(free: int | None) -> str:
        return disk_full_message(out, what, need, free, previous)

    guarded.check_space(out, need, message)
    for target, n, write in parts:  # each checked again for its own size (the one before took its share)
        guarded.atomic_dir(target, write, n, message)


def save_final(
    out: Path,
    model: torch.nn.Module,
    engine: torch.nn.Module,
    tokenizer,
    d: distributed.Dist,
    *,
    kind: AdapterKind,
    loaded: LoadedModel,
    steps: int,
    card: str | None = None,
) -> Path:
    """`out/final`: the model (adapter or full) with its tokenizer, loadable by peft / transformers in the
    original class, and `card` as its README.md; for an adapter on a preset (`loaded.random_init`), the base weights
    beside it in `out/base_model`. Every rank calls it (FSDP2 gathers); rank 0 writes."""
    full = gathered_state(engine, model, d)
    final = out / FINAL_DIR

    def export() -> None:  # rank 0
        parts = []
        tok = tokenizer_bytes(tokenizer)
        base_dir = None
        quantized = kind.lora and quant.is_quantized(model)
        if kind.lora and loaded.source_dir is None:
            # A preset's base weights exist only in memory: save them so the adapter can be loaded and merged.
            base_dir = out / BASE_DIR
            base = model.get_base_model()
            base_state = unwrapped_base_state(base, full)
            if quantized:  # a QLoRA base: its NF4 weights dequantised into the dtype the rest of it is held in
                base_state = quant.dequantized_state(base_state, text_model(base).embed_tokens.weight.dtype)

            def write_base(tmp: Path) -> None:
                with original_config(base):
                    base.save_pretrained(tmp, state_dict=base_state, safe_serialization=True)
                tokenizer.save_pretrained(tmp)

            guarded.refuse_non_finite(base_state, "the base model", base_dir)
            parts.append((base_dir, tensor_bytes(base_state) + tok, write_base))
        if kind.lora:
            from peft import get_peft_model_state_dict

            adapter_state = get_peft_model_state_dict(model, state_dict=full)
            guarded.refuse_non_finite(adapter_state, "the adapter", final)
            zeros, regex = _serving(model, adapter_state)
            weights = tensor_bytes(adapter_state) + tensor_bytes(zeros)
        else:
            state = full if full is not None else unwrap(model).state_dict()
            guarded.refuse_non_finite(state, "the model", final)
            weights = max(tensor_bytes(state, loaded.source_dtype), source.weight_bytes(loaded.source_dir))

        def write(tmp: Path) -> None:
            if kind.lora:
                config = model.peft_config["default"]
                config.base_model_name_or_path, config.revision = adapter_base.record(loaded, base_dir, final)
                # peft's "auto" embedding check looks the base up and warns when it cannot (offline); hybridtune never
                # resizes the vocabulary, so the warning says nothing. (save_embedding_layers=False left a rank of a
                # two-process LoRA run hanging at exit in the slow tier: kept as peft's default.)
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="Could not find a config file")
                    model.save_pretrained(
                        tmp, safe_serialization=True, **({"state_dict": full} if full is not None else {})
                    )
                serving.complete_saved(tmp, zeros, regex)
            else:
                frozen = source.frozen_names(unwrap(model))
                source.save_like_source(unwrap(model), tmp, state, loaded.source_dir, loaded.source_dtype, frozen)
            tokenizer.save_pretrained(tmp)
            source.carry_files(tmp, loaded.source_dir)
            info = {"base_model": loaded.name, "revision": loaded.revision, "adapter": kind.adapter, "steps": steps}
            if quantized:  # the adapter trained on the NF4 base: `merge` folds it into that base's values
                info["base_quantization"] = QUANT
            atomic_write_text(tmp / INFO_FILE, json.dumps(info, indent=2))
            if card is not None:
                atomic_write_text(tmp / "README.md", card)

        parts.append((final, weights + tok, write))
        done = ckpt.list_checkpoints(out)
        _write_all(out, parts, done[-1] if done else None)
        logger.info("saved final %s to %s", "adapter" if kind.lora else "model", final)

    # Rank 0 writes; its error (a full disk) is raised on every rank rather than leaving the others waiting.
    distributed.main_only(d, export)
    return final
