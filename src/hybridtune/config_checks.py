"""Checks across a config's keys once the file and the command line are merged, each naming the file line (or the
command line) of the keys involved: a path holding an environment variable, QLoRA with 4-bit turned off; the value
bounds `config_schema.range_checks` leaves open (`value_checks`, in its form); YAML scalars no type can build; the
YAML's node tree before any value is built: aliases that expand past MAX_CONFIG_VALUES, a key given twice."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from hybridtune.errors import ConfigError

PATH_KEYS = ("base_model", "tokenizer", "chat_template", "dataset", "output_dir", "resume_from_checkpoint")
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


# torch, numpy and the run's JSON files hold an int key's value in 64 bits; past that (a count typed with a few hundred
# digits) a run failed deep inside with an OverflowError.
MAX_INT = 2**63 - 1
# The longest file name and path the file systems hybridtune runs on take (ext4, XFS, APFS: 255 bytes a name; Linux:
# 4096 a path); past them the first stat() of the path was an OSError traceback (File name too long).
MAX_NAME, MAX_PATH = 255, 4096
# The preference objectives' strengths and margin (TRL's values run from about 0.01 to 10): far past them the
# gradient overflows, and the run stopped saying the model's numbers overflow on this data (try bf16: false).
MAX_PREFERENCE = {"beta": 1e3, "rpo_alpha": 1e3, "simpo_gamma": 1e3}
# Text keys whose empty value means nothing: the empty dataset silently trained on the bundled sample (`datasets`'
# default), the empty output_dir was the working directory.
NOT_EMPTY = {
    "base_model": "give a preset, a hub id or a checkpoint directory",
    "dataset": "give a data file, directory or dataset id, or leave it out (null) to use datasets",
    "output_dir": "give a directory",
    "revision": "give a branch, tag or commit, or leave it out (null) for main",
    "tokenizer": "give a tokenizer directory, or leave it out (null) for the model's own",
    "chat_template": "give a .jinja/.txt file or a template's name, or leave it out (null) for the tokenizer's own",
    "run_name": "give a name, or leave it out (null) for output_dir's name",
    "resume_from_checkpoint": "give a checkpoint directory or 'latest', or leave it out (null) to start afresh",
}


# More tokenising processes than this is no machine's: a typo (a larger count than the cores is capped, said once).
MAX_PROCS = 4096


def value_checks(cfg: Any, auto_lr: float, training: bool = True) -> list[tuple[bool, str, Any, str]]:
    """(ok, key, value, what it must be) for bounds `config_schema.range_checks` leaves open, in its form: each int
    within 64 bits; no NUL in a text (the OS refuses it in a path: a ValueError deep in the run); no empty text where
    empty means nothing; no path past the system's limits; a whole val_set_size count; a weight decay AdamW can apply
    (each step multiplies the weights by 1 - lr x weight_decay: from 1 on that zeroes or flips them, and the run
    stopped as diverged telling to lower learning_rate); preference strengths that keep the gradient finite;
    eval_samples with examples to sample from; dataset_num_proc 0 (auto) to MAX_PROCS. `auto_lr`: the largest rate
    `learning_rate: auto` picks. `training` False (a recorded run's config, eval's) leaves out what only training
    reads (the held-out split, weight decay, the preference strengths, eval_samples): a run that trained with a value a later version
    bounds still opens."""
    items = list(vars(cfg).items())
    for key in ("datasets", "test_datasets"):
        items += [(f"{key}[{i}].{k}", v) for i, ds in enumerate(getattr(cfg, key)) for k, v in vars(ds).items()]
    nul = [
        (k, v) for k, v in items if any(isinstance(x, str) and "\0" in x for x in (v if isinstance(v, list) else [v]))
    ]
    ints = [(k, v) for k, v in items if isinstance(v, int) and not isinstance(v, bool)]
    paths = [(k, v) for k, v in items if k in (*PATH_KEYS, "reward_funcs") or k.endswith("].path")]
    long = [(k, v) for k, v in paths if any(_too_long(x) for x in (v if isinstance(v, list) else [v]))]
    size, lr = cfg.val_set_size, auto_lr if cfg.learning_rate == "auto" else cfg.learning_rate
    auto = " (the largest auto learning_rate)" if cfg.learning_rate == "auto" else ""
    decay = (
        f"times learning_rate {lr:g}{auto} must stay below 1 (AdamW multiplies each weight by 1 - lr x weight_decay "
    )
    preference = [(k, getattr(cfg, k), top) for k, top in MAX_PREFERENCE.items()]
    whole = "must be a share below 1 or a whole count of examples"
    whole += " (1 is refused: as a share it holds out every example, as a count one: give 2 or more)" * (size == 1)
    train = [
        (size < 1 or size == int(size) > 1, "val_set_size", size, whole),
        (lr * cfg.weight_decay < 1, "weight_decay", cfg.weight_decay, decay + "every step); fine-tunes use 0 to 0.1"),
        *[
            (abs(v or 0) <= top, k, v, f"must be at most {top:g} (TRL's values are 0.01 to 10)")
            for k, v, top in preference
        ],
        (
            not cfg.eval_samples or size > 0 or bool(cfg.test_datasets),
            "eval_samples",
            cfg.eval_samples,
            "needs held-out examples to take prompts from, and val_set_size is 0 with no test_datasets; set one",
        ),
    ]
    return [
        *(train if training else []),
        *[(abs(v) <= MAX_INT, k, v, "must be at most 2**63 - 1 in size (a 64-bit int)") for k, v in ints],
        *[
            (False, k, v, f"is too long a path (at most {MAX_NAME} bytes a name, {MAX_PATH} the whole)")
            for k, v in long
        ],
        *[(False, k, v, "holds a NUL character (\\0), which no path or name can hold") for k, v in nul],
        *[(getattr(cfg, k) != "", k, "", f"is empty; {what}") for k, what in NOT_EMPTY.items()],
        (
            0 <= cfg.dataset_num_proc <= MAX_PROCS,
            "dataset_num_proc",
            cfg.dataset_num_proc,
            f"must be 0 (auto: this machine's cores) to {MAX_PROCS}",
        ),
    ]


def _too_long(path: Any) -> bool:
    if not isinstance(path, str):
        return False
    return len(path.encode()) > MAX_PATH or any(len(part.encode()) > MAX_NAME for part in path.split("/"))


def as_text(node: yaml.Node) -> None:
    """Retag as text each scalar that YAML resolves to a type and then cannot build (a date of a 13th month, an int of
    more than 4,300 digits), which escaped as a bare ValueError: a text key takes it as written, any other key's type
    names it with its key and line."""
    loader, stack = yaml.SafeLoader(""), [node]
    while stack:  # (aliases are already bounded by load_yaml's count)
        n = stack.pop()
        if isinstance(n, yaml.SequenceNode):
            stack += n.value
        elif isinstance(n, yaml.MappingNode):
            stack += [x for pair in n.value for x in pair]
        else:
            try:
                loader.construct_object(n)
            except ValueError:
                n.tag = "tag:yaml.org,2002:str"
    loader.dispose()


# A YAML alias (*name) repeats the value its anchor (&name) marks; nested, a few hundred bytes expand to billions of
# values. A real config holds a few hundred, so one that expands past this many (each alias counted at each use) is
# refused before its values are built or shown.
MAX_CONFIG_VALUES = 100_000


def duplicate_keys(node: yaml.Node, where: str, seen: set[int]) -> list[ConfigError]:
    """A key given twice in one mapping, anywhere in `node` (YAML would keep the last value without a word): one
    problem for each, naming the key and both lines. A merge key (`<<: *base`) is YAML's own and may repeat."""
    if id(node) in seen:
        return []
    seen.add(id(node))
    out: list[ConfigError] = []
    kids = list(node.value) if isinstance(node, yaml.SequenceNode) else []
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key, value in node.value:
            kids.append(value)
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            line = key.start_mark.line + 1
            if key.value in first:
                at = "command line" if where == "command line" else f"{where}:{line}"
                lines = "" if where == "command line" else f" (lines {first[key.value]} and {line})"
                out.append(ConfigError(f"{at}: key '{key.value}' given twice{lines}; keep one (YAML keeps the last)"))
            else:
                first[key.value] = line
    for kid in kids:
        out += duplicate_keys(kid, where, seen)
    return out


def expanded(node: yaml.Node, where: str, sizes: dict[int, int], open_: set[int]) -> int:
    """How many values `node` stands for with every alias written out (each shared node counted once, by id)."""
    if id(node) in sizes:
        return sizes[id(node)]
    line = where if where == "command line" else f"{where}:{node.start_mark.line + 1}"
    if id(node) in open_:
        raise ConfigError(f"{line}: a YAML alias (*name) inside the value its anchor marks (a loop); write it out")
    open_.add(id(node))
    kids = node.value if isinstance(node, yaml.SequenceNode) else ()
    if isinstance(node, yaml.MappingNode):
        kids = [n for pair in node.value for n in pair]
    sizes[id(node)] = total = 1 + sum(expanded(k, where, sizes, open_) for k in kids)
    open_.discard(id(node))
    if total > MAX_CONFIG_VALUES:
        raise ConfigError(
            f"{line}: the YAML's aliases (*name) expand to more than {MAX_CONFIG_VALUES:,} values; a config "
            "needs far fewer: write the values out"
        )
    return total


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
