"""A text-only model given an image or a video: the one line names what was given to drop, the flag (--image,
--video) or the prompts file's row (file:line) holding image or video parts, never a flag that was not given."""

from __future__ import annotations

import json

import pytest

from hybridtune.cli import main

TEXT_ONLY = "model 'tiny-qwen3_5' is not a vision-language model"


@pytest.fixture
def media(tmp_path, monkeypatch):
    """A folder of two frames and an image, in the working directory."""
    from PIL import Image

    monkeypatch.chdir(tmp_path)
    (tmp_path / "frames").mkdir()
    for i in range(2):
        Image.new("RGB", (32, 32), (60 * i, 0, 0)).save(tmp_path / "frames" / f"{i}.png")
    Image.new("RGB", (32, 32), (0, 90, 0)).save(tmp_path / "a.png")
    return tmp_path


def error_of(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("error: ")]
    assert TEXT_ONLY in line, line
    return line


def part(kind: str, ref: str) -> dict:
    return {"type": kind, kind: ref}


def rows_file(path, *rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_generate_video_flag_is_named(media, capsys):
    line = error_of(capsys, ["generate", "tiny-qwen3_5", "--prompt", "x", "--video", "frames"])
    assert "drop --video," in line and "--image" not in line, line
    line = error_of(capsys, ["generate", "tiny-qwen3_5", "--prompt", "x", "--image", "a.png"])
    assert "drop --image," in line and "--video" not in line, line
    line = error_of(capsys, ["generate", "tiny-qwen3_5", "--prompt", "x", "--image", "a.png", "--video", "frames"])
    assert "drop --image and --video," in line, line


def test_generate_prompts_file_rows_are_named_by_line(media, capsys):
    def user(*parts):
        return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "x"}]}]}

    path = rows_file(media / "p.jsonl", {"prompt": "hi"}, user(part("video", "frames")), user(part("video", "frames")))
    line = error_of(capsys, ["generate", "tiny-qwen3_5", "--prompts", path])
    assert f"drop the video parts of {path}:2 (and of 1 more row)," in line and "--image" not in line, line
    path = rows_file(media / "q.jsonl", {"prompt": "hi"}, {"prompt": "ho"}, user(part("image", "a.png")))
    line = error_of(capsys, ["generate", "tiny-qwen3_5", "--prompts", path])
    assert f"drop the image parts of {path}:3," in line and "--image" not in line, line


def test_chat_video_flag_is_named(media, capsys, monkeypatch):
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    line = error_of(capsys, ["chat", "tiny-qwen3_5", "--video", "frames"])
    assert "drop --video," in line and "--image" not in line, line


def test_chat_image_command_is_named(media, capsys, monkeypatch):
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.StringIO("/image a.png\n"))
    assert main(["chat", "tiny-qwen3_5"]) == 0  # said, and the chat goes on
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("error: ")]
    assert TEXT_ONLY in line and "drop /image," in line and "--image" not in line, line
