"""Fold a LoRA adapter into its base and save safetensors (`hybridtune merge`, infer/merge_command.py).

The base loads in its original class (config.json `architectures[0]`, e.g. Qwen3_5ForConditionalGeneration), the
class the adapter's keys follow. The result is written as the base checkpoint is (models/source.py): its
architecture and config, in its dtype, with the tensors transformers does not load (`mtp.*`) and its processor
files carried over; it loads with `from_pretrained(OUT_DIR)` in that class and gives the logits of base + adapter.
The base is a `base_model/` shipped inside or beside the adapter (what training writes for a preset), else the
adapter's `base_model_name_or_path` (a directory, or a hub id at its `revision` from the local hub cache). The output
is written through the guarded layer (run/guarded.py): NaN or Inf weights refused and the size checked before anything
is written, modes per the umask, a damaged base, a shape mismatch or a full disk one line, SIGTERM removes the
temporary directory (`.tmp-<OUT>-*` beside OUT), and one a killed merge left is removed by the next merge to OUT.
A QLoRA adapter (recorded in its hybridtune.json or its card's `qlora` tag; else `--base_quantization nf4`, and a
warning when neither says) is folded into its base's values through NF4 (the base it trained on), in the base's
dtype; a base weight that already holds NF4's values (a QLoRA run's base_model/) is kept, read from the weights.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import yaml
from safetensors import SafetensorError

from hybridtune.errors import ModelError, OutputDirError
from hybridtune.files import atomic_write_text, open_regular
from hybridtune.models import source
from hybridtune.models.anatomy import text_model
from hybridtune.models.hub import looks_like_hub_id, resolve_source
from hybridtune.models.loading import model_class
from hybridtune.models.trust import NO_CODE, refuse_custom_code
from hybridtune.run import disk, guarded
from hybridtune.run.adapter_base import adapter_base
from hybridtune.run.card import QLORA_TAG
from hybridtune.run.checkpoint import FINAL_META, MARKER, is_ours
from hybridtune.run.export import BASE_DIR, tensor_bytes, tokenizer_bytes
from hybridtune.run.targets import refuse_run_part, refuse_system_dir
from hybridtune.runtime import quant

logger = logging.getLogger(__name__)


def resolve_base(adapter_dir: Path, config_file: Path, base_name, revision: str | None) -> Path:
    """The local directory of the adapter's base (run/adapter_base.py): the `base_model/` shipped inside or beside
    the adapter first (saying so when the record names another), else the recorded directory, else the recorded hub
    id from the local hub cache."""
    base = adapter_base(adapter_dir, base_name, config_file)
    if Path(base).is_dir():
        return Path(base)
    if looks_like_hub_id(base):
        return resolve_source(base, revision).path  # a download that cannot happen is one line (ModelError)
    raise ModelError(
        f"the adapter's base model {base_name!r} is not a local directory (nor a hub id), and no {BASE_DIR}/ is "
        f"beside the adapter; edit base_model_name_or_path in {config_file}"
    )


def merge(
    adapter_dir: str | Path, out_dir: str | Path, overwrite: bool = False, base_quantization: str | None = None
) -> Path:
    """Merge the adapter of `adapter_dir` into its base and write the model to `out_dir` (see the module docstring).
    `base_quantization` ("nf4" or "none"): what the adapter trained on, when it records none (or to override it).
    SIGTERM stops it as Ctrl-C does, leaving nothing behind."""
    with guarded.interruptible():
        return _merge(Path(adapter_dir), Path(out_dir), overwrite, base_quantization)


def _merge(adapter_dir: Path, out_dir: Path, overwrite: bool, base_quantization: str | None = None) -> Path:
    from peft import PeftConfig, PeftModel
    from transformers import AutoTokenizer

    config_file = adapter_dir / "adapter_config.json"
    if not config_file.is_file():
        raise ModelError(
            f"'{adapter_dir}' has no adapter_config.json; give the adapter directory (e.g. OUTPUT_DIR/final)"
        )
    check_out_dir(out_dir, overwrite)
    recorded = read_adapter_config(config_file)
    revision = recorded.get("revision") if isinstance(recorded.get("revision"), str) else None
    base_path = resolve_base(adapter_dir, config_file, recorded.get("base_model_name_or_path"), revision)
    check_replaceable(out_dir, {"the adapter": adapter_dir, "its base model": base_path})
    refuse_custom_code(adapter_dir)  # (the adapter's own JSON files, as its base's: models/trust.py)
    try:
        PeftConfig.from_pretrained(str(adapter_dir))
    except (ValueError, TypeError, KeyError) as e:  # an unknown peft_type or field
        raise ModelError(f"{config_file}: not a LoRA adapter config peft can read ({type(e).__name__}: {e})") from None
    refuse_custom_code(base_path)
    base = _load_base(base_path)
    dtype = text_model(base).embed_tokens.weight.dtype
    if _through_nf4(adapter_dir, base_quantization):
        n, kept = quant.roundtrip_targets(base)
        logger.info("QLoRA adapter: %d base weights through NF4 and back (the values it trained on), in %s%s", n,
                    dtype, f"; {kept} held NF4's values already" if kept else "")  # fmt: skip
        if n and (base_path / quant.LEGACY_MARKER).is_file():
            logger.warning(
                "%s says this base holds NF4's values already, but %d of its %d quantised weights do not: they went "
                "through NF4 as training did (the file is ignored: whether a base holds NF4's values is read from "
                "its weights alone)",
                base_path / quant.LEGACY_MARKER, n, n + kept,
            )  # fmt: skip
    try:
        model = PeftModel.from_pretrained(base, str(adapter_dir))
    except (OSError, ValueError, KeyError, RuntimeError, TypeError, SafetensorError) as e:  # missing, mismatched
        raise ModelError(f"cannot load the adapter in '{adapter_dir}' onto '{base_path}': {_first(e)}") from None
    merged = model.merge_and_unload()
    tok_dir = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base_path
    refuse_custom_code(tok_dir)
    has_tokenizer = (tok_dir / "tokenizer_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), **NO_CODE) if has_tokenizer else None
    state = merged.state_dict()
    guarded.refuse_non_finite(state, "the merged model", out_dir)
    need = max(tensor_bytes(state, dtype), source.weight_bytes(base_path)) + tokenizer_bytes(tokenizer)

    def write(tmp: Path) -> None:
        source.save_like_source(merged, tmp, state, base_path, dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        source.carry_files(tmp, base_path)
        atomic_write_text(
            tmp / "hybridtune.json", json.dumps({"merged_from": str(adapter_dir), "base": str(base_path)}, indent=2)
        )

    def message(free: int | None) -> str:
        has = f"{disk.gib(free)} free" if free is not None else "no space left"
        where = guarded.free_space_at(out_dir.parent)
        return (
            f"disk full: the merged model needs about {disk.gib(need)} and '{where}' has {has}; nothing was "
            "written. Free some space or give an OUT_DIR on a larger disk"
        )

    guarded.atomic_dir(out_dir, write, need, message)
    logger.info("merged %s into %s -> %s", adapter_dir, base_path, out_dir)
    return out_dir


def trained_on_nf4(adapter_dir: Path) -> bool:
    """Whether the adapter trained on a 4-bit NF4 base (`recorded_quantization`)."""
    return recorded_quantization(adapter_dir) == quant.QUANTIZATION


def recorded_quantization(adapter_dir: Path) -> str | None:
    """What base the adapter records it trained on: "nf4" (QLoRA) or "none", or None where it records nothing (a
    bare peft adapter). The records, the adapter's own (whoever can write them can write its weights too, so they are
    trusted as the adapter is): final/hybridtune.json's `base_quantization` (its absence there: "none"), and the
    model card's `qlora` tag (README.md's front matter, which travels with the adapter to the hub). Whether the base
    already holds NF4's values is read from its weights (`quant.roundtrip_targets`)."""
    info = adapter_dir / FINAL_META
    try:
        recorded = json.loads(info.read_text(encoding="utf-8")) if info.is_file() else None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise ModelError(f"{info}: not the JSON training wrote; restore it or remove it") from None
    if isinstance(recorded, dict) and recorded.get("base_quantization") == quant.QUANTIZATION:
        return quant.QUANTIZATION
    if QLORA_TAG in card_tags(adapter_dir / "README.md"):
        return quant.QUANTIZATION
    return "none" if isinstance(recorded, dict) else None


