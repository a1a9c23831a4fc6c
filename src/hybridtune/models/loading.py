"""Load a model and its tokenizer: a built-in preset (random weights, said loudly), a local checkpoint directory, or a
hub id resolved through the local hub cache (models.hub).

A checkpoint loads in its original class (config.json `architectures[0]`, e.g. Qwen3_5ForConditionalGeneration with
its vision tower), so state-dict keys, peft adapter keys and `save_pretrained` follow the checkpoint's own tree.
Training touches the text model only: every parameter outside the decoder stack and the output head (the vision
tower) is frozen, also in a full fine-tune, and stays in the dtype it was saved in; `dtype` applies to the text part.
"""

from __future__ import annotations

import logging
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LM

from hybridtune.errors import ModelError
from hybridtune.models.anatomy import output_head, text_model
from hybridtune.models.hub import ModelSource, check_checkpoint_dir, resolve_source
from hybridtune.models.meta import CheckpointReader, PresetReader, fill, skeleton
from hybridtune.models.presets import PRESETS, preset_config
from hybridtune.models.source import check_weight_files
from hybridtune.models.tokenizer_files import bundled_tokenizer
from hybridtune.models.trust import NO_CODE, refuse_custom_code

logger = logging.getLogger(__name__)

# The model classes a checkpoint's `architectures` may name: generative ones (a text head on top).
_GENERATIVE = ("ForCausalLM", "ForConditionalGeneration")


@dataclass
class LoadedModel:
    """A loaded model and where it came from. `name`: the base model as the user named it (preset, path or hub id);
    `source_dir`: the local directory it was read from (a hub snapshot for a hub id; None for a preset);
    `revision`: the commit a hub id resolved to; `source_dtype`: the dtype its text weights were saved in (float32
    for a preset); `random_init`: True for a preset (seeded random weights, not a trained model)."""

    model: torch.nn.Module
    tokenizer: object
    source: str  # "preset" or "checkpoint"
    name: str
    source_dir: Path | None = None
    revision: str | None = None
    source_dtype: torch.dtype = torch.float32
    random_init: bool = False
    # A model built on the meta device (`load_model(meta=True)`): a function that opens what fills it (a
    # `models.meta` Reader), for `materialize`; None once the model holds its values.
    reader: Callable[[], object] | None = None


def _tokenizer_from(path: str, fix: str):
    from transformers import AutoTokenizer

    refuse_custom_code(path)
    try:
        return AutoTokenizer.from_pretrained(path, **NO_CODE)
    except Exception as e:  # transformers raises OSError/ValueError/KeyError for missing or odd files
        raise ModelError(f"'{path}' holds no loadable tokenizer ({type(e).__name__}); {fix}") from None


def load_tokenizer(path: str | None, model_path: str | None):
    if path:
        if not Path(path).is_dir():
            raise ModelError(f"tokenizer directory '{path}' does not exist; give a local directory (no hub downloads)")
        return _tokenizer_from(
            path, "give a tokenizer directory with tokenizer.json and tokenizer_config.json (e.g. the model's own)"
        )
    if model_path is not None:
        return _tokenizer_from(model_path, "set `tokenizer` to a tokenizer directory")
    return bundled_tokenizer()


def _source(base_model: str | ModelSource, revision: str | None) -> ModelSource:
    return base_model if isinstance(base_model, ModelSource) else resolve_source(base_model, revision)


def tokenizer_for(base_model: str | ModelSource, tokenizer_path: str | None = None, revision: str | None = None):
    """The tokenizer a run uses: `tokenizer_path`, else the checkpoint's own (a hub id's from its snapshot), else the
    bundled one for presets."""
    source = _source(base_model, revision)
    return load_tokenizer(tokenizer_path, None if source.path is None else str(source.path))


def _cast_parameters(model: torch.nn.Module, dtype: torch.dtype, params=None) -> None:
    """Parameters (`params`, default all) to `dtype`, buffers untouched (rotary `inv_freq` stays fp32, as
    `from_config(dtype=...)` keeps it); tied weights stay tied (one Parameter, cast once)."""
    with torch.no_grad():
        for p in model.parameters() if params is None else params:
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
    model.config.dtype = dtype


