"""`adapter: qlora` is LoRA over a 4-bit base: `load_in_4bit: false` beside it is refused in one line, never trained
in 4-bit regardless."""

from __future__ import annotations

import pytest

from hybridtune.cli import main
from hybridtune.config import load_config, parse_overrides
from hybridtune.errors import ConfigError

WHAT = (
    r"config keys 'adapter' = 'qlora' and 'load_in_4bit' = false conflict: QLoRA is LoRA over a 4-bit base "
    r"\(use adapter: lora for a bf16 base"
)


def test_qlora_with_load_in_4bit_false_on_the_command_line():
    with pytest.raises(ConfigError, match=rf"^command line: {WHAT}") as e:
        load_config(None, parse_overrides(["--adapter", "qlora", "--load_in_4bit", "false"]))
    assert "\n" not in str(e.value)


def test_qlora_with_load_in_4bit_false_in_a_file_names_its_lines(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("adapter: qlora\nlora_r: 8\nload_in_4bit: false\n")
    with pytest.raises(ConfigError, match=rf"c\.yaml:1 and .*c\.yaml:3: {WHAT}"):
        load_config(p)
    p.write_text("adapter: qlora\n")  # the file asks for qlora, the command line turns 4-bit off: which one?
    with pytest.raises(ConfigError, match=rf"c\.yaml:1 and command line: {WHAT}"):
        load_config(p, parse_overrides(["--load_in_4bit", "false"]))


def test_qlora_on_the_command_line_over_a_file_turning_4bit_off_is_qlora(tmp_path):
    """The command line wins over the file everywhere: `--adapter qlora` over a file's `load_in_4bit: false` (a
    shared LoRA config, say) is the 4-bit QLoRA the command line asks for, as before the conflict check."""
    p = tmp_path / "c.yaml"
    p.write_text("load_in_4bit: false\n")
    cfg = load_config(p, parse_overrides(["--adapter", "qlora"]))
    assert cfg.adapter == "lora" and cfg.load_in_4bit is True


def test_qlora_alone_or_with_load_in_4bit_true_is_lora_on_nf4():
    for argv in (["--adapter", "qlora"], ["--adapter", "qlora", "--load_in_4bit", "true"]):
        cfg = load_config(None, parse_overrides(argv))
        assert cfg.adapter == "lora" and cfg.load_in_4bit is True
    cfg = load_config(None, parse_overrides(["--adapter", "lora", "--load_in_4bit", "false"]))
    assert cfg.adapter == "lora" and cfg.load_in_4bit is False


def test_train_command_exits_2_with_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--adapter", "qlora", "--load_in_4bit", "false", "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'adapter' = 'qlora' and 'load_in_4bit' = false" in err[0], err
    assert not out.exists()  # refused before anything was written
