"""The data keys of a run: its sources (`DatasetConfig`, one entry of `datasets` or `test_datasets`, or the `dataset`
shorthand), the held-out share, the tokenising processes, an image's pixel bounds, and how examples become packed
bins (`sequence_len`, `sample_packing`, what is trained on)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridtune.config.keys import INT64, Bound, at_least, key

BUNDLED_DATASET = "hybridtune:sample/arithmetic.jsonl"
# What `sequence_len: auto` is for a preset (the demo's value; runtime/defaults.py decides it for a checkpoint), and
# where nothing resolves it (data.build.prepare called as a library).
PRESET_SEQUENCE_LEN = 256
# More tokenising processes than this is no machine's: a typo (a larger count than the cores is capped, said once).
MAX_PROCS = 4096
ROW_FORMATS = Literal["auto", "text", "alpaca", "chat", "sharegpt", "prompt_completion", "preference"]


def _whole(cfg) -> str:
    whole = "must be a share below 1 or a whole count of examples"
    return whole + " (1 is refused: as a share it holds out every example, as a count one: give 2 or more)" * (
        cfg.val_set_size == 1
    )


@dataclass
class DatasetConfig:
    """One data source. `type: auto` detects the format from the first row's fields."""

    path: str = key(
        "",
        "a JSONL, JSON, CSV, Parquet or Arrow file, a directory (save_to_disk, or a dataset repo), a glob, "
        "a dataset id org/name (datasets cache; HF_DATASETS_OFFLINE honoured), 'hybridtune:sample/<name>'",
        path=True,
    )
    split: str = key("train", "directory with splits or dataset id: the split to read")
    name: str | None = key(None, "directory or dataset id: the config (subset) to read (default: its only one)")
    type: ROW_FORMATS = key("auto", "row format (auto: from the first row's fields)")
    field_text: str = key("text", "text: field holding the document")
    field_instruction: str = key("instruction", "alpaca: instruction field")
    field_input: str = key("input", "alpaca: optional input field")
    field_output: str = key("output", "alpaca: response field")
    field_prompt: str = key("prompt", "prompt_completion: the prompt (text, or a list of messages)")
    field_completion: str = key("completion", "prompt_completion: what is trained on (text, or a list of messages)")
    field_chosen: str = key("chosen", "preference: the preferred reply (text, or a list of messages)")
    field_rejected: str = key("rejected", "preference: the dispreferred reply (text, or a list of messages)")
    field_messages: str = key("messages", "chat: list of {role, content}; sharegpt: 'conversations'")
    message_field_role: str = key("role", "chat: role key in a message ('from' for sharegpt)")
    message_field_content: str = key("content", "chat: content key in a message ('value' for sharegpt)")
    roles_to_train: list[str] = key(["assistant"], "chat/sharegpt: roles whose tokens are trained on")


@dataclass
class DataKeys:
    datasets: list[DatasetConfig] = key([DatasetConfig(path=BUNDLED_DATASET, type="chat")], "list of data sources")
    dataset: str | list[str] | None = key(
        None,
        "shorthand for data files, one or a list (--dataset a --dataset b); replaces `datasets`",
        path=True,
        not_empty="give a data file, directory or dataset id, or leave it out (null) to use datasets",
    )
    dataset_type: ROW_FORMATS = key("auto", "format of `dataset`")
    val_set_size: float = key(
        0.04,
        "held-out share (< 1) or count (>= 1) of examples for eval (not used with test_datasets)",
        at_least(0, "must be >= 0"),
        Bound(lambda v, cfg: v < 1 or v == int(v) > 1, _whole, training=True),
    )
    test_datasets: list[DatasetConfig] = key(
        [], "data sources evaluated on instead of a val_set_size share of `datasets` (entries as in `datasets`)"
    )
    dataset_num_proc: int = key(
        0,
        "processes that tokenise the data (0: auto, one per core for large data); the result is cached",
        INT64,
        Bound(lambda v, cfg: 0 <= v <= MAX_PROCS, f"must be 0 (auto: this machine's cores) to {MAX_PROCS}"),
    )
    min_pixels: int | None = key(
        None,
        "vision-language models: the fewest pixels an image is resized to (default: the checkpoint's processor's)",
        at_least(1),
    )
    max_pixels: int | None = key(
        None,
        "vision-language models: the most pixels an image is resized to, which bounds its visual tokens (pixels / "
        "(patch x merge)^2); default: the checkpoint's processor's",
        Bound(
            lambda v, cfg: v is None or v >= max(1, cfg.min_pixels or 1), "must be at least 1 and at least min_pixels"
        ),
    )
    sequence_len: Literal["auto"] | int = key(
        "auto",
        "tokens per packed bin (and max tokens per example); auto = 256 for a preset, else the least power of two "
        "at or above the 99th percentile of the training examples' lengths, within the model's context",
        at_least(2),
    )
    sample_packing: bool = key(True, "pack several examples per bin (off: one example per bin)")
    excess_length_strategy: Literal["truncate", "drop"] = key("truncate", "examples longer than sequence_len")
    train_on_inputs: bool = key(False, "also train on prompt/user tokens (default: assistant/response only)")

    def resolved_datasets(self) -> list[DatasetConfig]:
        if self.dataset:
            paths = [self.dataset] if isinstance(self.dataset, str) else self.dataset
            return [DatasetConfig(path=p, type=self.dataset_type) for p in paths]
        return self.datasets
