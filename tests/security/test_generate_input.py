"""Bad input to `generate`, `chat` and `eval` is one line and exit 2, never a traceback: prompt rows that are not
conversations (named by file:line, before the model loads), sampling arguments out of range or not finite, text
that is not UTF-8 (chat's stdin, a --prompt), a directory given as a prompts file, and eval's own flags named as
flags."""

from __future__ import annotations

import io
import json

import pytest

from hybridtune.cli import main


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: what is checked here is checked before the model loads."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    import hybridtune.infer.evaluate  # noqa: F401 (first imported after the patch below, it would keep the stand-in)

    monkeypatch.setattr("hybridtune.infer.load.open_model", refuse)
    monkeypatch.setattr("hybridtune.infer.evaluate.open_model", refuse)


BAD_ROWS = {
    "messages-of-numbers": ({"messages": [1, 2]}, "message 0"),
    "message-without-content": ({"messages": [{"role": "user"}]}, 'no "content"'),
    "null-content": ({"messages": [{"role": "user", "content": None}]}, '"content" null'),
    "prompt-list-of-strings": ({"prompt": ["a", "b"]}, '"prompt"'),
    "empty-messages": ({"messages": []}, "empty"),
    "message-without-role": ({"messages": [{"content": "hi"}]}, '"role"'),
}


@pytest.mark.parametrize("template", [True, False], ids=["template", "no_chat_template"])
@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_prompt_rows_are_named_before_the_model_loads(case, template, model_dir, tmp_path, no_model, error_line):
    row, says = BAD_ROWS[case]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a good row first"}) + "\n\n" + json.dumps(row) + "\n")
    argv = ["generate", str(model_dir), "--prompts", str(prompts)] + ([] if template else ["--no_chat_template"])
    line = error_line(argv)
    assert f"{prompts}:3:" in line and says in line, line


def test_good_prompt_rows_still_generate(model_dir, tmp_path, capsys):
    rows = [
        {"prompt": "plain text"},
        {"prompt": [{"role": "user", "content": "a conversation as the prompt"}]},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "content "}, {"type": "text", "text": "parts"}]}
            ]
        },
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for extra in ([], ["--no_chat_template"]):
        argv = ["generate", str(model_dir), "--prompts", str(prompts), "--max_new_tokens", "2", "--json", *extra]
        assert main(argv) == 0
        assert len(json.loads(capsys.readouterr().out)) == len(rows)


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--temperature", "nan"], "--temperature nan"),
        (["--temperature", "inf"], "--temperature inf"),
        (["--temperature", "-1"], "--temperature -1"),
        (["--top_p", "nan"], "--top_p nan"),
        (["--top_k", "-2"], "--top_k -2"),
        (["--seed", "99999999999999999999999"], "--seed 99999999999999999999999"),
        (["--seed", "-1"], "--seed -1"),
    ],
    ids=["temperature-nan", "temperature-inf", "temperature-negative", "top_p-nan", "top_k", "seed-huge", "seed-neg"],
)
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_sampling_arguments_are_checked_before_the_model_loads(command, flags, says, model_dir, no_model, error_line):
    argv = [command, str(model_dir), *flags] + (["--prompt", "hi"] if command == "generate" else [])
    line = error_line(argv)
    assert says in line, line


def test_a_large_seed_in_range_samples(model_dir, capsys):
    argv = ["generate", str(model_dir), "--prompt", "hi", "--max_new_tokens", "2", "--temperature", "0.7"]
    assert main([*argv, "--seed", str(2**64 - 1)]) == 0


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])
def test_chat_stdin_that_is_not_utf8(errors, model_dir, monkeypatch, error_line):
    """A terminal or pipe in a UTF-8 locale raises on the bytes (strict); in the C locale Python hands them on as
    lone surrogates (surrogateescape), which the tokenizer refused with a TypeError."""
    stdin = io.TextIOWrapper(io.BytesIO(b"hello\nh\xffi\n"), encoding="utf-8", errors=errors)
    monkeypatch.setattr("sys.stdin", stdin)
    line = error_line(["chat", str(model_dir), "--max_new_tokens", "2"])
    assert "stdin" in line and "line 2" in line and "UTF-8" in line and "0xff" in line, line


def test_a_prompt_argument_that_is_not_utf8(model_dir, no_model, error_line):
    line = error_line(["generate", str(model_dir), "--prompt", "ok", "--prompt", "h\udcffi"])
    assert "--prompt 2" in line and "UTF-8" in line and "0xff" in line, line


def test_a_prompts_directory_is_called_a_directory(model_dir, tmp_path, no_model, error_line):
    line = error_line(["generate", str(model_dir), "--prompts", str(tmp_path)])
    assert "is a directory" in line and "does not exist" not in line, line
    line = error_line(["generate", str(model_dir), "--prompts", str(tmp_path / "missing.jsonl")])
    assert "does not exist" in line, line


@pytest.mark.parametrize(
    "flags, flag, key",
    [
        (["--max_examples", "0"], "--max_examples", "eval_max_examples"),
        (["--max_examples", "-3", "--split", "heldout"], "--max_examples", "eval_max_examples"),
        (["--sequence_len", "0"], "--sequence_len", "config key"),
        (["--val_set_size", "-1"], "--val_set_size", "config key"),
        (["--val_set_size", "nan"], "--val_set_size", "config key"),
        (["--dataset_type", "tabular"], "--dataset_type", "datasets[0]"),
    ],
    ids=["max_examples", "max_examples-heldout", "sequence_len", "val_set_size", "val_set_size-nan", "dataset_type"],
)
def test_eval_errors_name_its_own_flags(flags, flag, key, model_dir, tmp_path, no_model, error_line):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "one two three four"}) + "\n")
    line = error_line(["eval", "--model", str(model_dir), "--dataset", str(data), *flags])
    assert flag in line and key not in line, line
