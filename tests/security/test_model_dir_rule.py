"""One rule for model directories (models/trust.py): every JSON file a model, adapter or processor directory holds is
read for custom code (`auto_map`, `custom_pipelines`) before any transformers loader sees it, whatever its name, and
a loader transformers calls itself without `trust_remote_code` (an AutoProcessor's video processor) never asks
"run the custom code?" on stdin. The directory's Python never runs; the user gets one line, exit 2."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from hybridtune.cli import main
from hybridtune.errors import ModelError
from hybridtune.models import trust

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data" / "vision"))
import vl_tiny  # noqa: E402

EVIL = 'import pathlib; pathlib.Path(__file__).with_name("PWNED").write_text("ran")\n'


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A tiny Qwen3.5 vision-language snapshot (config, tokenizer, image and video processor files) and a data file."""
    root = tmp_path_factory.mktemp("vlm")
    model = vl_tiny.make_checkpoint(root / "vlm")
    vl_tiny.write_image(root / "red.png", 19, 13, seed=3)
    data = vl_tiny.write_rows(root / "ok.jsonl", [vl_tiny.chat({"type": "image", "image": "red.png"}, "colour?")])
    return model, data


def _planted(vlm_dir: Path, tmp_path: Path, name: str, key: str = "auto_map") -> Path:
    evil = tmp_path / "evil_model"
    shutil.copytree(vlm_dir, evil)
    (evil / "evil.py").write_text(EVIL)
    data = json.loads((evil / name).read_text()) if (evil / name).exists() else {}
    value = {"AutoVideoProcessor": "evil.EvilProc", "AutoConfig": "evil.EvilConfig"}
    if key == "custom_pipelines":
        value = {"text-generation": {"impl": "evil.Pipe", "pt": ["AutoModelForCausalLM"]}}
    if isinstance(data, dict):
        data[key] = value
    else:  # (a JSON list: the key one level down, where a nested reader would meet it)
        data = [{key: value}, data]
    (evil / name).write_text(json.dumps(data))
    return evil


def test_the_snapshot_holds_the_files_a_release_does(vlm):
    names = {p.name for p in vlm[0].glob("*.json")}
    assert {"config.json", "tokenizer_config.json", "video_preprocessor_config.json"} <= names, names
    assert trust.custom_code(vlm[0]) is None


# JSON files a released Qwen3.5 VL snapshot holds beside those the tiny one writes (planted as new files there).
RELEASE_FILES = ["chat_template.json", "processor_config.json", "model.safetensors.index.json", "vocab.json",
                 "special_tokens_map.json", "added_tokens.json"]  # fmt: skip


def _json_files():
    """Every JSON file name of the tiny snapshot (built once, here, to parametrize over them) and of a release."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        written = {p.name for p in vl_tiny.make_checkpoint(Path(d) / "m").glob("*.json")}
    return sorted(written | set(RELEASE_FILES))


@pytest.mark.parametrize("name", _json_files())
def test_auto_map_in_any_json_file_of_a_vl_snapshot_is_refused_and_runs_nothing(
    vlm, name, tmp_path, monkeypatch, error_line
):
    evil = _planted(vlm[0], tmp_path, name)
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 8))  # what a piped "yes" would answer
    line = error_line(["data", "--base_model", str(evil), "--dataset", str(vlm[1]), "--rows", "1"])
    assert name in line and "auto_map" in line and "never runs" in line, line
    assert not (evil / "PWNED").exists(), "the model directory's code ran"


@pytest.mark.parametrize("name", ["generation_config.json", "video_preprocessor_config.json", "any_new_file.json"])
def test_custom_pipelines_and_unknown_file_names_are_refused_too(vlm, name, tmp_path):
    evil = tmp_path / "m"
    shutil.copytree(vlm[0], evil)
    (evil / name).write_text(json.dumps({"nested": {"deeper": [{"custom_pipelines": {"x": {"impl": "evil.P"}}}]}}))
    with pytest.raises(ModelError, match=f"{name} has custom_pipelines"):
        trust.refuse_custom_code(evil)


def test_a_vocabulary_token_named_auto_map_is_data_not_code(vlm, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(vlm[0], model)
    (model / "vocab.json").write_text(json.dumps({"auto_map": 17, "custom_pipelines": 18, "x": 1}))
    assert trust.custom_code(model) is None


def test_a_json_file_that_is_a_fifo_is_refused_without_being_opened(vlm, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(vlm[0], model)
    os.mkfifo(model / "chat_template.json")  # (opened for reading, it would block for ever)
    with pytest.raises(ModelError, match="chat_template.json is not a regular file"):
        trust.refuse_custom_code(model)


def test_the_video_processor_loaded_through_auto_processor_never_asks(vlm, tmp_path, monkeypatch, capsys):
    """The reproduction of the red-team report with the directory check taken away: the prompt that transformers
    shows when AutoProcessor loads the video processor without `trust_remote_code` is off, so "y" on stdin runs
    nothing."""
    evil = _planted(vlm[0], tmp_path, "video_preprocessor_config.json")
    data = json.loads((evil / "video_preprocessor_config.json").read_text())
    data["video_processor_type"] = "EvilProc"
    (evil / "video_preprocessor_config.json").write_text(json.dumps(data))
    monkeypatch.setattr(trust, "custom_code", lambda directory: None)
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 8))
    rc = main(["data", "--base_model", str(evil), "--dataset", str(vlm[1]), "--rows", "1"])
    err = capsys.readouterr().err
    assert not (evil / "PWNED").exists(), "the model directory's code ran"
    assert rc == 2 and "Traceback" not in err, err
