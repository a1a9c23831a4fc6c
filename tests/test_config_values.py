"""Every config key, walked from the dataclasses (a key added later is covered without editing this file), given bad
values of its type on the command line and in a YAML file: the answer is a one-line ConfigError naming the key, or the
value is taken; never another exception. Then the nonsense values that used to pass or crash, each by name."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Literal, Union

import pytest

from hybridtune.config import DatasetConfig, TrainConfig, load_config, parse_overrides
from hybridtune.errors import ConfigError

HUGE = "1" + "0" * 400  # an int past float's range
HUGER = "1" + "0" * 5000  # past the digits Python turns into an int
BAD = {
    "num": ["nan", "inf", "-inf", "-1", "0", "1e30", HUGE, HUGER, "abc", "", "2026-13-45"],
    "bool": ["maybe", "2", ""],
    "str": ["", "no_such_name", "x" * 5000, "2026-13-45", HUGER],
    "list": ["[]", "[1, 2]", "[[1]]", "{a: 1}", "[null]"],
}


def _kinds(tp) -> set[str]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return set().union(*(_kinds(a) for a in typing.get_args(tp)))
    if origin is list or tp is dict:
        return {"list"}
    if origin is Literal or tp is str:
        return {"str"}
    return {int: {"num"}, float: {"num"}, bool: {"bool"}}.get(tp, set())


def _values(tp) -> list[str]:
    return [v for kind in sorted(_kinds(tp)) for v in BAD[kind]]


def _answer(key: str, path, overrides: dict | None = None) -> None:
    """load_config takes the value or refuses it in one line naming `key`; anything else fails the test."""
    try:
        load_config(path, overrides, warn=False)
    except ConfigError as e:
        assert "\n" not in str(e), f"{key}: more than one line: {e}"
        assert key in str(e), f"{key}: the message does not name the key: {e}"


TOP = [f for f in dataclasses.fields(TrainConfig) if f.name not in ("datasets", "test_datasets")]


@pytest.mark.parametrize("key", [f.name for f in TOP])
def test_every_key_refuses_bad_values_in_one_line_or_takes_them(key, tmp_path):
    out = str(tmp_path / "out")
    for raw in _values(typing.get_type_hints(TrainConfig)[key]):
        _answer(key, None, parse_overrides(["--output_dir", out, f"--{key}={raw}"]))
        p = tmp_path / "c.yaml"
        p.write_text(f"output_dir: {out}\n{key}: {json.dumps(raw) if raw == '' else raw}\n")
        _answer(key, p)


# A number key whose -1 means something (max_steps: no limit, the epochs decide); every other one refuses it.
NEGATIVE_MEANS = {"max_steps"}
NEVER = ["nan", "inf", "-inf", HUGE, "abc"]  # no number key takes these


@pytest.mark.parametrize("key", [f.name for f in TOP if "num" in _kinds(typing.get_type_hints(TrainConfig)[f.name])])
def test_every_number_key_refuses_what_no_count_or_rate_is(key, tmp_path):
    """The walk above only proves there is no traceback; this one fails when a bound goes: every number key refuses
    NaN, infinities, a value past float's range and text, and -1 unless -1 means something there."""
    out = str(tmp_path / "out")
    for raw in NEVER + ([] if key in NEGATIVE_MEANS else ["-1"]):
        with pytest.raises(ConfigError, match=key) as e:
            load_config(None, parse_overrides(["--output_dir", out, f"--{key}={raw}"]), warn=False)
        assert "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("key", [f.name for f in dataclasses.fields(DatasetConfig)])
@pytest.mark.parametrize("where", ["datasets", "test_datasets"])
def test_every_dataset_entry_key_refuses_bad_values_in_one_line_or_takes_them(key, where, tmp_path):
    out = str(tmp_path / "out")
    for raw in _values(typing.get_type_hints(DatasetConfig)[key]):
        value = json.dumps(raw) if raw == "" or len(raw) > 100 else raw
        entry = f"[{{path: a.jsonl, {key}: {value}}}]" if key != "path" else f"[{{path: {value}}}]"
        _answer(key, None, parse_overrides(["--output_dir", out, f"--{where}", entry]))


def _refused(argv: list[str], match: str, tmp_path) -> str:
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, parse_overrides(["--output_dir", str(tmp_path / "out"), *argv]), warn=False)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("key", ["learning_rate", "beta", "temperature", "val_set_size", "epsilon_high"])
def test_a_float_key_given_an_int_past_floats_range_is_refused(key, tmp_path):
    # was: OverflowError: int too large to convert to float (a traceback)
    _refused([f"--{key}", HUGE], rf"key '{key}': expected a finite float, got 1000.*000; give a number", tmp_path)


