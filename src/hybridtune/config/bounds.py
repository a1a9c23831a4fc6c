"""The one walker over a built config's keys (`bound_problems`): each key's declared bounds (`keys.Bound`, in the
order declared) and then what its type and kind bound for every key alike: an int within 64 bits, a text without NUL
(the OS refuses it in a path: a ValueError deep in the run), no path past the system's limits, no empty text where
empty means nothing; the entries of `datasets` and `test_datasets` walked as `datasets[0].path`. `validate` says the
first bound each key fails, all at once, then the checks of a built config that are no key's bound."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

from hybridtune.config.keys import INT64, SHOW, Bound, together
from hybridtune.errors import ConfigError

# The longest file name and path the file systems hybridtune runs on take (ext4, XFS, APFS: 255 bytes a name; Linux:
# 4096 a path); past them the first stat() of the path was an OSError traceback (File name too long).
MAX_NAME, MAX_PATH = 255, 4096


def _items(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def _too_long(path: Any) -> bool:
    if not isinstance(path, str):
        return False
    return len(path.encode()) > MAX_PATH or any(len(part.encode()) > MAX_NAME for part in path.split("/"))


NO_NUL = Bound(
    lambda v, cfg: not any(isinstance(x, str) and "\0" in x for x in _items(v)),
    "holds a NUL character (\\0), which no path or name can hold",
)
PATH_LENGTH = Bound(
    lambda v, cfg: not any(_too_long(x) for x in _items(v)),
    f"is too long a path (at most {MAX_NAME} bytes a name, {MAX_PATH} the whole)",
)


def _kind_bounds(f: dataclasses.Field, value: Any) -> list[Bound]:
    """What a key's type and kind bound, after its own bounds."""
    out = [INT64] if isinstance(value, int) and not isinstance(value, bool) else []
    out += [PATH_LENGTH] if f.metadata.get("path") else []
    out.append(NO_NUL)
    if "not_empty" in f.metadata:
        out.append(Bound(lambda v, cfg: v != "", f"is empty; {f.metadata['not_empty']}"))
    return out


def _walk(obj: Any, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(name, field, value) of every key of `obj`; a list of dataclasses' entries after it, by index."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        yield prefix + f.name, f, value
        if isinstance(value, list):
            for i, entry in enumerate(value):
                if dataclasses.is_dataclass(entry):
                    yield from _walk(entry, f"{prefix}{f.name}[{i}].")


def bound_problems(cfg: Any, training: bool = True) -> list[tuple[str, Any, str]]:
    """(key, value, what it must be) for the first bound each key fails; `training` False (a recorded run's config,
    eval's) leaves out the bounds of what only training reads: a run that trained with a value a later version
    bounds still opens."""
    out = []
    for name, f, value in _walk(cfg):
        declared = f.metadata.get("bounds", ())
        for bound in (*declared, *[b for b in _kind_bounds(f, value) if b not in declared]):
            if (training or not bound.training) and not bound.ok(value, cfg):
                out.append((name, value, bound.said(cfg)))
                break
    return out


def validate(cfg: Any, at: Callable[[str], str] = lambda key: "", training: bool = True) -> None:
    """Every key's bounds (`bound_problems`), then the checks that are no key's bound; `at`: a key's place as a
    prefix (file and line, or command line); `training`: with the bounds of what only training reads."""
    failed = [
        ConfigError(f"{at(key)}config key '{key}' = {SHOW.repr(value)} {what}")
        for key, value, what in bound_problems(cfg, training)
    ]
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
