"""Loading a run's configuration: a YAML file plus `--key value` overrides (`parse_overrides`), read key by key
(parse.py), checked across keys (cross.py) and against every key's bounds (bounds.py), all problems said at once
(`load_config`); the bundled example configs; the config's warnings (legal, likely not what was meant)."""

from __future__ import annotations

import dataclasses
import logging
import os
import typing
from pathlib import Path
from typing import Any

import yaml

from hybridtune.config.bounds import validate
from hybridtune.config.cross import absolute_paths, check_output_dir, dataset_twice, env_vars, place, qlora_4bit
from hybridtune.config.grpo import grpo_warnings
from hybridtune.config.keys import together
from hybridtune.config.parse import _fields
from hybridtune.config.schema import TrainConfig
from hybridtune.config.yaml_tree import load_yaml
from hybridtune.errors import ConfigError, did_you_mean
from hybridtune.textfile import read_utf8

logger = logging.getLogger(__name__)

# Keys typed str (or str | None): their values are text, as written.
_TEXT_KEYS = {k for k, tp in typing.get_type_hints(TrainConfig).items() if str in typing.get_args(tp) or tp is str}
_LISTS = {k for k, tp in typing.get_type_hints(TrainConfig).items() if typing.get_origin(tp) is list}


# Keys whose values add up when given again on the command line (`--dataset a --dataset b` trains on both).
_REPEATED = {"dataset", "datasets", "test_datasets"}


def _listed(key: str, value: Any) -> list:
    """A repeated key's value as items: a list's, a `datasets` text's paths (`--datasets a,b`), else itself."""
    if isinstance(value, list):
        return value
    if isinstance(value, str) and key != "dataset":
        return [v.strip() for v in value.split(",") if v.strip()]
    return [value]