@pytest.mark.parametrize("key", ["micro_batch_size", "sequence_len", "gradient_accumulation_steps", "lora_r"])
def test_an_int_key_past_64_bits_is_refused(key, tmp_path):
    # was accepted; the step's memory estimate then failed with OverflowError (or the run never ended)
    _refused(
        [f"--{key}", HUGE], rf"^command line: config key '{key}' = 1000.*000 must be at most 2\*\*63 - 1", tmp_path
    )
    assert load_config(None, {key: 2**63 - 1, "output_dir": str(tmp_path / "o")}, warn=False)


def test_a_key_past_two_bounds_is_named_once(tmp_path):
    text = _refused(
        ["--seed", HUGE], r"^command line: config key 'seed' = 1000.*000 must be between 0 and 2\*\*63 - 1", tmp_path
    )
    assert "problems" not in text and len(text) < 200  # the value shortened, one bound


@pytest.mark.parametrize("raw", [HUGER, "2026-13-45"])
def test_a_value_yaml_cannot_build_is_text_for_a_text_key_and_refused_for_another(raw, tmp_path):
    # was: ValueError: Exceeds the limit (4300 digits) ... / month must be in 1..12 (a traceback), even for run_name
    cfg = load_config(None, parse_overrides(["--run_name", raw, "--output_dir", str(tmp_path / "o")]), warn=False)
    assert cfg.run_name == raw
    _refused(["--micro_batch_size", raw], r"^command line: key 'micro_batch_size': expected int, got '", tmp_path)
    p = tmp_path / "c.yaml"
    p.write_text(f"output_dir: {tmp_path / 'o'}\nrun_name: {raw}\nlora_r: {raw}\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:3: key 'lora_r': expected int, got '") as e:
        load_config(p, warn=False)
    assert "\n" not in str(e.value)
    p.write_text(f"output_dir: {tmp_path / 'o'}\nrun_name: {raw}\n")
    assert load_config(p, warn=False).run_name == raw


def test_an_output_dir_name_past_the_systems_limit_is_refused(tmp_path):
    # was: OSError: [Errno 36] File name too long (a traceback) from the config's own output_dir check
    _refused(
        ["--output_dir", "x" * 5000], r"^command line: config key 'output_dir' = 'xxx.*' is too long a path", tmp_path
    )


def test_a_list_key_in_brackets_on_the_command_line_is_its_list(tmp_path):
    # was ['[q_proj', 'v_proj]']: the text split at the comma, brackets kept; LoRA then matched no module
    argv = ["--output_dir", str(tmp_path / "o"), "--adapter", "lora", "--lora_target_modules", "[q_proj, v_proj]"]
    assert load_config(None, parse_overrides(argv), warn=False).lora_target_modules == ["q_proj", "v_proj"]
    argv[-1] = "q_proj, v_proj"
    assert load_config(None, parse_overrides(argv), warn=False).lora_target_modules == ["q_proj", "v_proj"]
    cfg = load_config(None, parse_overrides(["--reward_funcs", "[format, exact_answer]", "--objective", "grpo"]))
    assert cfg.reward_funcs == ["format", "exact_answer"]
    assert parse_overrides(["--run_name", "[a, b]"])["run_name"] == "[a, b]"  # a text key keeps its text


@pytest.mark.parametrize(
    "key",
    [
        "dataset",
        "output_dir",
        "base_model",
        "revision",
        "tokenizer",
        "chat_template",
        "run_name",
        "resume_from_checkpoint",
    ],
)
def test_an_empty_text_that_means_nothing_is_refused(key, tmp_path):
    # was taken: dataset '' trained on the bundled sample, output_dir '' was the working directory, the others
    # stood for their defaults
    _refused([f"--{key}", ""], rf"^command line: config key '{key}' = '' is empty; give ", tmp_path)


def test_val_set_size_is_a_share_or_a_whole_count(tmp_path):
    # was taken: 1.5 held out 1 example
    _refused(["--val_set_size", "1.5"], r"'val_set_size' = 1\.5 must be a share below 1 or a whole count", tmp_path)
    for ok in ("0", "0.5", "3", "3.0"):
        assert load_config(None, {"val_set_size": ok, "output_dir": str(tmp_path / "o")}, warn=False)


