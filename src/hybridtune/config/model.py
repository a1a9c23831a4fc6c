"""The model keys of a run: which checkpoint, hub id or preset it trains, at which revision, with which tokenizer and
chat template."""

from __future__ import annotations

from dataclasses import dataclass

from hybridtune.config.keys import key


@dataclass
class ModelKeys:
    base_model: str = key(
        "tiny-qwen3_5",
        "a local checkpoint directory, a hub id org/name (at `revision`), or a preset with random weights "
        "(`hybridtune doctor` lists them; NAME@layers=N is its first N decoder layers)",
        path=True,
        not_empty="give a preset, a hub id or a checkpoint directory",
    )
    revision: str | None = key(
        None,
        "hub id only: the branch, tag or commit of base_model to load (default: main), as transformers takes it",
        not_empty="give a branch, tag or commit, or leave it out (null) for main",
    )
    tokenizer: str | None = key(
        None,
        "tokenizer directory (default: the model's own, or the bundled one for presets)",
        path=True,
        not_empty="give a tokenizer directory, or leave it out (null) for the model's own",
    )
    chat_template: str | None = key(
        None,
        "chat template for chat data: a .jinja/.txt file, or the name of one of the tokenizer's named templates "
        "(default: the tokenizer's own); saved with the final model",
        path=True,
        not_empty="give a .jinja/.txt file or a template's name, or leave it out (null) for the tokenizer's own",
    )
    chat_template_kwargs: dict = key(
        {}, "variables given to the chat template when it renders the data, such as {enable_thinking: false} (Qwen3.5)"
    )
