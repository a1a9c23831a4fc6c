"""Several datasets from the command line, in the forms docs/CONFIG.md gives: `--dataset a --dataset b` (once trained
only `b`, silently), `--datasets a,b` and `--datasets '[a, b]'` (once refused), and `datasets: [a, b]` in a file;
each source is loaded and named in the log, none dropped."""

from __future__ import annotations

import json
import random

import pytest

from hybridtune.config import load_config, parse_overrides


def _paths(argv: list[str]) -> list[str]:
    cfg = load_config(None, parse_overrides(argv), warn=False)
    return [d.path for d in cfg.resolved_datasets()]


@pytest.fixture
def names():
    k = random.randint(2, 4)
    return [f"/data/part-{random.randint(0, 10**6)}-{i}.jsonl" for i in range(k)]


def test_dataset_given_again_adds_a_source(names):
    argv = [a for n in names for a in ("--dataset", n)]
    assert _paths(argv) == names
    assert _paths(["--dataset", names[0]]) == names[:1]  # once: one path, as before
    typed = load_config(None, parse_overrides([*argv, "--dataset_type", "alpaca"]), warn=False)
    assert [d.type for d in typed.resolved_datasets()] == ["alpaca"] * len(names)


def test_datasets_as_a_comma_list_or_a_yaml_list_of_paths(names, tmp_path):
    assert _paths(["--datasets", ",".join(names)]) == names
    assert _paths(["--datasets", "[" + ", ".join(names) + "]"]) == names
    assert _paths([a for n in names for a in ("--datasets", n)]) == names
    mixed = _paths(["--datasets", f"[{{path: {names[0]}, type: chat}}]", "--datasets", ",".join(names[1:])])
    assert mixed == names
    p = tmp_path / "c.yaml"
    p.write_text("datasets: [" + ", ".join(names) + "]\n")
    cfg = load_config(p, warn=False)
    assert [d.path for d in cfg.datasets] == names and {d.type for d in cfg.datasets} == {"auto"}


def test_each_dataset_is_loaded_and_named(tmp_path, capsys):
    from hybridtune.cli import main

    sizes = [random.randint(20, 40), random.randint(20, 40)]
    files = []
    for i, n in enumerate(sizes):
        f = tmp_path / f"d{i}.jsonl"
        rows = [{"messages": [{"role": "user", "content": f"{j}+{i}="}, {"role": "assistant", "content": f"{j + i}"}]}
                for j in range(n)]  # fmt: skip
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
        files.append(str(f))
    assert main(["data", "--dataset", files[0], "--dataset", files[1], "--rows", "0", "--val_set_size", "0"]) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    for f, n in zip(files, sizes):
        assert f"dataset {f}: tokenised {n} examples" in text  # (fresh files: no cache)
    assert f"packing: {sum(sizes)} training examples" in text
