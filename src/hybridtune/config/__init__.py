"""The run configuration: one flat set of keys (a YAML file plus `--key value`), declared by concern, each with its
default, help and bounds (`keys.key`): model.py, data.py, adapter.py, optimisation.py, objective.py (the objective
and its `beta` / `loss_type`), preference.py, grpo.py, vision.py, kernels.py, run.py, speed.py; composed in
schema.py (`TrainConfig`, `--help`). load.py reads a config (parse.py key by key, yaml_tree.py the YAML, cross.py
the checks across keys, bounds.py the one walker over every key's bounds) and says every problem at once with its
file, line and a did-you-mean; foreign.py knows other tools' keys. What other layers use is named here."""

from __future__ import annotations

from hybridtune.config.adapter import ALL_LINEAR, DEFAULT_LORA_TARGETS, AdapterKeys
from hybridtune.config.bounds import bound_problems, validate
from hybridtune.config.data import BUNDLED_DATASET, MAX_PROCS, PRESET_SEQUENCE_LEN, DataKeys, DatasetConfig
from hybridtune.config.foreign import FOREIGN_DATASET_KEYS, FOREIGN_KEYS, RENAMED_KEYS
from hybridtune.config.grpo import REWARD_BUILTINS, GRPOKeys, grpo_warnings, reward_file
from hybridtune.config.kernels import KernelKeys, LossKeys
from hybridtune.config.keys import MAX_INT, Bound, key, together, type_name
from hybridtune.config.load import (
    BUNDLED_CONFIG_DIR,
    BUNDLED_CONFIG_PREFIX,
    LORA_KEYS,
    bundled_configs,
    compile_overrides,
    config_warnings,
    load_config,
    parse_overrides,
    read_config_text,
    resolve_config_path,
    to_dict,
    warmup_warning,
)
from hybridtune.config.model import ModelKeys
from hybridtune.config.objective import ObjectiveKeys
from hybridtune.config.optimisation import MAX_LEARNING_RATE, PRESET_LEARNING_RATE, OptimKeys
from hybridtune.config.preference import MAX_PREFERENCE, PreferenceKeys
from hybridtune.config.run import MAX_SEED, RunKeys
from hybridtune.config.schema import NOT_EMPTY, PATH_KEYS, TrainConfig, config_help
from hybridtune.config.speed import THREADS_PER_CPU, SpeedKeys, max_num_threads
from hybridtune.config.traits import (
    PAIR_OBJECTIVES,
    ObjectiveTraits,
    known_objective,
    objective_names,
    objective_traits,
    owned_keys,
    owners,
    register_traits,
    unknown_objective,
)
from hybridtune.config.vision import VisionKeys
from hybridtune.config.yaml_tree import load_yaml

__all__ = [
    "ALL_LINEAR",
    "BUNDLED_CONFIG_DIR",
    "BUNDLED_CONFIG_PREFIX",
    "BUNDLED_DATASET",
    "DEFAULT_LORA_TARGETS",
    "FOREIGN_DATASET_KEYS",
    "FOREIGN_KEYS",
    "LORA_KEYS",
    "MAX_INT",
    "MAX_LEARNING_RATE",
    "MAX_PREFERENCE",
    "MAX_PROCS",
    "MAX_SEED",
    "NOT_EMPTY",
    "PAIR_OBJECTIVES",
    "PATH_KEYS",
    "PRESET_LEARNING_RATE",
    "PRESET_SEQUENCE_LEN",
    "RENAMED_KEYS",
    "REWARD_BUILTINS",
    "THREADS_PER_CPU",
    "AdapterKeys",
    "Bound",
    "DataKeys",
    "DatasetConfig",
    "GRPOKeys",
    "KernelKeys",
    "LossKeys",
    "ModelKeys",
    "ObjectiveKeys",
    "ObjectiveTraits",
    "OptimKeys",
    "PreferenceKeys",
    "RunKeys",
    "SpeedKeys",
    "TrainConfig",
    "VisionKeys",
    "bound_problems",
    "bundled_configs",
    "compile_overrides",
    "config_help",
    "config_warnings",
    "grpo_warnings",
    "key",
    "known_objective",
    "load_config",
    "load_yaml",
    "max_num_threads",
    "objective_names",
    "objective_traits",
    "owned_keys",
    "owners",
    "parse_overrides",
    "read_config_text",
    "register_traits",
    "resolve_config_path",
    "reward_file",
    "to_dict",
    "together",
    "type_name",
    "unknown_objective",
    "validate",
    "warmup_warning",
]
