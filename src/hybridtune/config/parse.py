"""A config's keys read into values, key by key: each value checked against its key's annotation and converted where
it is lossless (`_coerce`), an unknown key named with what to write instead (a renamed key, another tool's, the
nearest known one), another tool's key whose value changes nothing here set aside for one warning (`_fields`). Every
problem is collected, so that one run names them all with their file and line."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from hybridtune.config.data import DatasetConfig
from hybridtune.config.foreign import (
    CHATML_TEMPLATES,
    FOREIGN_DATASET_KEYS,
    FOREIGN_KEYS,
    FOREIGN_VALUES,
    OTHER_TEMPLATES,
    noop,
    renamed_key,
    template_hint,
)
from hybridtune.config.keys import SHOW, together, type_name
from hybridtune.config.schema import TrainConfig
from hybridtune.errors import ConfigError

# YAML 1.1 reads these words (unquoted) as booleans; an enum key that has one of them as a value takes it back.
_YAML_BOOL_WORDS = {True: ("on", "yes", "true"), False: ("off", "no", "false")}
# The least similarity (difflib's ratio) at which an unknown key's hint names a known key: below it the nearest
# key is another setting (`strict` is not `distributed`, `group_by_length` not `max_prompt_length`).
NEAR = 0.75
# Each key's default: another tool's key set to our default under its other name changes nothing here.
_DEFAULTS = {f.name: getattr(TrainConfig(), f.name) for f in dataclasses.fields(TrainConfig)}


def _coerce(value: Any, tp: Any, where: str, node: yaml.Node | None = None, nest: tuple | None = None) -> Any:
    """Check `value` against the annotation `tp`; convert where it is lossless (int -> float). `node`: the value's
    YAML node (a str key takes its text as written: `revision: 1.10` is '1.10', never 1.1); `nest`: (file, key
    path, problems) for a dataclass inside, whose problems are collected there."""
    origin = typing.get_origin(tp)

    def bad() -> ConfigError:  # built only on failure, the value shortened
        return ConfigError(f"{where}: expected {type_name(tp)}, got {SHOW.repr(value)}")

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
            shown = number if isinstance(value, float) or len(str(value)) < 10 else SHOW.repr(value)
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
    no-op of foreign.py, or our default under its other name); None when it would change training."""
    said = noop(key, value)
    ours = FOREIGN_KEYS.get(key)
    if said is None and ours in hints:
        try:
            same = _coerce(value, hints[ours], key, child) == _DEFAULTS[ours]
        except ConfigError:
            same = False
        said = f"{key}: {SHOW.repr(value)} ({ours}'s default)" if same else None
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
