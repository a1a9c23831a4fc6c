"""`hybridtune bench`'s flags: spelled as `hybridtune train`'s config keys, each with help; the dashed spellings
and those of earlier releases (in benchmarks/results.jsonl's recorded commands) still parse, unlisted."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from hybridtune.bench.command import OLD_FLAGS, parse_args
from hybridtune.config import TrainConfig

TRAIN_KEYS = {f.name for f in dataclasses.fields(TrainConfig)}
# Bench settings with no train key of the same meaning (train's warmup_steps is the learning-rate warm-up,
# max_steps counts every step; the bench times `steps` after `warmup` untimed ones).
BENCH_ONLY = {"modes", "steps", "warmup", "layouts", "startup_timeout", "mode_timeout", "compile_backend", "profile"}
BENCH_ONLY |= {"title", "results", "save_kernel_configs", "vision"}


def _parser() -> argparse.ArgumentParser:
    captured = {}
    real = argparse.ArgumentParser.parse_args

    def grab(self, argv=None, namespace=None):
        captured["parser"] = self
        return real(self, argv, namespace)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", grab)
        parse_args([])
    return captured["parser"]


def test_listed_flags_are_train_keys_or_bench_settings_each_with_help(capsys):
    listed = [a for a in _parser()._actions if a.help is not argparse.SUPPRESS and a.dest != "help"]
    names = {a.option_strings[0][2:] for a in listed}
    assert all(len(a.option_strings) == 1 for a in listed)  # one spelling shown per flag
    assert all("-" not in n for n in names), names  # snake_case, as train's keys
    assert names - BENCH_ONLY <= TRAIN_KEYS, names - BENCH_ONLY - TRAIN_KEYS
    assert {"base_model", "sequence_len", "adapter", "lora_r", "lora_target_modules", "learning_rate"} <= names
    assert {"seed", "output_dir"} <= names
    for a in listed:
        assert a.help and len(a.help) > 10, a.dest
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = capsys.readouterr().out
    for old in ("--seq-len ", "--preset ", "--out-dir ", "--lr ", "--lora-targets ", "--startup-timeout "):
        assert old not in text  # the aliases parse but are not listed


NEW = [
    "--base_model", "tiny-qwen3_next", "--sequence_len", "128", "--learning_rate", "0.5", "--output_dir", "x",
    "--lora_target_modules", "q_proj,v_proj", "--startup_timeout", "3", "--mode_timeout", "9", "--lora_r", "4",
    "--compile_backend", "aot_eager",
]  # fmt: skip
# The spellings of the commands recorded in benchmarks/results.jsonl and the scripts before the rename.
OLD = [
    "--preset", "tiny-qwen3_next", "--seq-len", "128", "--lr", "0.5", "--out-dir", "x",
    "--lora-targets", "q_proj,v_proj", "--startup-timeout", "3", "--mode-timeout", "9", "--lora-r", "4",
    "--compile-backend", "aot_eager",
]  # fmt: skip


def test_old_and_dashed_spellings_parse_to_the_same_settings():
    new = parse_args(NEW)
    assert (new.base_model, new.sequence_len, new.learning_rate, new.output_dir) == ("tiny-qwen3_next", 128, 0.5, "x")
    assert (new.lora_target_modules, new.startup_timeout, new.mode_timeout, new.lora_r) == ("q_proj,v_proj", 3, 9, 4)
    assert parse_args(OLD) == new
    dashed = [a.replace("_", "-") if a.startswith("--") else a for a in NEW]  # --sequence-len, as train accepts
    assert parse_args(dashed) == new
    assert parse_args(["--seq_len", "64"]).sequence_len == 64  # an old name in snake_case too
    assert parse_args(["--seq-len", "64", "--sequence_len", "32"]).sequence_len == 32  # the last one wins
    defaults = parse_args([])
    assert defaults.sequence_len is None and defaults.learning_rate == 1e-4 and defaults.output_dir == "outputs/bench"
    assert set(OLD_FLAGS) <= set(vars(defaults))
    with pytest.raises(SystemExit):
        parse_args(["--seq-len", "many"])  # the alias keeps the type check


def test_recorded_bench_commands_still_parse():
    table = Path(__file__).resolve().parents[2] / "benchmarks/results.jsonl"
    commands = [json.loads(line)["command"] for line in table.read_text(encoding="utf-8").splitlines() if line.strip()]
    bench = sorted({c.split("hybridtune bench", 1)[1] for c in commands if c.startswith("hybridtune bench")})
    assert bench
    for args in bench:
        argv = args.split()
        parse_args(argv)  # argparse exits on an unknown flag
