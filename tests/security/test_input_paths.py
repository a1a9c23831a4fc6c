"""A path given as a dataset, a prompts file, a chat template or a reward file that is a FIFO or a device says what it
is (textfile.py `not_a_file`), never "does not exist", and is never opened (a FIFO would block for ever);
`generate --image` with a URL says it is a URL, as data rows do. One line, exit 2."""

from __future__ import annotations

import os

import pytest

from hybridtune.textfile import not_a_file


@pytest.fixture()
def fifo(tmp_path):
    path = tmp_path / "pipe.jsonl"
    os.mkfifo(path)
    return path


def test_not_a_file_names_each_kind(tmp_path, fifo):
    (tmp_path / "f.txt").write_text("x")
    assert not_a_file(tmp_path / "f.txt") == ""
    assert not_a_file(tmp_path / "none") == "does not exist"
    assert not_a_file(tmp_path) == "is a directory"
    assert not_a_file(fifo) == "is a pipe (FIFO), not a file"
    assert not_a_file("/dev/null") == "is a device, not a file"
    os.symlink(fifo, tmp_path / "link.jsonl")
    assert not_a_file(tmp_path / "link.jsonl") == "is a pipe (FIFO), not a file"


@pytest.mark.parametrize("kind", ["fifo", "device"])
@pytest.mark.parametrize(
    "argv,says",
    [
        (lambda p, t: ["data", "--dataset", p, "--output_dir", str(t / "o")], "dataset file '{p}' {it}"),
        (lambda p, t: ["generate", "tiny-qwen3_5", "--prompts", p], "prompts file '{p}' {it}"),
        (
            lambda p, t: [
                "data",
                "--dataset",
                "hybridtune:sample/arithmetic_chat.jsonl",
                "--chat_template",
                p,
                "--output_dir",
                str(t / "o"),
            ],
            "chat_template: file '{p}' {it}",
        ),  # fmt: skip
    ],
    ids=["dataset", "prompts", "chat_template"],
)
def test_a_fifo_or_device_as_an_input_file_says_what_it_is(kind, argv, says, fifo, tmp_path, error_line):
    path = str(fifo) if kind == "fifo" else "/dev/zero"
    it = "is a pipe (FIFO), not a file" if kind == "fifo" else "is a device, not a file"
    line = error_line(argv(path, tmp_path))
    assert says.format(p=path, it=it) in line, line
    assert "does not exist" not in line


def test_a_reward_file_that_is_a_fifo_says_so(tmp_path):
    from hybridtune.errors import ConfigError
    from hybridtune.train.objectives.rewards import load_reward_funcs

    os.mkfifo(tmp_path / "r.py")
    with pytest.raises(ConfigError, match=r"r\.py:fn': .*r\.py is a pipe \(FIFO\), not a file"):
        load_reward_funcs([f"{tmp_path / 'r.py'}:fn"], 16)


@pytest.mark.parametrize("url", ["http://example.com/a.png", "https://example.com/a.png", "sftp://h/a.png"])
def test_generate_image_given_a_url_says_it_is_a_url(url, error_line):
    line = error_line(["generate", "tiny-qwen3_5", "--prompt", "hi", "--image", url])
    assert "URL" in line and "does not exist" not in line, line
