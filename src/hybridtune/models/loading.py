"""Load a model and its tokenizer: a built-in preset (random weights) or a local checkpoint directory.

Nothing is ever downloaded: a name that is neither a preset nor an existing directory is an error.
A Qwen3.5 `ForConditionalGeneration` checkpoint loads text-only through `AutoModelForCausalLM`
(the vision tower is not instantiated).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridtune.errors import ModelError, did_you_mean
from hybridtune.models.presets import PRESETS, preset_config
from hybridtune.models.tokenizer_files import bundled_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    source: str  # "preset" or "checkpoint"
    name: str


def _tokenizer_from(path: str, fix: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
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


def tokenizer_for(base_model: str, tokenizer_path: str | None = None):
    """The tokenizer a run uses: `tokenizer_path`, else the checkpoint's own, else the bundled one for presets."""
    if base_model in PRESETS:
        return load_tokenizer(tokenizer_path, None)
    check_checkpoint_dir(base_model)
    return load_tokenizer(tokenizer_path, str(Path(base_model).expanduser()))


def check_checkpoint_dir(base_model: str) -> Path:
    path = Path(base_model).expanduser()
    if not path.is_dir():
        hint = did_you_mean(base_model, PRESETS, what="preset ") or f" Presets: {', '.join(PRESETS)}."
        raise ModelError(f"base_model '{base_model}' is neither a preset nor a local checkpoint directory.{hint}")
    if not (path / "config.json").is_file():
        raise ModelError(f"checkpoint directory '{path}' has no config.json; point base_model at a saved model")
    return path


def _cast_parameters(model, dtype: torch.dtype) -> None:
    """Parameters to `dtype`, buffers untouched (rotary `inv_freq` stays fp32, as `from_config(dtype=...)` keeps it);
    tied weights stay tied (one Parameter, cast once)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dtype)
    model.config.dtype = dtype


def load_model(base_model: str, tokenizer=None, seed: int = 42, dtype=None) -> LoadedModel:
    """Build a preset (seeded random init) or load a local checkpoint directory."""
    from transformers import AutoModelForCausalLM

    tok = tokenizer if tokenizer is not None else tokenizer_for(base_model)
    if base_model in PRESETS:
        preset = PRESETS[base_model]
        vocab = len(tok) if preset.uses_bundled_tokenizer else None
        config = preset_config(base_model, vocab_size=vocab)
        config.pad_token_id = tok.pad_token_id
        config.eos_token_id = tok.eos_token_id
        if len(tok) > config.vocab_size:
            raise ModelError(
                f"tokenizer has {len(tok)} tokens but preset '{base_model}' has a vocabulary of {config.vocab_size}"
            )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            # Random init in fp32, then cast: CPU normal_() in bf16 is several times slower, and a preset's weights
            # are then the same whatever dtype is asked.
            model = AutoModelForCausalLM.from_config(config)
        if dtype is not None and dtype != model.dtype:
            _cast_parameters(model, dtype)
        return LoadedModel(model, tok, "preset", base_model)
    path = check_checkpoint_dir(base_model)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"cannot load checkpoint '{path}': {e}") from None
    return LoadedModel(model, tok, "checkpoint", str(path))
