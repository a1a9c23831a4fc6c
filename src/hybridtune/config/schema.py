"""`TrainConfig`: the run configuration's keys, one class per concern composed into one flat set of keys (what a
YAML file and `--key value` name); `config_help`, every key with its type, default and help for `hybridtune train
--help`; what the keys' declarations say about them all (`PATH_KEYS`, `NOT_EMPTY`)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from hybridtune.config.adapter import AdapterKeys
from hybridtune.config.data import DataKeys, DatasetConfig
from hybridtune.config.grpo import GRPOKeys
from hybridtune.config.kernels import KernelKeys, LossKeys
from hybridtune.config.keys import type_name
from hybridtune.config.model import ModelKeys
from hybridtune.config.objective import ObjectiveKeys
from hybridtune.config.optimisation import OptimKeys
from hybridtune.config.preference import PreferenceKeys
from hybridtune.config.run import RunKeys
from hybridtune.config.speed import SpeedKeys
from hybridtune.config.vision import VisionKeys


# A dataclass lists the fields of its bases from the last base to the first: the keys (in `--help`, in a run's
# recorded config) run from KernelKeys' to SpeedKeys'.
@dataclass
class TrainConfig(
    SpeedKeys,
    RunKeys,
    LossKeys,
    PreferenceKeys,
    ObjectiveKeys,
    OptimKeys,
    AdapterKeys,
    DataKeys,
    ModelKeys,
    GRPOKeys,
    VisionKeys,
    KernelKeys,
):
    """Every key of a run (each concern's class holds its keys, their help and bounds)."""


# Keys whose value names a file or directory (a `$VAR` in one is refused; its length is bounded), and the text keys
# whose empty value means nothing, with what to give instead.
PATH_KEYS = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("path"))
NOT_EMPTY = {f.name: f.metadata["not_empty"] for f in dataclasses.fields(TrainConfig) if "not_empty" in f.metadata}


def config_help() -> str:
    """Every key with its type, default and meaning, for `hybridtune train --help`."""
    rows = []
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if f.name == "datasets":
            default = "[bundled arithmetic chats]"
        shown = f.metadata["shown"]() if "shown" in f.metadata else type_name(hints[f.name])  # (the values now)
        rows.append(f"  --{f.name} ({shown}, default {default!r})\n      {f.metadata['help']}")
    ds_rows = []
    ds_hints = typing.get_type_hints(DatasetConfig)
    for f in dataclasses.fields(DatasetConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        ds_rows.append(f"    {f.name} ({type_name(ds_hints[f.name])}, default {default!r}): {f.metadata['help']}")
    return (
        "config keys (YAML file or --key value):\n"
        + "\n".join(rows)
        + "\n\n  each entry of `datasets` and `test_datasets`:\n"
        + "\n".join(ds_rows)
    )
