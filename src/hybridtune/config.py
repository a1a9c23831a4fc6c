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
import reprlib
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from hybridtune.config_checks import (
    absolute_paths,
    as_text,
    check_output_dir,
    dataset_twice,
    duplicate_keys,
    env_vars,
    expanded,
    place,
    qlora_4bit,
    value_checks,
)
from hybridtune.config_foreign import (
    CHATML_TEMPLATES,
    FOREIGN_DATASET_KEYS,
    FOREIGN_KEYS,
    FOREIGN_VALUES,
    OTHER_TEMPLATES,
    noop,
    renamed_key,
    template_hint,
)
from hybridtune.config_grpo import grpo_warnings
from hybridtune.config_schema import (  # re-exported: hybridtune.config is where users look for them
    ALL_LINEAR,
    BUNDLED_DATASET,
    DEFAULT_LORA_TARGETS,
    PRESET_LEARNING_RATE,
    DatasetConfig,
    TrainConfig,
    config_help,
    range_checks,
    type_name,
)
from hybridtune.errors import ConfigError, did_you_mean
from hybridtune.textfile import read_utf8

__all__ = [
    "ALL_LINEAR",
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
# The least similarity (difflib's ratio) at which an unknown key's hint names a known key: below it the nearest
# key is another setting (`strict` is not `distributed`, `group_by_length` not `max_prompt_length`).
NEAR = 0.75
# Values in error messages are shortened: a long list or string is shown by its start.
_SHOW = reprlib.Repr()
_SHOW.maxstring, _SHOW.maxother, _SHOW.maxlist, _SHOW.maxdict, _SHOW.maxlevel = 80, 80, 6, 6, 3
# Keys whose value names a file or directory; `$HOME` or `${VAR}` in one from a file is refused (see _env_vars).

# ---------------------------------------------------------------------------------------------------
# parsing and validation


def _coerce(value: Any, tp: Any, where: str, node: yaml.Node | None = None, nest: tuple | None = None) -> Any:
    """Check `value` against the annotation `tp`; convert where it is lossless (int -> float). `node`: the value's
    YAML node (a str key takes its text as written: `revision: 1.10` is '1.10', never 1.1); `nest`: (file, key
    path, problems) for a dataclass inside, whose problems are collected there."""
    origin = typing.get_origin(tp)

    def bad() -> ConfigError:  # built only on failure, the value shortened
        return ConfigError(f"{where}: expected {type_name(tp)}, got {_SHOW.repr(value)}")

    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool):
            # `compile: off` unquoted (or `--compile off`) arrives as False: give the word back.
            words = [w for w in _YAML_BOOL_WORDS[value] if w in choices]
            if len(words) == 1:
                return words[0]
            raise bad()
        if value in choices:
            return value
        raise bad()
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, where, node, nest)
            except ConfigError as e:
                if arg is float and "finite" in str(e):  # a number, but not a finite one (`auto | float`): say so
                    raise
                continue
        raise bad()
    if tp is type(None):
        if value is None:
            return None
        raise bad()
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str) and item_tp in (str, float):  # `a,b` on the command line (reward_weights: 1,2)
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, str) and item_tp is DatasetConfig:  # `--datasets a.jsonl,b.jsonl`: their paths
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise bad()
        items = node.value if isinstance(node, yaml.SequenceNode) else [None] * len(value)
        nests = [nest and (nest[0], f"{nest[1]}[{i}]", nest[2]) for i in range(len(value))]
        return [_coerce(v, item_tp, f"{where}[{i}]", n, t) for i, (v, n, t) in enumerate(zip(value, items, nests))]
    if tp is dict:  # a mapping of names to YAML values (chat_template_kwargs)
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise bad()
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if tp is DatasetConfig and isinstance(value, str) and value:  # `datasets: [a.jsonl, b.jsonl]`: paths
            value = {"path": value}
        if not isinstance(value, dict):
            raise bad()
        file, path, problems = nest or (where, "", None)
        return _build(tp, value, file, node, problems, f"{path}." if path else "")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad()
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise bad()
        try:  # YAML 1.1 reads `1e-3` (no dot) as a string; users mean the number
            number = float(value)
        except ValueError:
            raise bad() from None
        except OverflowError:  # an int past float's range (10**400)
            number = math.inf
        if not math.isfinite(number):
            shown = number if isinstance(value, float) or len(str(value)) < 10 else _SHOW.repr(value)
            raise ConfigError(f"{where}: expected a finite float, got {shown}; give a number")
        return number
    if tp is str:
        if isinstance(node, yaml.ScalarNode) and value is not None:
            return node.value  # as written: `run_name: 0755` is '0755', `name: 1.20` is '1.20'
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad()
    raise bad()