def card_tags(readme: Path) -> list[str]:
    """The `tags` of a model card's YAML front matter (the hub's metadata); [] when there is none or it is not
    YAML (read from the card's first 64 KiB, as plain data)."""
    try:
        with open_regular(readme) as f:
            text = f.read(1 << 16).decode("utf-8", "replace")
    except OSError:
        return []
    head = text.split("\n---", 1)[0] if text.startswith("---") else ""
    try:
        meta = yaml.safe_load(head[3:]) if head else None
    except (yaml.YAMLError, RecursionError):
        return []
    tags = meta.get("tags") if isinstance(meta, dict) else None
    return [t for t in tags if isinstance(t, str)] if isinstance(tags, list) else []


def _through_nf4(adapter_dir: Path, given: str | None) -> bool:
    """Whether the merge sends the base through NF4: `given` (--base_quantization) or what the adapter records; a
    warning when it records nothing and none was given, or when `given` contradicts the record."""
    recorded = recorded_quantization(adapter_dir)
    if given is not None and recorded is not None and given != recorded:
        logger.warning("--base_quantization %s given, but the adapter %s records %s: merging as given", given,
                       adapter_dir, recorded)  # fmt: skip
    if given is None and recorded is None:
        logger.warning(
            "the adapter %s records no base quantization (no %s, no '%s' tag in its README.md): merged into the "
            "base's own values; if it was trained with QLoRA (load_in_4bit), merge again with --base_quantization "
            "nf4, or the merged model is not the one trained", adapter_dir, FINAL_META, QLORA_TAG,
        )  # fmt: skip
    return (given or recorded) == quant.QUANTIZATION


