"""Typed run configuration: a YAML file plus `--key value` overrides.

Key names follow what fine-tuning users already know (Axolotl-style flat keys). Every field carries
its help text; `hybridtune train --help` lists them all with defaults. Unknown keys are an error
that names the nearest known key; ill-typed values name the key, the file and line, and the type.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import logging
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from hybridtune.config_schema import (  # re-exported: hybridtune.config is where users look for them
    BUNDLED_DATASET,
    DEFAULT_LORA_TARGETS,
    MAX_LEARNING_RATE,
    MAX_SEED,
    THREADS_PER_CPU,
    DatasetConfig,
    TrainConfig,
    max_num_threads,
)
from hybridtune.errors import ConfigError, did_you_mean
from hybridtune.textfile import read_utf8

__all__ = [
    "BUNDLED_DATASET",
    "DEFAULT_LORA_TARGETS",
    "DatasetConfig",
    "TrainConfig",
    "bundled_configs",
    "compile_overrides",
    "config_help",
    "load_config",
    "parse_overrides",
    "to_dict",
    "validate",
    "warmup_warning",
]

logger = logging.getLogger(__name__)

# YAML 1.1 reads these words (unquoted) as booleans; an enum key that has one of them as a value takes it back.
_YAML_BOOL_WORDS = {True: ("on", "yes", "true"), False: ("off", "no", "false")}

# ---------------------------------------------------------------------------------------------------
# parsing and validation


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; convert where it is lossless (int -> float)."""
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool):
            # `compile: off` unquoted (or `--compile off`) arrives as False: give the word back.
            words = [w for w in _YAML_BOOL_WORDS[value] if w in choices]
            if len(words) == 1:
                return words[0]
            raise bad
        if value in choices:
            return value
        raise bad
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                continue
        raise bad
    if tp is type(None):
        if value is None:
            return None
        raise bad
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str) and item_tp is str:
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise bad
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad
        return _build(tp, value, where, {})
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            # YAML 1.1 reads `1e-3` (no dot) as a string; users mean the number.
            try:
                number = float(value)
            except ValueError:
                raise bad from None
        else:
            raise bad
        if not math.isfinite(number):
            raise ConfigError(f"{where}: expected a finite float, got {number}; give a number")
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad
    raise bad


# Keys renamed since a release: old name -> (new name, how its values map). An old config gets one line saying so.
RENAMED_KEYS: dict[str, tuple[str, dict]] = {
    # Inverted polarity: recompute_cores: true (the cores recomputed) is keep_mixer_cores: false.
    "recompute_cores": ("keep_mixer_cores", {True: False, False: True, "auto": "auto"}),
}


def _renamed_key(key: str, value: Any, where: str) -> ConfigError | None:
    if key not in RENAMED_KEYS:
        return None
    new, values = RENAMED_KEYS[key]
    inverted = any(k != v for k, v in values.items())
    how = f" with the polarity inverted ('{key}: true' is '{new}: false')" if inverted else ""
    same = values.get(value) if isinstance(value, (bool, str)) else None
    instead = f"; write '{new}: {str(same).lower()}'" if same is not None else ""
    return ConfigError(f"{where}: config key '{key}' is now '{new}'{how}{instead}")


def _unknown_key(key: str, known: list[str], where: str) -> ConfigError:
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    hint = f"; did you mean '{near[0]}'?" if near else "; run `hybridtune train --help` for the list"
    return ConfigError(f"{where}: unknown config key '{key}'{hint}")