def _unknown_key(key: str, value: Any, cls: type, where: str, node: yaml.Node | None) -> ConfigError:
    """An unknown key: a renamed one, another tool's (Axolotl, LLaMA-Factory, TRL), or the nearest known key."""
    known = [f.name for f in dataclasses.fields(cls)]
    foreign = (FOREIGN_KEYS if cls is TrainConfig else FOREIGN_DATASET_KEYS).get(key)
    if foreign in known:
        text = node.value if isinstance(node, yaml.ScalarNode) else None
        write = f": write '{foreign}: {text}'" if text is not None else ""
        return ConfigError(f"{where}: unknown config key '{key}'; did you mean '{foreign}'? (the same setting{write})")
    hint = template_hint(value) if key == "template" else None
    if foreign:
        return ConfigError(f"{where}: unknown config key '{key}': {hint or foreign}")
    near = difflib.get_close_matches(key, known, n=1, cutoff=NEAR)
    hint = f"; did you mean '{near[0]}'?" if near else "; run `hybridtune train --help` for the list"
    return ConfigError(f"{where}: unknown config key '{key}'{hint}")


def _ignored(key: str, value: Any, hints: dict, child: yaml.Node | None) -> str | None:
    """How the warning lists `key: value` when it is another tool's key and that value changes nothing here (a
    no-op of config_foreign, or our default under its other name); None when it would change training."""
    said = noop(key, value)
    ours = FOREIGN_KEYS.get(key)
    if said is None and ours in hints:
        try:
            same = _coerce(value, hints[ours], key, child) == _DEFAULTS[ours]
        except ConfigError:
            same = False
        said = f"{key}: {_SHOW.repr(value)} ({ours}'s default)" if same else None
    return said


def _fields(
    cls: type, data: dict, where: str, node: yaml.Node | None, problems: list, path: str = "", ignored=None
) -> dict:
    """`data`'s keys for `cls`, each checked; `node`: data's YAML mapping (lines, values as written). Every problem
    is appended to `problems`, so that one run names them all; `ignored` (a list): where another tool's keys whose
    value changes nothing here go (else they are problems)."""
    hints = typing.get_type_hints(cls)
    keys = node.value if isinstance(node, yaml.MappingNode) else []
    nodes = {k.value: (k.start_mark.line + 1, v) for k, v in keys if isinstance(k, yaml.ScalarNode)}
    kwargs = {}
    for key, value in data.items():
        line, child = nodes.get(key, (None, None))
        loc = f"{where}:{line}" if line else where
        if key not in hints and ignored is not None and (said := _ignored(str(key), value, hints, child)):
            ignored.append(said)
            continue
        if key not in hints:
            at = f"{loc}: {path[:-1]}" if path else loc
            renamed = renamed_key(str(key), value, loc) if cls is TrainConfig else None
            problems.append(renamed or _unknown_key(str(key), value, cls, at, child))
            continue
        named = isinstance(value, str) and value in CHATML_TEMPLATES | OTHER_TEMPLATES
        if key == "chat_template" and named and not Path(value).is_file():
            if value in OTHER_TEMPLATES:  # (Axolotl names a template this way)
                problems.append(ConfigError(f"{loc}: key 'chat_template': {template_hint(value)}"))
                continue
            if ignored is not None:
                ignored.append(f"chat_template: {value} (the checkpoint's own chat template, Qwen's ChatML)")
                kwargs[key] = None
                continue
        try:
            kwargs[key] = _coerce(value, hints[key], f"{loc}: key '{path}{key}'", child, (where, path + key, problems))
        except ConfigError as e:
            hint = FOREIGN_VALUES.get(key, {}).get(value) if isinstance(value, str) else None
            problems.append(ConfigError(f"{e}: {hint}") if hint else e)
    return kwargs


