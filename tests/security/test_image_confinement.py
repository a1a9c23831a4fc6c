"""Images confined (data/images.py `confined`): a data file's images and video frames resolve, links followed, inside
its own folder or an `image_roots` folder; an absolute path elsewhere, `..`, `~` or a link out of the folder is one
line naming file:line and the part, unless `allow_outside_images: true`, which logs each read outside. A path typed
on the command line (`generate --image`) is the user's own and is not confined."""

from __future__ import annotations

import logging
import os
import random
import sys
from pathlib import Path

import pytest

from hybridtune.config import DatasetConfig
from hybridtune.data.examples import load_source
from hybridtune.data.images import set_image_policy
from hybridtune.errors import DataError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data" / "vision"))
import vl_tiny  # noqa: E402


@pytest.fixture(autouse=True)
def default_policy():
    set_image_policy()
    yield
    set_image_policy()


@pytest.fixture()
def dirs(tmp_path, monkeypatch):
    """(the data folder, a folder beside it holding a private picture and frames); HOME is the second one."""
    data, elsewhere = tmp_path / "data", tmp_path / "home"
    data.mkdir(), elsewhere.mkdir()
    size = random.randint(9, 40), random.randint(9, 40)
    vl_tiny.write_image(data / "ok.png", *size, seed=1)
    vl_tiny.write_image(elsewhere / "private.png", *size, seed=2)
    vl_tiny.write_frames(elsewhere / "clip", 2, 16, 16, seed=3)
    monkeypatch.setenv("HOME", str(elsewhere))
    return data, elsewhere


def _load(data, tok, vision, rows):
    path = vl_tiny.write_rows(data / "d.jsonl", rows)
    return load_source(DatasetConfig(path=str(path)), tok, cache=False, vision=vision)


def _image(ref):
    return vl_tiny.chat({"type": "image", "image": ref}, "colour?")


@pytest.mark.parametrize("how", ["absolute", "dotdot", "tilde", "file_uri", "image_url", "llava_column"])
def test_an_image_outside_the_data_folder_is_refused(dirs, tok, vision, how):
    data, elsewhere = dirs
    private = elsewhere / "private.png"
    row = {
        "absolute": _image(str(private)),
        "dotdot": _image("../home/private.png"),
        "tilde": _image("~/private.png"),
        "file_uri": _image(f"file://{private}"),
        "image_url": vl_tiny.chat({"type": "image_url", "image_url": {"url": str(private)}}, "?"),
        "llava_column": {"messages": [{"role": "user", "content": "<image>?"}, {"role": "assistant", "content": "x"}],
                         "images": [str(private)]},
    }[how]  # fmt: skip
    rows = [_image("ok.png")] * random.randint(0, 2) + [row]
    with pytest.raises(DataError, match=rf"d\.jsonl:{len(rows)}: .*private\.png' lies outside the data file's folder"):
        _load(data, tok, vision, rows)


def test_a_link_out_of_the_folder_is_refused_and_named_as_a_link(dirs, tok, vision):
    data, elsewhere = dirs
    os.symlink(elsewhere / "private.png", data / "innocent.png")
    with pytest.raises(DataError, match=r"innocent\.png' \(a link to '.*private\.png'\) lies outside"):
        _load(data, tok, vision, [_image("innocent.png")])


def test_a_video_outside_or_a_frame_linked_out_is_refused(dirs, tok, vision):
    data, elsewhere = dirs
    video = vl_tiny.chat({"type": "video", "video": str(elsewhere / "clip"), "fps": 2}, "?")
    with pytest.raises(DataError, match=r"d\.jsonl:1: .*clip' lies outside the data file's folder"):
        _load(data, tok, vision, [video])
    clip = vl_tiny.write_frames(data / "clip", 2, 16, 16, seed=4)
    os.symlink(elsewhere / "clip" / "frame-000.png", clip / "frame-002.png")
    video = vl_tiny.chat({"type": "video", "video": "clip", "fps": 2}, "?")
    with pytest.raises(DataError, match=r"frame-002\.png' \(a link to .*\) lies outside"):
        _load(data, tok, vision, [video])


def test_image_roots_and_allow_outside_images_let_them_in_and_the_log_names_each(dirs, tok, vision, caplog):
    data, elsewhere = dirs
    rows = [_image(str(elsewhere / "private.png")), _image("ok.png")]
    set_image_policy(roots=[str(elsewhere)])
    assert len(_load(data, tok, vision, rows).examples) == 2
    set_image_policy(allow_outside=True)
    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        assert [len(e.images) for e in _load(data, tok, vision, rows).examples] == [1, 1]
    outside = [r.getMessage() for r in caplog.records if "outside the data folder" in r.getMessage()]
    assert len(outside) == 1 and str((elsewhere / "private.png").resolve()) in outside[0], caplog.text


def test_the_cli_refuses_in_one_line_and_takes_the_config_keys(dirs, tmp_path, error_line, capsys):
    data, elsewhere = dirs
    ckpt = vl_tiny.make_checkpoint(tmp_path / "vlm")
    rows = vl_tiny.write_rows(data / "d.jsonl", [_image("ok.png"), _image(str(elsewhere / "private.png"))])
    argv = ["data", "--base_model", str(ckpt), "--dataset", str(rows), "--sequence_len", "128", "--output_dir",
            str(tmp_path / "o")]  # fmt: skip
    line = error_line(argv)
    assert "d.jsonl:2:" in line and "allow_outside_images" in line and "image_roots" in line, line
    from hybridtune.cli import main

    assert main([*argv, "--image_roots", str(elsewhere)]) == 0, capsys.readouterr().err
    assert main([*argv, "--allow_outside_images", "true"]) == 0, capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # (the preview writes nothing)


@pytest.mark.parametrize(
    "ref,says",
    [("sftp://example.com/a.png", "sftp:// is not a local file"), ("smb://host/share/a.png", "smb:// is not a local"),
     ("file://otherhost/a.png", "file:// is not a local file"), ("HTTP://example.com/a.png", "remote URL")],
)  # fmt: skip
def test_urls_of_other_schemes_are_named_as_urls_not_missing_paths(dirs, tok, vision, ref, says):
    with pytest.raises(DataError, match=rf"d\.jsonl:1: .*{says}") as e:
        _load(dirs[0], tok, vision, [_image(ref)])
    assert "does not exist" not in str(e.value)


def test_a_nul_in_an_image_path_is_one_line(dirs, tok, vision):
    with pytest.raises(DataError, match=r"d\.jsonl:1: .*holds a NUL character"):
        _load(dirs[0], tok, vision, [_image(f"ok{chr(0)}.png")])


def test_file_localhost_is_the_local_path(dirs, tok, vision):
    data, _ = dirs
    got = _load(data, tok, vision, [_image(f"file://localhost{data / 'ok.png'}")]).examples[0].images[0].source
    assert got == str(data / "ok.png")