def _first(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _load_base(base_path: Path):
    """The adapter's base in its original class and saved dtype; a damaged, mismatched or unreadable one is one
    line (ModelError)."""
    from transformers import AutoConfig

    try:
        cls = model_class(AutoConfig.from_pretrained(str(base_path), **NO_CODE))
        return cls.from_pretrained(str(base_path), dtype="auto", **NO_CODE)  # as saved
    except SafetensorError as e:
        raise ModelError(
            f"cannot load the adapter's base model '{base_path}': a weight file is damaged or incomplete ({e}); "
            "download or copy it again"
        ) from None
    except RuntimeError as e:
        if "mismatch" not in str(e):
            raise
        raise ModelError(
            f"cannot load the adapter's base model '{base_path}': the shapes of its weights do not match its "
            "config.json (transformers logged which above); restore its config.json or weights"
        ) from None
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"cannot load the adapter's base model '{base_path}': {_first(e)}") from None


def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse an out_dir that is a file (even with --overwrite: it is not ours to replace), or a non-empty
    directory without --overwrite; before anything is loaded."""
    refuse_system_dir(out_dir, "OUT_DIR")
    refuse_run_part(out_dir, "OUT_DIR")
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputDirError(
            f"'{out_dir}' exists and is not a directory; give a new directory path for the merged model"
        )
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise OutputDirError(
            f"'{out_dir}' already exists and is not empty; choose another directory or pass --overwrite"
        )
    parent = out_dir.parent
    if parent.exists() and not parent.is_dir():
        raise OutputDirError(f"'{out_dir}': '{parent}' is a file; give a directory path for the merged model")


def check_replaceable(out_dir: Path, inputs: dict[str, Path]) -> None:
    """A non-empty out_dir (--overwrite) is replaced whole, so it must be a directory hybridtune wrote (its marker)
    and neither hold nor be what the merge reads (`inputs`: what -> path); before anything is loaded."""
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    target = out_dir.resolve()
    for what, path in inputs.items():
        p = Path(path).resolve()
        if p == target or target in p.parents:
            raise OutputDirError(
                f"'{out_dir}' holds {what} ({path}) that the merge reads; give a new directory for the merged model"
            )
    if not is_ours(out_dir):
        raise OutputDirError(
            f"'{out_dir}' was not written by hybridtune (no {MARKER} marker), and --overwrite replaces the whole "
            "directory; move its files away or give a new directory for the merged model"
        )


def read_adapter_config(config_file: Path) -> dict:
    """adapter_config.json as a mapping; garbled JSON names the file, line and column."""
    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ModelError(
            f"{config_file}: not UTF-8 text; restore the adapter_config.json written at training"
        ) from None
    except json.JSONDecodeError as e:
        raise ModelError(
            f"{config_file}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno}); "
            "restore the adapter_config.json written at training"
        ) from None
    except RecursionError:
        raise ModelError(
            f"{config_file}: nested too deeply to read (not what training writes); restore the adapter_config.json"
        ) from None
    if not isinstance(data, dict):
        raise ModelError(f"{config_file}: expected a JSON object, got {type(data).__name__}")
    return data
