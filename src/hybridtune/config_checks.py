"""Checks across a config's keys once the file and the command line are merged, each naming the file line (or the
command line) of the keys involved: a path holding an environment variable, QLoRA with 4-bit turned off."""

from __future__ import annotations

import os
import re
from typing import Any

import yaml

from hybridtune.errors import ConfigError

PATH_KEYS = ("base_model", "tokenizer", "chat_template", "dataset", "output_dir", "resume_from_checkpoint")
_ENV_VAR = re.compile(r"\$(?:\{\w+\}|[A-Za-z_]\w*)")


def _key_lines(node: yaml.Node | None) -> dict[str, int]:
    """The line of each top-level key of a YAML mapping node (none without one)."""
    keys = node.value if isinstance(node, yaml.MappingNode) else []
    return {k.value: k.start_mark.line + 1 for k, _ in keys if isinstance(k, yaml.ScalarNode)}


def qlora_4bit(fields: dict, cli: dict, where: str, node: yaml.Node | None) -> list[ConfigError]:
    """`adapter: qlora` beside `load_in_4bit: false` (qlora would train 4-bit anyway) given in one place, or the
    false given over a file's qlora, is a conflict; `--adapter qlora` over a file's false is the command line's
    QLoRA, as the command line wins everywhere."""
    if fields.get("adapter") != "qlora" or fields.get("load_in_4bit") is not False:
        return []
    if "adapter" in cli and "load_in_4bit" not in cli:
        fields.pop("load_in_4bit")
        return []
    lines = _key_lines(node)
    at = {"command line" if k in cli else f"{where}:{lines.get(k, '?')}": k for k in ("adapter", "load_in_4bit")}
    what = "QLoRA is LoRA over a 4-bit base (use adapter: lora for a bf16 base, or drop load_in_4bit: false)"
    keys = "config keys 'adapter' = 'qlora' and 'load_in_4bit' = false conflict"
    return [ConfigError(f"{' and '.join(at)}: {keys}: {what}")]  # each place said once


def env_vars(fields: dict[str, Any], where: str, node: yaml.Node | None) -> list[ConfigError]:
    """A path in a file holding `$VAR` or `${VAR}`: hybridtune does not expand environment variables (a config
    means the same under any environment), and a directory named `${HOME}` is never what was meant."""
    lines = _key_lines(node)
    paths = [(k, k, fields[k]) for k in PATH_KEYS if isinstance(fields.get(k), str)]
    for key in ("datasets", "test_datasets"):
        paths += [(key, f"{key}[{i}].path", ds.path) for i, ds in enumerate(fields.get(key) or []) if ds]
    out = []
    for key, label, value in paths:
        if found := _ENV_VAR.search(value):
            expanded = os.path.expandvars(value)
            eg = f" (here: '{expanded}')" if expanded != value else ""
            out.append(
                ConfigError(
                    f"{where}:{lines.get(key, '?')}: key '{label}' = '{value}' holds the environment variable "
                    f"{found.group()}, which hybridtune does not expand; write the path itself{eg}"
                )
            )
    return out