def _build(cls: type, data: dict, where: str, node=None, problems: list | None = None, path: str = "") -> Any:
    """`cls(**data)` checked key by key; with `problems` given they are collected there (and None returned)."""
    own = [] if problems is None else problems
    before = len(own)
    kwargs = _fields(cls, data, where, node, own, path)
    if problems is None and own:
        raise together(own)
    return cls(**kwargs) if len(own) == before else None


def together(problems: list[ConfigError]) -> ConfigError:
    """One error for all of `problems`: the error itself when it is one, else one line for each."""
    if len(problems) == 1:
        return problems[0]
    lines = "\n".join(f"  {p}" for p in problems)
    return ConfigError(f"{len(problems)} problems in the config (each below; fix them all, nothing was run):\n{lines}")


def load_yaml(text: str, where: str) -> tuple[Any, yaml.Node | None]:
    """YAML text as Python values, and its node tree (lines; values as written). Aliases that expand past
    MAX_CONFIG_VALUES values, or hold themselves, are refused before any value is built; a YAMLError passes."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        expanded(node, where, {}, set())
        twice = duplicate_keys(node, where, set())
        if twice:
            raise together(twice)
        try:
            return loader.construct_document(node), node
        except ValueError:  # a scalar its type cannot build, such as the date of a 13th month: taken as its text
            as_text(node)
            return yaml.SafeLoader("").construct_document(node), node
    except RecursionError:
        raise ConfigError(f"{where}: the YAML is nested too deeply; write a flat mapping of config keys") from None
    finally:
        loader.dispose()


# Keys typed str (or str | None): their values are text, as written.
_TEXT_KEYS = {k for k, tp in typing.get_type_hints(TrainConfig).items() if str in typing.get_args(tp) or tp is str}
_LISTS = {k for k, tp in typing.get_type_hints(TrainConfig).items() if typing.get_origin(tp) is list}
_DEFAULTS = {f.name: getattr(TrainConfig(), f.name) for f in dataclasses.fields(TrainConfig)}


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


def validate(cfg: TrainConfig, at: Callable[[str], str] = lambda key: "", training: bool = True) -> None:
    """Range checks that types cannot express; `at`: a key's place as a prefix (file and line, or command line);
    `training`: with the checks of what only training reads (config_checks.value_checks)."""
    failed = {}  # the first bound a key fails
    for ok, key, value, what in range_checks(cfg) + value_checks(cfg, PRESET_LEARNING_RATE, training):
        if not ok and key not in failed:
            failed[key] = ConfigError(f"{at(key)}config key '{key}' = {_SHOW.repr(value)} {what}")
    failed = list(failed.values())
    if failed:
        raise together(failed)
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
    entries = [("datasets", cfg.resolved_datasets()), ("test_datasets", cfg.test_datasets)]
    for key, i, ds in [(key, i, ds) for key, dss in entries for i, ds in enumerate(dss)]:
        if not ds.path:
            raise ConfigError(f"config key '{key}[{i}].path' is empty; give a data file, directory or dataset id")
        if not ds.roles_to_train and ds.type in ("auto", "chat", "sharegpt") and not cfg.train_on_inputs:
            raise ConfigError(
                f"config key '{key}[{i}].roles_to_train' is empty, so no token of a chat would be trained on; "
                "name the roles to train on (e.g. [assistant])"
            )


def compile_overrides(cfg: TrainConfig) -> dict[str, str]:
    """`compile_overrides` as the class -> decision mapping `compile_model(..., overrides=)` takes."""
    return dict(item.split("=", 1) for item in cfg.compile_overrides)


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
