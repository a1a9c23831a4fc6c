"""Config: YAML + overrides, typed, unknown keys name the nearest key, errors name file and line."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridtune.config import TrainConfig, config_help, load_config, parse_overrides
from hybridtune.errors import ConfigError


def test_defaults_and_overrides_win_over_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("lora_r: 4\nsequence_len: 128\nlearning_rate: 1e-3\n")
    cfg = load_config(p, parse_overrides(["--lora_r", "8", "--bf16=false", "--lora_target_modules", "q_proj,v_proj"]))
    assert cfg.lora_r == 8 and cfg.sequence_len == 128 and cfg.learning_rate == 1e-3 and cfg.bf16 is False
    assert cfg.lora_target_modules == ["q_proj", "v_proj"]
    assert load_config().base_model == "tiny-qwen3_5"


def test_bare_flag_is_true_and_paths_stay_strings():
    o = parse_overrides(["--overwrite", "--output_dir", "2024", "--dataset", "x.jsonl"])
    assert o == {"overwrite": True, "output_dir": "2024", "dataset": "x.jsonl"}
    cfg = load_config(None, o)
    # (a path that does not exist stays as written; output_dir is made absolute at load, still the text '2024')
    assert cfg.resolved_datasets()[0].path == "x.jsonl" and cfg.output_dir == os.path.abspath("2024")


def test_unknown_key_names_nearest(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'lora_rank'; did you mean 'lora_r'"):
        load_config(None, parse_overrides(["--lora_rank", "8"]))
    p = tmp_path / "c.yaml"
    p.write_text("base_model: tiny-qwen3_5\nsequence_len: 128\nlearnin_rate: 0.1\n")
    with pytest.raises(
        ConfigError, match=r"c\.yaml:3: unknown config key 'learnin_rate'; did you mean 'learning_rate'"
    ):
        load_config(p)
    p.write_text("datasets:\n  - path: a.jsonl\n    typ: chat\n")
    with pytest.raises(ConfigError, match="unknown config key 'typ'; did you mean 'type'"):
        load_config(p)


def test_ill_typed_and_out_of_range(tmp_path):
    with pytest.raises(ConfigError, match="key 'lora_r': expected int, got 'eight'"):
        load_config(None, parse_overrides(["--lora_r", "eight"]))
    with pytest.raises(ConfigError, match=r"key 'adapter': expected 'lora' \| 'qlora' \| 'full'"):
        load_config(None, {"adapter": "prefix"})
    p = tmp_path / "c.yaml"
    p.write_text("micro_batch_size: 1\nsequence_len: many\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:2: key 'sequence_len': expected 'auto' \| int"):
        load_config(p)
    with pytest.raises(ConfigError, match="'sequence_len' = 1 must be at least 2"):
        load_config(None, {"sequence_len": 1})
    p.write_text("lora_r: [1\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:\d+: not valid YAML at column \d+"):
        load_config(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_compile_overrides():
    from hybridtune.config import compile_overrides

    cfg = load_config(
        None, parse_overrides(["--compile", "modules", "--compile_overrides", "Qwen3_5MLP=eager,Foo=fullgraph"])
    )
    assert compile_overrides(cfg) == {"Qwen3_5MLP": "eager", "Foo": "fullgraph"}
    with pytest.raises(ConfigError, match="Class=compile|fullgraph|eager|off"):
        load_config(None, {"compile_overrides": ["Qwen3_5MLP:eager"]})


def test_help_lists_every_key_with_default():
    text = config_help()
    for f in dataclasses.fields(TrainConfig):
        assert f"--{f.name} (" in text
    assert "default 16" in text  # lora_r


def test_shipped_configs_load():
    from pathlib import Path

    from hybridtune.config import bundled_configs

    shipped = bundled_configs()  # the package's configs/ (package-data: they ship in the wheel)
    assert "hybridtune:configs/arithmetic-lora.yaml" in shipped
    assert set(shipped.values()) == set((Path(__file__).resolve().parents[1] / "src/hybridtune/configs").glob("*.yaml"))
    for name, f in shipped.items():
        assert load_config(name) == load_config(f)  # by its bundled name, as `hybridtune train NAME` takes it
    assert load_config("hybridtune:configs/arithmetic-lora.yaml").adapter == "lora"
    with pytest.raises(
        ConfigError,
        match=r"'hybridtune:configs/arithmetic-lora\.yml' is not a bundled config\. "
        r"Did you mean 'hybridtune:configs/arithmetic-lora\.yaml'\?",
    ):
        load_config("hybridtune:configs/arithmetic-lora.yml")


# --- issue 16 items 14-16: bad values that used to pass validation or crash --------------------------------------


@pytest.mark.parametrize("word, value", [("off", "off"), ("no", "off"), ("false", "off")])
def test_enum_keys_accept_yaml_booleans(tmp_path, word, value):
    # `compile: off` (unquoted YAML, or --compile off) arrives as the boolean False.
    cfg = load_config(None, parse_overrides(["--compile", word, "--kernels", word]))
    assert cfg.compile == value and cfg.kernels == value
    p = tmp_path / "c.yaml"
    p.write_text(f"compile: {word}\nkernels: {word}\n")
    cfg = load_config(p)
    assert cfg.compile == value and cfg.kernels == value
    # A key whose values hold no such word still refuses a boolean, naming the key.
    with pytest.raises(ConfigError, match="key 'lr_scheduler': expected 'cosine'"):
        load_config(None, parse_overrides(["--lr_scheduler", word]))
    # bool-or-auto keys keep their booleans.
    assert load_config(None, parse_overrides(["--bf16", "off"])).bf16 is False


def test_enum_literal_maps_true_words():
    from typing import Literal

    from hybridtune.config.parse import _coerce

    assert _coerce(True, Literal["on", "off"], "k") == "on"
    assert _coerce(True, Literal["yes", "no"], "k") == "yes"
    assert _coerce(False, Literal["yes", "no"], "k") == "no"
    with pytest.raises(ConfigError):
        _coerce(True, Literal["auto", "off"], "k")


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--num_threads", "-1"], "'num_threads' = -1 must be 0"),
        (["--seed", str(2**70)], "'seed' = 1180591620717411303424 must be"),
        (["--seed", "-1"], "'seed' = -1 must be"),
        (["--weight_decay", "-1"], "'weight_decay' = -1.0 must be >= 0"),
        (["--save_steps", "-3"], "'save_steps' = -3 must be 0"),
        (["--eval_steps", "-1"], "'eval_steps' = -1 must be 0"),
        (["--eval_max_examples", "-1"], "'eval_max_examples' = -1 must be"),
        (["--lora_alpha", "0"], "'lora_alpha' = 0 must be at least 1"),
        (["--learning_rate", ".inf"], "key 'learning_rate': expected a finite float, got inf"),
        (["--learning_rate", "inf"], "key 'learning_rate': expected a finite float, got inf"),
        (["--num_epochs", ".inf"], "key 'num_epochs': expected a finite float, got inf"),
        (["--learning_rate", ".nan"], "key 'learning_rate': expected a finite float, got nan"),
        (["--weight_decay", "nan"], "key 'weight_decay': expected a finite float, got nan"),
        (["--max_grad_norm", "-.inf"], "key 'max_grad_norm': expected a finite float, got -inf"),
    ],
)
def test_values_that_used_to_pass_validation(argv, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, parse_overrides(argv))


def test_non_finite_in_file_names_file_and_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("lora_r: 4\nnum_epochs: .inf\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:2: key 'num_epochs': expected a finite float, got inf"):
        load_config(p)


def test_cli_turns_config_errors_into_one_line(capsys):
    from hybridtune.cli import main

    assert main(["train", "--seed", str(2**70)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: command line: config key 'seed'"), err


def test_config_file_with_invalid_utf8_names_line_and_column(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_bytes(b"lora_r: 4\nbase_model: tiny-\xff\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:2: not valid UTF-8 at column 18 \(byte 0xff\)"):
        load_config(p)
    p.write_bytes(b"\x00\x01\x02PK\x03\x04")
    with pytest.raises(ConfigError, match=r"c\.yaml:1: a NUL byte at column 1: this is a binary file"):
        load_config(p)


def test_config_file_with_bom_and_yaml_error_column(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_bytes(b"\xef\xbb\xbflora_r: 4\n")
    assert load_config(p).lora_r == 4
    p.write_text("lora_r: 4\nsequence_len: [1\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:\d+: not valid YAML at column \d+"):
        load_config(p)
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_lora_keys_under_full_fine_tune_warn(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        load_config(None, parse_overrides(["--lora_r", "8", "--lora_alpha", "16"]))
    assert "lora_alpha, lora_r" in caplog.text and "adapter is 'full'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        load_config(None, parse_overrides(["--adapter", "lora", "--lora_r", "8"]))
        load_config(None, {})
    assert "adapter" not in caplog.text


def test_warmup_longer_than_the_run_warns(caplog):
    import logging

    from hybridtune.config import warmup_warning

    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        load_config(None, parse_overrides(["--max_steps", "5", "--warmup_steps", "10"]))
    assert "warmup_steps = 10" in caplog.text and "max_steps = 5" in caplog.text
    # With the length known only from the data (num_epochs), the trainer asks once it has the step count.
    cfg = load_config(None, {"warmup_steps": 10})
    assert "warmup_steps = 10" in warmup_warning(cfg, total_steps=4)
    assert warmup_warning(cfg, total_steps=100) is None


def test_output_dir_that_is_a_file_or_read_only(tmp_path, monkeypatch):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"'output_dir' = '.*afile' is a file"):
        load_config(None, {"output_dir": str(f)})
    with pytest.raises(ConfigError, match=r"'output_dir' = '.*afile/run': '.*afile' is a file"):
        load_config(None, {"output_dir": str(f / "run")})
    import os

    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(ro) else real(p, mode, **kw))
    with pytest.raises(ConfigError, match=r"'output_dir' = '.*ro/run': cannot write in '.*ro'"):
        load_config(None, {"output_dir": str(ro / "run")})
    assert load_config(None, {"output_dir": str(tmp_path / "fresh" / "run")}).output_dir.endswith("run")


def test_help_is_one_sentence_per_key_without_figures():
    import re

    for f in dataclasses.fields(TrainConfig):
        text = f.metadata["help"]
        assert len(text) <= 200, (f.name, len(text))
        assert not re.search(r"\d+\s*%|\d+M\b|measured|\b\d+ s\b|minutes", text), (f.name, text)
        assert text.count(". ") == 0, (f.name, text)


# --- red-team items: bounds that used to crash deep in torch or tokenizers -----------------------------------


def test_num_threads_is_bounded_by_the_cpu_count(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"'num_threads' = 9 must be at most 8 \(4 x the 2 CPUs of this machine"):
        load_config(None, parse_overrides(["--num_threads", "9"]))
    assert load_config(None, parse_overrides(["--num_threads", "8"])).num_threads == 8


def test_cli_huge_num_threads_is_one_line(tmp_path):
    import subprocess
    import sys

    # Used to start 100000 torch threads and crash in the tokenizers' thread pool (a segfault, rc 139): run it
    # in a child so that a regression fails this test instead of taking the test session down.
    argv = [sys.executable, "-m", "hybridtune", "train", "--num_threads", "100000", "--output_dir", str(tmp_path)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(err) == 1 and err[0].startswith(
        "error: command line: config key 'num_threads' = 100000 must be at most"
    ), err


def test_learning_rate_is_bounded():
    # 1e38 used to end in Adam's "value cannot be converted to type float without overflow".
    with pytest.raises(ConfigError, match=r"'learning_rate' = 1e\+38 must be at most 1e\+10 .*use e\.g\. 1e-4"):
        load_config(None, parse_overrides(["--learning_rate", "1e38"]))
    # Divergence tests use 1e6 on purpose.
    assert load_config(None, parse_overrides(["--learning_rate", "1e6"])).learning_rate == 1e6
    assert load_config(None, {"learning_rate": 1e10}).learning_rate == 1e10


def test_empty_roles_to_train_is_refused(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("datasets:\n  - path: a.jsonl\n    type: chat\n    roles_to_train: []\n")
    with pytest.raises(ConfigError, match=r"'datasets\[0\]\.roles_to_train' is empty.*e\.g\. \[assistant\]"):
        load_config(p)
    # Irrelevant for text data, and harmless when every token is trained on anyway.
    p.write_text("datasets:\n  - path: a.jsonl\n    type: text\n    roles_to_train: []\n")
    assert load_config(p).datasets[0].roles_to_train == []
    p.write_text("train_on_inputs: true\ndatasets:\n  - path: a.jsonl\n    roles_to_train: []\n")
    assert load_config(p).train_on_inputs


# --- YAML safety (issue 34): aliases, values as written, environment variables ----------------------------------


def _bomb(levels: int) -> str:
    """`levels` nested lists of 9 aliases each: a few hundred bytes that stand for 9**levels strings."""
    items = [f"&x{i} [" + ", ".join(['"lol"'] * 9 if i == 0 else [f"*x{i - 1}"] * 9) + "]" for i in range(levels)]
    return "lora_target_modules: [" + ", ".join(items) + "]\n"


def test_alias_bomb_is_refused_in_one_line(tmp_path):
    p = tmp_path / "bomb.yaml"
    p.write_text(_bomb(7))  # 9**7 = 4.8 M strings: small enough to fail fast before the bound existed
    with pytest.raises(ConfigError, match=r"bomb\.yaml:1: the YAML's aliases \(\*name\) expand to more than 100,000"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"command line: the YAML's aliases"):
        parse_overrides(["--lora_target_modules", _bomb(7).split(": ", 1)[1]])
    # Aliases a config may really use stay fine.
    p.write_text("lora_target_modules: &t [q_proj, v_proj]\ncompile_overrides: []\n")
    assert load_config(p).lora_target_modules == ["q_proj", "v_proj"]


def test_alias_bomb_of_the_red_team_ends_fast_within_little_memory(tmp_path, capsys):
    import resource
    import subprocess
    import sys
    import time

    from hybridtune.cli import main

    p = tmp_path / "bomb.yaml"
    p.write_text(_bomb(9))
    assert len(p.read_bytes()) == 499  # the red team's file: 9**9 strings, 3.4 GB and 60 s before the bound
    # In a child without torch, under 1 GB of address space: the unbounded expansion needed gigabytes.
    code = (
        f"from hybridtune.config import load_config\ntry:\n load_config({str(p)!r})\nexcept ValueError as e:\n print(e)"
    )

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, preexec_fn=cap)
    assert proc.returncode == 0 and "expand to more than 100,000 values" in proc.stdout, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 30
    # Through the CLI: one line, exit 2.
    assert main(["train", str(p)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bomb.yaml:1: the YAML's aliases (*name) expand to more than 100,000 values" in err[0]


def test_self_referencing_alias_and_deep_nesting_are_one_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("lora_r: 4\nlora_target_modules: &a [q_proj, *a]\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:2: a YAML alias \(\*name\) inside the value its anchor marks"):
        load_config(p)
    p.write_text("lora_target_modules: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: the YAML is nested too deeply"):
        load_config(p)


def test_error_values_are_shortened():
    from hybridtune.config.parse import _coerce

    with pytest.raises(ConfigError) as e:
        _coerce(list(range(100_000)), int, "k")
    assert len(str(e.value)) < 200 and "got [0, 1, 2, 3, 4, 5, ...]" in str(e.value)
    with pytest.raises(ConfigError) as e:
        _coerce("x" * 100_000, int, "k")
    assert len(str(e.value)) < 200


def test_string_keys_keep_the_text_as_written(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(
        "revision: 1.10\nrun_name: 0755\nchat_template: 2024-01-01\n"
        "datasets:\n  - path: a.jsonl\n    name: 1.20\n    split: 010\n"
    )
    cfg = load_config(p)
    assert (cfg.revision, cfg.run_name, cfg.chat_template) == ("1.10", "0755", "2024-01-01")
    assert (cfg.datasets[0].name, cfg.datasets[0].split) == ("1.20", "010")
    p.write_text("revision: ~\nrun_name: null\nlora_r: 010\n")  # null stays null; numbers stay numbers
    cfg = load_config(p)
    assert cfg.revision is None and cfg.run_name is None and cfg.lora_r == 8
    o = parse_overrides(["--run_name", "1.10", "--fsdp_units", "010", "--revision", "null"])
    assert o == {"run_name": "1.10", "fsdp_units": "010", "revision": None}


def test_environment_variables_in_paths_are_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    p = tmp_path / "c.yaml"
    p.write_text("lora_r: 4\noutput_dir: ${HOME}/runs/x\n")
    with pytest.raises(
        ConfigError,
        match=r"c\.yaml:2: key 'output_dir' = '\$\{HOME\}/runs/x' holds the environment variable \$\{HOME\}, which "
        r"hybridtune does not expand; write the path itself \(here: '/home/someone/runs/x'\)",
    ):
        load_config(p)
    assert not (tmp_path / "${HOME}").exists()
    p.write_text("datasets:\n  - path: $DATA_DIR/chats.jsonl\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:1: key 'datasets\[0\]\.path' .* \$DATA_DIR, which"):
        load_config(p)
    p.write_text("run_name: $5 run\noutput_dir: " + str(tmp_path / "out") + "\n")  # not a path key: as written
    assert load_config(p).run_name == "$5 run"


def test_help_and_a_config_error_answer_before_torch_loads():
    """`hybridtune train --help` and a config error come from the config package alone, in a fresh process: torch
    (seconds to import) is never loaded for them."""
    code = (
        "import sys\n"
        "from hybridtune.cli import main\n"
        "codes = [main(['train', '--help']), main(['train', '--lora_rnk', '4'])]\n"
        "print('exit codes', codes, 'torch loaded', 'torch' in sys.modules)\n"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "did you mean 'lora_r'" in r.stderr, r.stderr
    assert r.stdout.splitlines()[-1] == "exit codes [0, 2] torch loaded False", r.stdout[-500:]