def _build(cls: type, data: dict, where: str, lines: dict[str, int]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        loc = f"{where}:{lines[key]}" if key in lines else where
        if key not in hints:
            raise _renamed_key(str(key), value, loc) or _unknown_key(str(key), names, loc)
        kwargs[key] = _coerce(value, hints[key], f"{loc}: key '{key}'")
    return cls(**kwargs)


def _key_lines(text: str) -> dict[str, int]:
    """1-based line numbers of the top-level keys of a YAML mapping."""
    node = yaml.compose(text)
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {k.value: k.start_mark.line + 1 for k, _ in node.value if isinstance(k, yaml.ScalarNode)}


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
        try:
            out[key] = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            out[key] = raw
        # Paths and names stay strings even when they look like numbers or dates.
        if (
            key
            in (
                "base_model",
                "revision",
                "tokenizer",
                "chat_template",
                "dataset",
                "output_dir",
                "resume_from_checkpoint",
            )
            and out[key] is not None
        ):
            out[key] = str(raw)
        i += 1
    return out


def load_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None, warn: bool = True
) -> TrainConfig:
    """Build a `TrainConfig` from an optional YAML file and overrides (overrides win); `warn`: log the config's
    warnings (a launcher whose rank 0 will say them passes False)."""
    data: dict[str, Any] = {}
    lines: dict[str, int] = {}
    where = "command line"
    if path is not None:
        p = resolve_config_path(path)
        text = read_config_text(p)
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f"{p}:{mark.line + 1}: not valid YAML at column {mark.column + 1}" if mark else f"{p}: not valid YAML"
            raise ConfigError(f"{at} ({getattr(e, 'problem', e)})") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: expected a mapping of config keys at the top level")
        data.update(loaded)
        lines = _key_lines(text)
        where = str(p)
    cli = overrides or {}
    _build(TrainConfig, data, where, lines)  # errors in the file name the file and line
    _build(TrainConfig, cli, "command line", {})  # errors in overrides name the command line
    cfg = _build(TrainConfig, {**data, **cli}, where, lines)
    validate(cfg)
    check_output_dir(cfg.output_dir)
    if warn and os.environ.get("RANK", "0") == "0":  # under torchrun every rank reads the config: one voice says it
        for warning in config_warnings(cfg, set(data) | set(cli)):
            logger.warning(warning)
    return cfg


# Example configs shipped in the wheel, named on the command line as `hybridtune:configs/<name>.yaml`.
BUNDLED_CONFIG_DIR = Path(__file__).resolve().parent / "configs"
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
    return out


def warmup_warning(cfg: TrainConfig, total_steps: int) -> str | None:
    """A warning when the linear warmup does not end before the run does (the peak learning rate is never reached)."""
    if cfg.warmup_steps < total_steps:
        return None
    length = f"max_steps = {cfg.max_steps}" if cfg.max_steps > 0 else f"the run has {total_steps} steps"
    return (
        f"config key 'warmup_steps = {cfg.warmup_steps}' is not shorter than the run ({length}): the learning "
        f"rate never reaches learning_rate = {cfg.learning_rate:g}; lower warmup_steps"
    )


