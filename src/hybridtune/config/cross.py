"""Checks across a config's keys once the file and the command line are merged, each naming the file line (or the
command line) of the keys involved: a path holding an environment variable, QLoRA with 4-bit turned off, `dataset`
beside `datasets`; where a key was given (`place`); an output_dir that cannot be written; the paths made absolute."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from hybridtune.config.schema import PATH_KEYS
from hybridtune.errors import ConfigError

_ENV_VAR = re.compile(r"\$(?:\{\w+\}|[A-Za-z_]\w*)")


def _key_lines(node: yaml.Node | None) -> dict[str, int]:
    """The line of each top-level key of a YAML mapping node (none without one)."""
    keys = node.value if isinstance(node, yaml.MappingNode) else []
    return {k.value: k.start_mark.line + 1 for k, _ in keys if isinstance(k, yaml.ScalarNode)}


def place(cli: dict, where: str, node: yaml.Node | None) -> Callable[[str], str]:
    """key -> where it was given, as an error's prefix ('command line: ', 'c.yaml:3: '), '' for a default; a key
    such as 'datasets[0].path' by its top-level key."""
    lines = _key_lines(node)

    def at(key: str) -> str:
        top = re.split(r"[\[.]", key, maxsplit=1)[0]
        return "command line: " if top in cli else f"{where}:{lines[top]}: " if top in lines else ""

    return at


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


def dataset_twice(given: dict, at: str) -> list[ConfigError]:
    """`dataset` beside `datasets` in one place (both in a file, or both on the command line; `at`: where, as an error's prefix):
    `dataset` replaces `datasets`, so the files of one would be dropped without a word. The command line's
    `--dataset` over a file's `datasets` is an override, as the command line wins everywhere."""
    if given.get("dataset") is None or given.get("datasets") is None:
        return []
    return [
        ConfigError(
            f"{at}config keys 'dataset' and 'datasets' are both given; 'dataset' replaces 'datasets', so the files "
            "of 'datasets' would be dropped: list every file under one of them (--dataset a --dataset b, or "
            "--datasets a,b)"
        )
    ]


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


def check_output_dir(output_dir: str) -> None:
    """Refuse an output_dir that cannot become a directory we write in, before any model is loaded."""
    target = Path(output_dir).expanduser()
    if target.exists() and not target.is_dir():
        raise ConfigError(f"config key 'output_dir' = '{output_dir}' is a file; give a directory path")
    probe = target
    while not probe.exists():
        if probe.parent == probe:
            return
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(
            f"config key 'output_dir' = '{output_dir}': '{probe}' is a file, so the directory cannot be created; "
            "give another path"
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(
            f"config key 'output_dir' = '{output_dir}': cannot write in '{probe}' (read-only); give a writable path"
        )


def absolute_paths(cfg: Any) -> None:
    """The paths a run reads or writes after it starts made absolute once, at load, so that nothing the process does
    later to its working directory (a reward function's os.chdir) moves them: output_dir always (checkpoints, final/,
    metrics); base_model, tokenizer, chat_template and resume_from_checkpoint when they name a local file or
    directory (export copies the base's files at the end). A hub id, a preset, a named template and `latest` stay as
    written. The data and reward files are read, hashed and imported once, before the first step: they stay as
    written, as their messages name them (the run record keeps the directory they are relative to, `cwd`)."""

    def local(value: Any) -> Any:
        if not isinstance(value, str) or not value or value.startswith("hybridtune:"):
            return value
        p = Path(value).expanduser()
        try:
            found = p.exists()
        except (OSError, ValueError):  # a name no path can be: said by the check that reads it
            return value
        return os.path.abspath(p) if found else value

    cfg.output_dir = os.path.abspath(Path(cfg.output_dir).expanduser())
    cfg.base_model, cfg.tokenizer, cfg.chat_template = (
        local(cfg.base_model),
        local(cfg.tokenizer),
        local(cfg.chat_template),
    )
    if cfg.resume_from_checkpoint != "latest":
        cfg.resume_from_checkpoint = local(cfg.resume_from_checkpoint)
