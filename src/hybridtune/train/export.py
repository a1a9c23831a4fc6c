"""The final model: the adapter (with the preset's base weights when they exist only in memory) or the full model,
with its tokenizer, written atomically as safetensors that transformers and peft load."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from hybridtune.train import checkpoint as ckpt
from hybridtune.train import distributed

logger = logging.getLogger(__name__)

FINAL_DIR = ckpt.FINAL_DIR
BASE_DIR = "base_model"
INFO_FILE = ckpt.FINAL_META


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


def save_unwrapped_base(base, tmp: Path, peft_state: dict | None = None) -> None:
    """Save the frozen base weights without LoRA layers: peft keeps the original Linear as `base_layer`.

    `peft_state`: the gathered state dict of the whole peft model (FSDP2), in place of `base`'s own.
    """
    prefix = "base_model.model."
    if peft_state is None:
        items = base.state_dict().items()
    else:
        items = ((k.removeprefix(prefix), v) for k, v in peft_state.items() if k.startswith(prefix))
    state = {}
    for name, tensor in items:
        if "lora_" in name:
            continue
        state[name.replace(".base_layer.", ".")] = tensor
    base.save_pretrained(tmp, state_dict=state, safe_serialization=True)


def save_final(
    out: Path,
    model: torch.nn.Module,
    engine: torch.nn.Module,
    tokenizer,
    d: distributed.Dist,
    *,
    adapter: str,
    base_name: str,
    base_in_memory: bool,
    steps: int,
) -> Path:
    """`out/final`: the model (adapter or full) with its tokenizer, loadable by peft / transformers; for an adapter
    on a preset (`base_in_memory`), the base weights beside it in `out/base_model`. Every rank calls it (FSDP2
    gathers); rank 0 writes."""
    full = gathered_state(engine, model, d)
    if not d.is_main:
        distributed.barrier(d)
        return out / FINAL_DIR
    base_dir = None
    if adapter == "lora" and base_in_memory:
        # A preset's base weights exist only in memory: save them so the adapter can be loaded and merged.
        base_dir = out / BASE_DIR
        base = model.get_base_model()

        def write_base(tmp: Path) -> None:
            save_unwrapped_base(base, tmp, full)
            tokenizer.save_pretrained(tmp)

        ckpt.atomic_dir(base_dir, write_base)

    def write(tmp: Path) -> None:
        if base_dir is not None:
            model.peft_config["default"].base_model_name_or_path = str(base_dir.resolve())
        kw = {"state_dict": full} if full is not None else {}
        model.save_pretrained(tmp, safe_serialization=True, **kw)
        tokenizer.save_pretrained(tmp)
        info = {"base_model": base_name, "adapter": adapter, "steps": steps}
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2))

    final = ckpt.atomic_dir(out / FINAL_DIR, write)
    logger.info("saved final %s to %s", "adapter" if adapter == "lora" else "model", final)
    distributed.barrier(d)
    return final