def test_a_nul_in_a_path_or_name_is_refused(tmp_path):
    # was taken; the first open() then raised ValueError: embedded null byte
    for key in ("output_dir", "dataset", "base_model"):
        _refused(
            [f"--{key}", "a\0b"], rf"^command line: config key '{key}' = 'a\\x00b' holds a NUL character", tmp_path
        )
    entry = '[{path: "a\\0b.jsonl"}]'
    _refused(
        ["--datasets", entry],
        r"^command line: config key 'datasets\[0\]\.path' = 'a\\x00b\.jsonl' holds a NUL",
        tmp_path,
    )


def test_a_weight_decay_adamw_cannot_apply_is_refused(tmp_path):
    # was taken: --weight_decay 1e30 stopped at step 2 as diverged, saying to lower learning_rate
    _refused(
        ["--weight_decay", "1e30"], r"'weight_decay' = 1e\+30 times learning_rate 0\.001 \(the largest auto", tmp_path
    )
    _refused(
        ["--weight_decay", "0.5", "--learning_rate", "3"], r"'weight_decay' = 0\.5 times learning_rate 3 must", tmp_path
    )
    for argv in (
        ["--weight_decay", "0.1"],
        ["--weight_decay", "100"],
        ["--weight_decay", "0.5", "--learning_rate", "1"],
    ):
        assert load_config(None, parse_overrides([*argv, "--output_dir", str(tmp_path / "o")]), warn=False)


@pytest.mark.parametrize("key", ["beta", "rpo_alpha", "simpo_gamma"])
def test_a_preference_strength_past_what_trains_is_refused(key, tmp_path):
    # was taken: dpo's beta or rpo_alpha 1e30 stopped at step 1 saying the model's numbers overflow (try bf16: false);
    # simpo_gamma 1e30 trained at a loss of 1e30
    _refused([f"--{key}", "1e30"], rf"^command line: config key '{key}' = 1e\+30 must be at most 1000", tmp_path)
    assert load_config(None, parse_overrides([f"--{key}", "10", "--output_dir", str(tmp_path / "o")]), warn=False)


def test_a_bound_names_the_file_line_or_the_command_line_of_its_key(tmp_path):
    # was: "config key 'lora_r' = 0 must be at least 1", with no place, whichever file or line held it
    p = tmp_path / "c.yaml"
    p.write_text(f"output_dir: {tmp_path / 'o'}\nlora_r: 0\ndatasets: [{{path: a.jsonl, split: x}}]\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, parse_overrides(["--micro_batch_size", "0", "--dataset", "a\0b"]), warn=False)
    lines = str(e.value).splitlines()[1:]  # in the keys' order (as `--help` lists them)
    assert lines[0].startswith("  command line: config key 'dataset' = 'a\\x00b' holds a NUL"), lines
    assert lines[1].startswith(f"  {p}:2: config key 'lora_r' = 0 must be at least 1"), lines
    assert lines[2].startswith("  command line: config key 'micro_batch_size' = 0 must be at least 1"), lines
    p.write_text(f'output_dir: {tmp_path / "o"}\ndatasets: [{{path: a.jsonl}}, {{path: "b\\0"}}]\n')
    with pytest.raises(ConfigError, match=rf"^{p}:2: config key 'datasets\[1\]\.path' = 'b\\x00' holds a NUL"):
        load_config(p, warn=False)


@pytest.mark.parametrize("key", ["base_model", "dataset", "tokenizer", "chat_template", "resume_from_checkpoint"])
def test_a_path_past_the_systems_limits_is_refused(key, tmp_path):
    # was taken; the first stat() of it was an OSError traceback (File name too long)
    _refused([f"--{key}", "x" * 5000], rf"^command line: config key '{key}' = 'xxx.*' is too long a path", tmp_path)
    _refused([f"--{key}", "a/" * 2100], rf"'{key}' = 'a/a/.*' is too long a path \(at most 255 bytes a name", tmp_path)
    entry = "[{path: " + "y" * 300 + ".jsonl}]"
    _refused(["--test_datasets", entry], r"'test_datasets\[0\]\.path' = 'yyy.*' is too long a path", tmp_path)
    _refused(
        ["--objective", "grpo", "--reward_funcs", "z" * 300 + ".py:f"], r"'reward_funcs' = \['zzz.*too long", tmp_path
    )


def test_pixel_limits_for_a_text_only_model_are_refused(tmp_path):
    # was: ignored without a word (freeze_vision_tower: false on the same model is refused)
    from hybridtune.runtime.vision import vision_for

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}))
    with pytest.raises(ConfigError, match=r"^config key 'min_pixels' = 1: this model takes no images .*; remove it"):
        vision_for(tmp_path, None, min_pixels=1)
    with pytest.raises(ConfigError, match=r"^config key 'max_pixels' = 4096: this model takes no images"):
        vision_for(None, None, max_pixels=4096)  # a preset
    assert vision_for(tmp_path, None) is None and vision_for(None, None) is None
    # a trained run's recorded limits (generate of an older run): nothing to remove them from, nothing they resize
    assert vision_for(tmp_path, None, min_pixels=1, recorded=True) is None