def text_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of the decoder stack and the output head (tied ones once): what training may touch."""
    head = output_head(model)
    params = {id(p): p for p in text_model(model).parameters()}
    if head is not None:
        params.update({id(p): p for p in head.parameters()})
    return list(params.values())


def freeze_non_text(model: torch.nn.Module) -> list[str]:
    """Freeze every parameter outside the text model (a vision tower); returns their names."""
    keep = {id(p) for p in text_parameters(model)}
    frozen = []
    for name, p in model.named_parameters():
        if id(p) not in keep:
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


def model_class(config) -> type:
    """The class a checkpoint was saved from (`architectures[0]`) when transformers has it and it is generative
    (a causal LM or a vision-language model); else AutoModelForCausalLM (by `model_type`). Never remote code.
    A ModelError when `architectures` names a class of another family than `model_type` (a hand-edited config)."""
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if isinstance(cls, type) and archs[0].endswith(_GENERATIVE):
        expected = getattr(cls, "config_class", None)
        if isinstance(expected, type) and not isinstance(config, expected):
            own = CAUSAL_LM.get(config.model_type)
            fix = f'set it to ["{own}"] or remove it' if own else "fix it or remove it"
            raise ModelError(
                f"config.json's architectures names {archs[0]}, a class for {expected.model_type!r} models, but its "
                f"model_type is {config.model_type!r}; {fix}"
            )
        return cls
    return transformers.AutoModelForCausalLM


def pickle_refused(where: str, files: list[str], e: Exception) -> ModelError:
    """The one line for a pickled weight file that torch.load(weights_only=True) refused (it names a Python global
    beside its tensors: loading it could run code)."""
    found = re.search(r"GLOBAL ([\w.]+)", str(e))
    holds = f"{found.group(1)} beside its tensors" if found else "more than tensors"
    return ModelError(
        f"{where}: the pickled weight file {', '.join(files) or '(.bin)'} holds {holds}; hybridtune loads only "
        "safetensors or pickles of plain tensors (torch.load weights_only) and refuses this one; get the weights as "
        "safetensors from their source"
    )


def _load_preset(name: str, tok, seed: int, dtype, meta: bool = False) -> LoadedModel:
    preset = PRESETS[name]
    vocab = len(tok) if preset.uses_bundled_tokenizer else None
    config = preset_config(name, vocab_size=vocab)
    config.pad_token_id = tok.pad_token_id
    config.eos_token_id = tok.eos_token_id
    if len(tok) > config.vocab_size:
        raise ModelError(f"tokenizer has {len(tok)} tokens but preset '{name}' has a vocabulary of {config.vocab_size}")
    logger.warning(
        "base_model '%s' is a preset: its weights are RANDOM (seed %d), a shape for demos, tests and benchmarks, "
        "not a trained model. To fine-tune a real model give a hub id (e.g. Qwen/Qwen3.5-0.8B) or a local "
        "checkpoint directory as base_model",
        name,
        seed,
    )
    # Built on the meta device, then every parameter drawn by transformers' init in its own order (models.meta's
    # PresetReader): the same values whether the whole model is filled here or each rank's shards under FSDP2.
    # The init draws in fp32, then the cast: CPU normal_() in bf16 is several times slower, and a preset's weights
    # are then the same whatever dtype is asked.
    model = skeleton(config)
    loaded = LoadedModel(model, tok, "preset", name, random_init=True, reader=lambda: PresetReader(config, seed))
    if not meta:
        materialize(loaded, model, torch.device("cpu"))
    if dtype is not None and dtype != model.dtype:
        _cast_parameters(model, dtype)
    return loaded


def materialize(loaded: LoadedModel, model: torch.nn.Module, device: torch.device):
    """Give a meta-built model (`model`: `loaded.model` itself, or what wraps it: FSDP2's root) storage on `device`
    and fill it from `loaded.reader`: each parameter's local part (its FSDP2 shard, or the whole tensor), read or
    drawn one block at a time. Returns the `models.meta.FillStats`."""
    sharded = any(hasattr(p, "device_mesh") for p in model.parameters())
    model.to_empty(device=device)
    if not sharded:
        loaded.model.tie_weights()  # to_empty made a new tensor per module holding a tied one
    reader = loaded.reader()
    try:
        stats = fill(loaded.model, reader)
        stats.staged_bytes = max(stats.staged_bytes, getattr(reader, "held_bytes", 0))
    finally:
        reader.close()
    loaded.reader = None
    return stats


def _meta_checkpoint(path: Path, config, cls) -> torch.nn.Module | None:
    """The checkpoint's model on the meta device, each parameter in the dtype it was saved in (as `dtype="auto"`
    loads it); None (said in the log) when its files do not name every parameter as the model does (not safetensors,
    or keys that only transformers' loading converts): that checkpoint loads whole instead."""
    model = skeleton(config, cls)
    try:
        reader = CheckpointReader(path)
    except ModelError as e:
        logger.info("base_model %s: loaded whole, not shard by shard: %s", path, e)
        return None
    try:
        for name, p in model.named_parameters():
            saved = reader.saved(name)
            if saved is None:
                logger.info("base_model %s: loaded whole, not shard by shard: no tensor named '%s'", path, name)
                return None
            dtype, shape = saved
            if shape != tuple(p.shape):
                raise ValueError(  # said as a ModelError by _load_checkpoint
                    f"the shapes of its weights do not match its config.json ('{name}' is {list(shape)}, the "
                    f"config makes it {list(p.shape)})"
                )
            if dtype != p.dtype and dtype.is_floating_point:
                p.data = p.data.to(dtype)
    finally:
        reader.close()
    return model


def _load_checkpoint(source: ModelSource, tok, dtype, meta: bool = False) -> LoadedModel:
    path = source.path
    refuse_custom_code(path)
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), **NO_CODE)
        cls = model_class(config)
        model = _meta_checkpoint(path, config, cls) if meta else None
        meta = model is not None
        if meta:
            model.eval()  # as from_pretrained gives it
        else:
            # dtype "auto": as saved (a bf16 checkpoint stays bf16 until the cast below, the vision tower for good).
            # On a forked generator: transformers' init still draws for some loaded modules (Qwen3.5's A_log),
            # which a meta build cannot repeat; the run's RNG (a LoRA adapter's draw next) is then the same either way.
            with torch.random.fork_rng(devices=[]):
                model = cls.from_pretrained(str(path), config=config, dtype="auto", **NO_CODE)
    except SafetensorError as e:
        raise ModelError(
            f"cannot load checkpoint '{path}': a weight file is damaged or incomplete ({e}); download or copy it again"
        ) from None
    except pickle.UnpicklingError as e:
        raise pickle_refused(
            f"cannot load checkpoint '{path}'", sorted(p.name for p in path.glob("*.bin")), e
        ) from None
    except RuntimeError as e:
        if "mismatch" not in str(e):
            raise
        raise ModelError(
            f"cannot load checkpoint '{path}': the shapes of its weights do not match its config.json "
            "(transformers logged which above)"
        ) from None
    except (OSError, ValueError, KeyError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelError(f"cannot load checkpoint '{path}': {first}") from None
    check_weight_files(path)  # what an export reads back from the source is there
    source_dtype = text_model(model).embed_tokens.weight.dtype
    frozen = freeze_non_text(model)
    if dtype is not None:
        _cast_parameters(model, dtype, text_parameters(model))
    logger.info(
        "base_model %s: %s in %s%s",
        source.name,
        type(model).__name__,
        str(source_dtype).removeprefix("torch."),
        f" (commit {source.revision})" if source.revision else "",
    )
    if frozen:
        roots = sorted({".".join(n.split(".")[:2]) for n in frozen})  # e.g. model.visual
        count = sum(p.numel() for n, p in model.named_parameters() if not p.requires_grad)
        logger.info(
            "frozen: %.2fM parameters outside the text model (%s), kept as saved", count / 1e6, ", ".join(roots)
        )
    return LoadedModel(
        model,
        tok,
        "checkpoint",
        source.name,
        source_dir=path,
        revision=source.revision,
        source_dtype=source_dtype,
        reader=(lambda: CheckpointReader(path)) if meta else None,
    )


def load_model(
    base_model: str | ModelSource,
    tokenizer=None,
    seed: int = 42,
    dtype=None,
    revision: str | None = None,
    meta: bool = False,
) -> LoadedModel:
    """Build a preset (seeded random init) or load a checkpoint (a local directory or a hub id at `revision`, or an
    already resolved ModelSource). `dtype`: the text model's parameters (None: as saved; presets: fp32).

    `meta`: the model on the meta device, its dtypes and frozen parameters as a plain load gives them but no values;
    `materialize` then fills it (e.g. after FSDP2 sharded it, each rank its own shards)."""
    source = _source(base_model, revision)
    tok = tokenizer if tokenizer is not None else tokenizer_for(source)
    if source.is_preset:
        return _load_preset(source.name, tok, seed, dtype, meta)
    return _load_checkpoint(source, tok, dtype, meta)


__all__ = [
    "LoadedModel",
    "ModelSource",
    "check_checkpoint_dir",
    "load_model",
    "materialize",
    "pickle_refused",
    "resolve_source",
    "tokenizer_for",
]