def validate(cfg: TrainConfig) -> None:
    """Range checks that types cannot express."""
    checks = [
        (cfg.sequence_len >= 2, "sequence_len", cfg.sequence_len, "must be at least 2"),
        (cfg.micro_batch_size >= 1, "micro_batch_size", cfg.micro_batch_size, "must be at least 1"),
        (
            cfg.gradient_accumulation_steps >= 1,
            "gradient_accumulation_steps",
            cfg.gradient_accumulation_steps,
            "must be at least 1",
        ),
        (cfg.lora_r >= 1, "lora_r", cfg.lora_r, "must be at least 1"),
        (0.0 <= cfg.lora_dropout < 1.0, "lora_dropout", cfg.lora_dropout, "must be in [0, 1)"),
        (cfg.learning_rate > 0, "learning_rate", cfg.learning_rate, "must be positive"),
        (
            cfg.learning_rate <= MAX_LEARNING_RATE,
            "learning_rate",
            cfg.learning_rate,
            f"must be at most {MAX_LEARNING_RATE:g} (fine-tunes use 1e-6 to 1e-2; far larger overflows the "
            "optimizer); use e.g. 1e-4",
        ),
        (cfg.val_set_size >= 0, "val_set_size", cfg.val_set_size, "must be >= 0"),
        (
            cfg.max_steps >= -1,
            "max_steps",
            cfg.max_steps,
            "must be -1 (from num_epochs), 0 (only evaluate and export) or more",
        ),
        (cfg.num_epochs > 0, "num_epochs", cfg.num_epochs, "must be positive"),
        (cfg.warmup_steps >= 0, "warmup_steps", cfg.warmup_steps, "must be >= 0"),
        (cfg.weight_decay >= 0, "weight_decay", cfg.weight_decay, "must be >= 0"),
        (cfg.max_grad_norm >= 0, "max_grad_norm", cfg.max_grad_norm, "must be >= 0"),
        (cfg.lora_alpha >= 1, "lora_alpha", cfg.lora_alpha, "must be at least 1 (the LoRA scale is alpha / r)"),
        (cfg.logging_steps >= 1, "logging_steps", cfg.logging_steps, "must be at least 1"),
        (
            bool(re.fullmatch(r"auto|layer|model|group:[1-9][0-9]*", str(cfg.fsdp_units))),
            "fsdp_units",
            cfg.fsdp_units,
            "must be auto, layer, model or group:K (K consecutive decoder layers per unit, K >= 1); e.g. group:4",
        ),
        (cfg.eval_steps >= 0, "eval_steps", cfg.eval_steps, "must be 0 (only at the end) or more"),
        (cfg.save_steps >= 0, "save_steps", cfg.save_steps, "must be 0 (only at the end) or more"),
        (
            cfg.eval_max_examples >= 1,
            "eval_max_examples",
            cfg.eval_max_examples,
            "must be at least 1 (to evaluate nothing, set val_set_size: 0)",
        ),
        (cfg.num_threads >= 0, "num_threads", cfg.num_threads, "must be 0 (auto) or more"),
        (
            cfg.num_threads <= max_num_threads(),
            "num_threads",
            cfg.num_threads,
            f"must be at most {max_num_threads()} ({THREADS_PER_CPU} x the {os.cpu_count() or 1} CPUs of this "
            "machine; more threads only contend for the same cores); use 0 for auto",
        ),
        (0 <= cfg.seed <= MAX_SEED, "seed", cfg.seed, f"must be between 0 and 2**63 - 1 ({MAX_SEED})"),
        (cfg.save_total_limit >= 1, "save_total_limit", cfg.save_total_limit, "must be at least 1"),
        (cfg.profile_steps >= 0, "profile_steps", cfg.profile_steps, "must be 0 (off) or more"),
        (cfg.eval_samples >= 0, "eval_samples", cfg.eval_samples, "must be 0 (off) or more"),
        (cfg.eval_max_new_tokens >= 1, "eval_max_new_tokens", cfg.eval_max_new_tokens, "must be at least 1"),
    ]
    for ok, key, value, what in checks:
        if not ok:
            raise ConfigError(f"config key '{key}' = {value!r} {what}")
    for item in cfg.compile_overrides:
        cls, eq, decision = item.partition("=")
        if not eq or not cls or decision not in ("compile", "fullgraph", "eager", "off"):
            raise ConfigError(
                f"config key 'compile_overrides' entry {item!r} must look like Class=compile|fullgraph|eager|off "
                "(e.g. Qwen3_5MLP=eager)"
            )
    if cfg.report_to != "none" and importlib.util.find_spec(cfg.report_to) is None:  # the extra has its name
        raise ConfigError(
            f"config key 'report_to' = '{cfg.report_to}' needs the {cfg.report_to} package, which is not installed; "
            f"pip install 'hybridtune[{cfg.report_to}]'"
        )
    if cfg.adapter == "lora" and not cfg.lora_target_modules and not cfg.lora_target_parameters:
        raise ConfigError("config key 'lora_target_modules' is empty; name at least one module (e.g. q_proj)")
    if cfg.adapter == "lora" and cfg.lora_target_parameters and cfg.lora_dropout:
        raise ConfigError(
            f"config key 'lora_dropout' = {cfg.lora_dropout} with lora_target_parameters: peft's LoRA on parameters "
            "has no dropout; set lora_dropout: 0"
        )
    if cfg.dataset_num_proc < 0:
        raise ConfigError(f"config key 'dataset_num_proc' = {cfg.dataset_num_proc} must be 0 (auto) or more")
    entries = [("datasets", cfg.resolved_datasets()), ("test_datasets", cfg.test_datasets)]
    for key, i, ds in [(key, i, ds) for key, dss in entries for i, ds in enumerate(dss)]:
        if not ds.path:
            raise ConfigError(f"config key '{key}[{i}].path' is empty; give a data file, directory or dataset id")
        if not ds.roles_to_train and ds.type in ("auto", "chat", "sharegpt") and not cfg.train_on_inputs:
            raise ConfigError(
                f"config key '{key}[{i}].roles_to_train' is empty, so no token of a chat would be trained on; "
                "name the roles to train on (e.g. [assistant])"
            )


def config_help() -> str:
    """Every key with its type, default and meaning, for `hybridtune train --help`."""
    rows = []
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if f.name == "datasets":
            default = "[bundled arithmetic chats]"
        rows.append(f"  --{f.name} ({_type_name(hints[f.name])}, default {default!r})\n      {f.metadata['help']}")
    ds_rows = []
    ds_hints = typing.get_type_hints(DatasetConfig)
    for f in dataclasses.fields(DatasetConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        ds_rows.append(f"    {f.name} ({_type_name(ds_hints[f.name])}, default {default!r}): {f.metadata['help']}")
    return (
        "config keys (YAML file or --key value):\n"
        + "\n".join(rows)
        + "\n\n  each entry of `datasets` and `test_datasets`:\n"
        + "\n".join(ds_rows)
    )


def compile_overrides(cfg: TrainConfig) -> dict[str, str]:
    """`compile_overrides` as the class -> decision mapping `compile_model(..., overrides=)` takes."""
    return dict(item.split("=", 1) for item in cfg.compile_overrides)


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