def test_eval_samples_without_held_out_examples_is_refused(tmp_path):
    # was taken: --eval_samples 3 --val_set_size 0 trained and generated nothing, without a word
    text = _refused(
        ["--eval_samples", "3", "--val_set_size", "0"], r"'eval_samples' = 3 needs held-out examples", tmp_path
    )
    assert "val_set_size is 0 with no test_datasets" in text
    entry = "[{path: a.jsonl}]"
    argv = ["--eval_samples", "3", "--val_set_size", "0", "--test_datasets", entry, "--output_dir", str(tmp_path / "o")]
    assert load_config(None, parse_overrides(argv), warn=False).eval_samples == 3


def test_dataset_num_proc_past_this_machine_is_capped_and_said_past_any_machine_refused(tmp_path, caplog):
    """A count from a config written on a larger machine is capped at 4 per core with one warning (64 processes on
    2 cores tokenised 300 rows); one past any machine (10**6 would fork until memory ran out) is refused."""
    from hybridtune.config import MAX_PROCS
    from hybridtune.data.examples import resolve_num_proc

    _refused(["--dataset_num_proc", str(MAX_PROCS + 1)], rf"'dataset_num_proc' = {MAX_PROCS + 1} must be 0 ", tmp_path)
    _refused(["--dataset_num_proc", "-1"], r"'dataset_num_proc' = -1 must be 0 \(auto", tmp_path)
    assert load_config(None, {"dataset_num_proc": MAX_PROCS, "output_dir": str(tmp_path / "o")}, warn=False)
    cores = len(__import__("os").sched_getaffinity(0))
    with caplog.at_level("WARNING"):
        assert resolve_num_proc(64 * cores, 10**6) == 4 * cores
    assert f"dataset_num_proc {64 * cores}: {4 * cores} processes instead" in caplog.text
    assert resolve_num_proc(3, 2) == 2 and resolve_num_proc(1, 10**6) == 1


def test_eval_and_a_recorded_run_skip_what_only_training_reads(tmp_path):
    """A run trained with values a later version bounds (eval_samples with nothing held out, a whole val_set_size
    of 1.5, weight decay x learning rate past 1, an empty revision) still opens for generate, eval and export, and
    eval of such a run on another data set is not refused for a key it cannot set."""
    from hybridtune.infer.evaluate import eval_config
    from hybridtune.infer.load import run_config

    out = str(tmp_path / "o")
    old = {
        "eval_samples": 2,
        "val_set_size": 0,
        "learning_rate": 0.5,
        "weight_decay": 3.0,
        "revision": "",
        "output_dir": out,
    }
    for key in ("eval_samples", "weight_decay", "revision"):
        with pytest.raises(ConfigError, match=key):
            load_config(None, {**old, "val_set_size": 0 if key == "eval_samples" else 0.1}, warn=False)
    cfg = run_config({"config": old}, tmp_path)
    assert (cfg.eval_samples, cfg.weight_decay, cfg.revision) == (2, 3.0, None)
    assert run_config({"config": {**old, "val_set_size": 1.5}}, tmp_path).val_set_size == 1.5
    trained = load_config(
        None, {"eval_samples": 2, "test_datasets": [{"path": "t.jsonl"}], "output_dir": out}, warn=False
    )
    cfg = eval_config(trained, {"val_set_size": 0}, {"path": "other.jsonl"})
    assert cfg.eval_samples == 2 and cfg.datasets[0].path == "other.jsonl" and not cfg.test_datasets


def test_a_run_from_a_larger_machine_loads_with_its_machine_bound_keys_dropped(tmp_path):
    # was: ModelError "the run's recorded config does not load under this hybridtune version (... 'num_threads' = 100
    # must be at most 8 (4 x the 2 CPUs of this machine ...)": the same version, on a smaller machine
    from hybridtune.config import max_num_threads
    from hybridtune.infer.load import run_config

    big = max_num_threads() + 1
    record = {"config": {"num_threads": big, "dataset_num_proc": big, "output_dir": str(tmp_path / "o")}}
    cfg = run_config(record, tmp_path)
    assert (cfg.num_threads, cfg.dataset_num_proc) == (0, big)  # (capped, said, where it tokenises)
