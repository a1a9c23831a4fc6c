"""What an export carries over from the source checkpoint, and how a model is written in the source's form.

A fine-tuned model is written as the checkpoint it came from: its original architecture and config (the model is
loaded in its original class, so `save_pretrained` writes that tree), every tensor in the dtype the source saved it
in, and every tensor training never touched copied bit for bit from the source's safetensors: the frozen ones (a
vision tower) and those transformers does not load at all (the multi-token-prediction `mtp.*` weights that serving
stacks use for speculative decoding). The source's processor and chat-template files come along. The weights always
get an index (`model.safetensors.index.json`) listing every tensor. Source tensors are read with safetensors only
(nothing that runs code).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterable
from fnmatch import fnmatch
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from hybridtune.errors import ModelError
from hybridtune.models.patching import original_config

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Files of the source beside the weights that a user of the fine-tuned model needs (what processes images and
# video, the chat template, generation defaults, the licence); never code (`*.py`).
CARRIED_FILES = (
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "*processor_config.json",
    "chat_template.*",
    "generation_config.json",
    "LICENSE*",
    "NOTICE*",
)
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def weight_map(ckpt_dir: Path | None) -> dict[str, str]:
    """Every tensor a checkpoint directory saves, by key, with the safetensors file holding it (relative name);
    empty for None or a directory without safetensors weights."""
    if ckpt_dir is None:
        return {}
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / INDEX_FILE
    if index.is_file():
        return dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    single = ckpt_dir / SINGLE_FILE
    if not single.is_file():
        return {}
    with safe_open(str(single), "pt") as f:
        return dict.fromkeys(f.keys(), SINGLE_FILE)


def check_weight_files(ckpt_dir: Path) -> None:
    """A ModelError (one line) unless every tensor the checkpoint's index lists is in the file it names: an export
    reads them all back (the untouched ones bit for bit), so an index that lists what its files lack would otherwise
    fail only after training, at the export. Reads the safetensors headers only."""
    try:
        files = weight_map(ckpt_dir)
        for file, keys in _by_file(files).items():
            path = Path(ckpt_dir) / file
            if not path.is_file():
                raise ModelError(
                    f"checkpoint '{ckpt_dir}': its {INDEX_FILE} lists tensors (e.g. {keys[0]}) in {file}, which does "
                    "not exist; download or copy the checkpoint again"
                )
            with safe_open(str(path), "pt") as f:
                held = set(f.keys())
            absent = [k for k in keys if k not in held]
            if absent:
                raise ModelError(
                    f"checkpoint '{ckpt_dir}': its {INDEX_FILE} lists {len(absent)} tensor(s) (e.g. {absent[0]}) in "
                    f"{file}, which does not hold them; download or copy the checkpoint again, or fix the index"
                )
    except ModelError:
        raise
    except (SafetensorError, OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelError(
            f"checkpoint '{ckpt_dir}': its weight files or {INDEX_FILE} cannot be read ({type(e).__name__}: {e}); "
            "download or copy it again"
        ) from None


def saved_dtypes(ckpt_dir: Path | None) -> dict[str, torch.dtype]:
    """The dtype each tensor is saved in (read from the safetensors headers: no tensor data is read)."""
    out: dict[str, torch.dtype] = {}
    for file, keys in _by_file(weight_map(ckpt_dir)).items():
        with safe_open(str(Path(ckpt_dir) / file), "pt") as f:
            for k in keys:
                dtype = _DTYPES.get(f.get_slice(k).get_dtype())
                if dtype is not None:
                    out[k] = dtype
    return out


def read_tensors(ckpt_dir: Path, keys: Iterable[str], files: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """The saved tensors of `keys`, exactly as stored (dtype and bytes)."""
    files = weight_map(ckpt_dir) if files is None else files
    out = {}
    for file, names in _by_file({k: files[k] for k in keys}).items():
        with safe_open(str(Path(ckpt_dir) / file), "pt") as f:
            for k in names:
                out[k] = f.get_tensor(k)
    return out


def _by_file(files: dict[str, str]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for k, file in files.items():
        grouped.setdefault(file, []).append(k)
    return grouped


def frozen_names(model: torch.nn.Module) -> set[str]:
    """The names of the parameters training did not touch (requires_grad off), tied names included."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def source_state(
    state: dict[str, torch.Tensor],
    source_dir: Path | None,
    dtype: torch.dtype,
    untouched: set[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """`state` (the model's own keys) as the export writes it: every floating tensor in the dtype the source saved
    it in (`dtype` for one the source does not hold under that key, e.g. MoE experts transformers fuses on load),
    and every `untouched` one the source holds under its own key and shape read back from the source. Tied
    tensors stay one tensor (save_pretrained then writes them once)."""
    dtypes = saved_dtypes(source_dir)
    files = weight_map(source_dir)
    wanted = [k for k in state if k in untouched and k in files]
    original = read_tensors(source_dir, wanted, files) if wanted else {}
    cast: dict[tuple, torch.Tensor] = {}
    out = {}
    for k, t in state.items():
        src = original.get(k)
        if src is not None and src.shape == t.shape:
            out[k] = src
            continue
        if not t.is_floating_point():
            out[k] = t
            continue
        memo = (t.data_ptr(), tuple(t.shape), t.dtype, dtypes.get(k, dtype)) if t.device.type != "meta" else id(t)
        if memo not in cast:
            cast[memo] = t.detach().to(dtypes.get(k, dtype))
        out[k] = cast[memo]
    return out


def set_config_dtype(out_dir: Path, dtype: torch.dtype) -> None:
    """config.json's `dtype` (and its sub-configs' where they state one) = the dtype the weights are written in."""
    path = Path(out_dir) / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name
    for sub in config.values():
        if isinstance(sub, dict) and "dtype" in sub:
            sub["dtype"] = name
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def carry_untouched(out_dir: Path, source_dir: Path | None) -> list[str]:
    """Copy into `out_dir` (a saved model) every tensor of the source that it lacks (`mtp.*` and whatever else
    transformers does not load), bit for bit, as one more shard; rewrite the index so it lists every tensor
    (an index is written even for one file). Returns the keys copied."""
    out_dir = Path(out_dir)
    written = weight_map(out_dir)
    files = weight_map(source_dir)
    if source_dir is not None and not files:
        logger.warning(
            "source checkpoint %s has no safetensors weights: tensors it holds that transformers does not load "
            "(mtp.*) are not carried into the export",
            source_dir,
        )
    missing = sorted(k for k in files if k not in written)
    shards = sorted(set(written.values()))
    n = len(shards) + (1 if missing else 0)
    rename = {old: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, old in enumerate(shards)}
    if n == 1:
        rename = {old: SINGLE_FILE for old in shards}
    for old, new in rename.items():
        if old != new:
            (out_dir / old).rename(out_dir / new)
    mapping = {k: rename[f] for k, f in written.items()}
    if missing:
        extra = f"model-{n:05d}-of-{n:05d}.safetensors"
        save_file(read_tensors(source_dir, missing, files), str(out_dir / extra), metadata={"format": "pt"})
        mapping.update(dict.fromkeys(missing, extra))
        logger.info("carried %d tensors of the source that training never loaded (e.g. %s)", len(missing), missing[0])
    total = sum(_data_bytes(out_dir / f) for f in set(mapping.values()))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(mapping.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return missing


def _data_bytes(path: Path) -> int:
    """The tensor bytes of a safetensors file: its size less the 8-byte header length and the JSON header."""
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return path.stat().st_size - 8 - header


def weight_bytes(ckpt_dir: Path | None) -> int:
    """The bytes of a checkpoint's safetensors files (0 for None or none)."""
    return sum((Path(ckpt_dir) / f).stat().st_size for f in set(weight_map(ckpt_dir).values())) if ckpt_dir else 0


def carry_files(out_dir: Path, source_dir: Path | None) -> list[str]:
    """Copy the source's processor, chat-template, generation and licence files (CARRIED_FILES) that `out_dir`
    does not already hold (what the run wrote, e.g. its tokenizer's chat template, wins). Links (a hub cache's
    snapshot) are followed; only regular files are copied."""
    if source_dir is None:
        return []
    source_dir = Path(source_dir)
    # Links may lead into the source directory, or (a hub snapshot) into its repository's blobs/; a link anywhere
    # else (LICENSE -> ~/.ssh/id_rsa in a model directory someone handed over) is not copied into what is shared.
    roots = [source_dir.resolve()]
    if source_dir.parent.name == "snapshots":
        roots.append(source_dir.parent.parent.resolve())
    copied = []
    for src in sorted(source_dir.iterdir()):
        if not any(fnmatch(src.name, pat) for pat in CARRIED_FILES) or not src.is_file():
            continue
        real = src.resolve()
        if not any(real == root or root in real.parents for root in roots):
            logger.warning("not carried: %s links outside the source checkpoint (to %s)", src, real)
            continue
        dst = Path(out_dir) / src.name
        if dst.exists():
            continue
        shutil.copyfile(src, dst)
        copied.append(src.name)
    return copied


def save_like_source(
    model: torch.nn.Module,
    out_dir: Path,
    state: dict[str, torch.Tensor],
    source_dir: Path | None,
    dtype: torch.dtype,
    untouched: set[str] = frozenset(),
) -> None:
    """Write `model` (its original class) into `out_dir` as its source checkpoint is written: `state` (the model's
    keys, e.g. a gathered FSDP2 state) through `source_state`, config.json stating `dtype`, the source tensors the
    model never loaded, the index. (The tokenizer and `carry_files` are the caller's.)"""
    state = source_state(state, source_dir, dtype, untouched)
    with original_config(model):  # use_cache as the source had it, not off as training turns it
        model.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
    set_config_dtype(out_dir, dtype)
    carry_untouched(out_dir, source_dir)
