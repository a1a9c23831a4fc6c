"""A model directory that names custom code (`auto_map`) is refused in one line by every command that can reach it,
and its Python never runs, whatever is typed at stdin (transformers would otherwise ask "run the custom code?")."""

from __future__ import annotations

import io
import json
import shutil

import pytest

from checkpoints import make_checkpoint
from hybridtune.cli import main
from hybridtune.errors import ModelError
from hybridtune.models.trust import custom_code, refuse_custom_code

EVIL = 'import pathlib; pathlib.Path(__file__).with_name("PWNED").write_text("ran")\n'


@pytest.fixture(scope="module")
def evil_dirs(tmp_path_factory):
    """(a model directory whose config.json maps AutoConfig to its own evil.py, one whose tokenizer does)."""
    root = tmp_path_factory.mktemp("custom-code")
    good = make_checkpoint(root, "qwen3_5_text", name="good")
    config_evil = root / "config-evil"
    shutil.copytree(good, config_evil)
    cfg = json.loads((config_evil / "config.json").read_text())
    cfg.update(model_type="evilmodel", auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.M"})
    (config_evil / "config.json").write_text(json.dumps(cfg))
    tokenizer_evil = root / "tokenizer-evil"
    shutil.copytree(good, tokenizer_evil)
    tok = json.loads((tokenizer_evil / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    (tokenizer_evil / "tokenizer_config.json").write_text(json.dumps(tok))
    for d in (config_evil, tokenizer_evil):
        (d / "evil.py").write_text(EVIL)
    return config_evil, tokenizer_evil


def test_custom_code_is_found_in_config_and_tokenizer_files(evil_dirs, tmp_path):
    config_evil, tokenizer_evil = evil_dirs
    assert custom_code(config_evil)[0].name == "config.json"
    assert custom_code(tokenizer_evil)[0].name == "tokenizer_config.json"
    assert custom_code(tmp_path) is None
    with pytest.raises(ModelError, match="auto_map .*never runs"):
        refuse_custom_code(config_evil)


def _data(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": "one two three"}) + "\n")
    return path


def _adapter_on(base, tmp_path):
    """A LoRA adapter directory whose recorded base is `base` (what merge and generate follow)."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "base_model_name_or_path": str(base), "r": 2, "target_modules": ["q_proj"]})
    )
    return adapter


@pytest.mark.parametrize("which", ["config", "tokenizer"])
@pytest.mark.parametrize(
    "command",
    [
        lambda d, t: ["generate", str(d), "--prompt", "hi"],
        lambda d, t: ["chat", str(d)],
        lambda d, t: ["eval", "--model", str(d), "--dataset", str(_data(t))],
        lambda d, t: ["doctor", "--model", str(d)],
        lambda d, t: ["merge", str(_adapter_on(d, t)), str(t / "merged")],
        lambda d, t: ["generate", str(_adapter_on(d, t)), "--prompt", "hi"],
        lambda d, t: ["train", "--base_model", str(d), "--max_steps", "1", "--output_dir", str(t / "out")],
    ],
    ids=["generate", "chat", "eval", "doctor", "merge-adapter", "generate-adapter", "train"],
)
def test_no_command_runs_a_directorys_code(evil_dirs, which, command, tmp_path, monkeypatch, capsys):
    model_dir = evil_dirs[0] if which == "config" else evil_dirs[1]
    argv = command(model_dir, tmp_path)
    if argv[0] == "doctor" and which == "tokenizer":
        pytest.skip("doctor reads a model's config only")
    monkeypatch.setattr("sys.stdin", io.StringIO("y\ny\ny\n"))  # what a piped "yes" would answer
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "auto_map" in err and "never runs" in err, err
    assert "Traceback" not in err
    assert not (model_dir / "PWNED").exists(), "the model directory's code ran"