def parse_overrides(argv: list[str]) -> dict[str, Any]:
    """`--key value`, `--key=value`, or a bare `--flag` (true). Values are read as YAML scalars/lists."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"command line: expected --key value, got '{arg}'")
        key, eq, raw = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                raw = argv[i + 1]
                i += 1
            else:
                raw = "true"
        before = out.pop(key, None) if key in _REPEATED else None
        try:
            out[key] = load_yaml(raw, "command line")[0] if raw != "" else ""
        except yaml.YAMLError:
            out[key] = raw
        # Paths and names stay strings as typed even when they look like numbers or dates (`--run_name 1.10`).
        if key in _TEXT_KEYS and out[key] is not None and not (key in _LISTS and isinstance(out[key], list)):
            out[key] = str(raw)  # (a list key's `[a, b]` is its list, not the text '[a, b]' split at the comma)
        if before is not None:  # `--dataset a --dataset b`: both, never silently the last
            out[key] = [*_listed(key, before), *_listed(key, out[key])]
        i += 1
    if twice := dataset_twice(out, "command line: "):  # (a run record's keys come as overrides too: not here)
        raise twice[0]
    return out


def load_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None, warn: bool = True, training: bool = True
) -> TrainConfig:
    """Build a `TrainConfig` from an optional YAML file and overrides (overrides win); `warn`: log the config's
    warnings (a launcher whose rank 0 will say them passes False); `training`: False for a config that is not about
    to train (a recorded run's, eval's), which skips the checks of what only training reads."""
    data: dict[str, Any] = {}
    node = None
    where = "command line"
    if path is not None:
        p = resolve_config_path(path)
        text = read_config_text(p)
        try:
            loaded, node = load_yaml(text, str(p))
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f"{p}:{mark.line + 1}: not valid YAML at column {mark.column + 1}" if mark else f"{p}: not valid YAML"
            raise ConfigError(f"{at} ({getattr(e, 'problem', e)})") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: expected a mapping of config keys at the top level")
        data.update(loaded)
        where = str(p)
    cli = overrides or {}
    problems: list[ConfigError] = []  # every problem of the file and the command line, said at once
    ignored: list[str] = []  # other tools' keys whose values change nothing here: one warning line
    fields = _fields(TrainConfig, data, where, node, problems, ignored=ignored)  # a file's problems name its line
    problems += env_vars(fields, where, node)
    fields.update(_fields(TrainConfig, cli, "command line", None, problems, ignored=ignored))
    problems += qlora_4bit(fields, cli, where, node) + dataset_twice(data, place({}, where, node)("dataset"))
    if problems:
        raise together(problems)
    cfg = TrainConfig(**fields)
    validate(cfg, place(cli, where, node), training)
    check_output_dir(cfg.output_dir)
    if training:  # (a recorded run's config keeps its paths as written: they are relative to its own directory)
        absolute_paths(cfg)
    if warn and os.environ.get("RANK", "0") == "0":  # under torchrun every rank reads the config: one voice says it
        if ignored:
            logger.warning(
                "config keys of another tool ignored, their values change nothing here: %s; remove them to silence "
                "this",
                ", ".join(ignored),
            )
        for warning in config_warnings(cfg, set(data) | set(cli)):
            logger.warning(warning)
    return cfg


# Example configs shipped in the wheel, named on the command line as `hybridtune:configs/<name>.yaml`.
BUNDLED_CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
BUNDLED_CONFIG_PREFIX = "hybridtune:configs/"


def bundled_configs() -> dict[str, Path]:
    """The example configs shipped with hybridtune: `hybridtune:configs/<name>.yaml` -> its file."""
    return {BUNDLED_CONFIG_PREFIX + f.name: f for f in sorted(BUNDLED_CONFIG_DIR.glob("*.yaml"))}


def resolve_config_path(path: str | Path) -> Path:
    """A config path: `hybridtune:configs/<name>.yaml` for a bundled example, else a local file."""
    name = str(path)
    if not name.startswith("hybridtune:"):
        return Path(path).expanduser()
    shipped = bundled_configs()
    if name not in shipped:
        raise ConfigError(
            f"'{name}' is not a bundled config.{did_you_mean(name, shipped)} Bundled configs: {', '.join(shipped)}."
        )
    return shipped[name]


def read_config_text(p: Path) -> str:
    """A config file's text: UTF-8 (a byte-order mark is allowed); anything else names the line and column."""
    if p.is_dir():
        raise ConfigError(f"config file '{p}' is a directory; pass a YAML file")
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist; pass a YAML file or leave it out for the defaults")
    return read_utf8(p, "YAML text", ConfigError)


LORA_KEYS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters")


def config_warnings(cfg: TrainConfig, given: set[str]) -> list[str]:
    """Settings that are legal but likely not what was meant; `given` holds the keys set in the file or command."""
    out = []
    ignored = sorted(k for k in LORA_KEYS if k in given)
    if cfg.adapter == "full" and ignored:
        out.append(
            f"config keys {', '.join(ignored)} are ignored: adapter is 'full' (a full fine-tune); "
            "set adapter: lora to train a LoRA adapter"
        )
    if cfg.max_steps > 0:
        warning = warmup_warning(cfg, cfg.max_steps)
        if warning:
            out.append(warning)
    return out + grpo_warnings(cfg, given)


def warmup_warning(cfg: TrainConfig, total_steps: int) -> str | None:
    """A warning when the linear warmup does not end before the run does (the peak learning rate is never reached)."""
    if cfg.warmup_ratio > 0 or cfg.warmup_steps < total_steps:
        return None
    length = f"max_steps = {cfg.max_steps}" if cfg.max_steps > 0 else f"the run has {total_steps} steps"
    lr = cfg.learning_rate if isinstance(cfg.learning_rate, str) else f"{cfg.learning_rate:g}"  # (auto)
    return (
        f"config key 'warmup_steps = {cfg.warmup_steps}' is not shorter than the run ({length}): the learning "
        f"rate never reaches learning_rate = {lr}; lower warmup_steps"
    )


def compile_overrides(cfg: TrainConfig) -> dict[str, str]:
    """`compile_overrides` as the class -> decision mapping `compile_model(..., overrides=)` takes."""
    return dict(item.split("=", 1) for item in cfg.compile_overrides)


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
