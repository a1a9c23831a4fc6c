"""A preference row's replies given as messages hold only the model's turns: assistant turns, and tool results
answering a tool call made earlier in the same reply. A user or system turn there (it would be trained as if the
model had said it) is one line naming file:line, the field and the role; the prompt holds any roles as before."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_rows import trained_text, write

from hybridtune.cli import main
from hybridtune.config import DatasetConfig
from hybridtune.data.chat import with_chat_template
from hybridtune.data.examples import load_source
from hybridtune.errors import DataError
from hybridtune.models.loading import tokenizer_for


@pytest.fixture(scope="module")
def tok():
    return tokenizer_for("tiny-qwen3_5")


def msg(role, text, **kw):
    return {"role": role, "content": text, **kw}


GOOD = {"prompt": [msg("user", "2+2=")], "chosen": [msg("assistant", "4")], "rejected": [msg("assistant", "5")]}
CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}


@pytest.mark.parametrize(
    ("field", "reply", "role", "j"),
    [
        ("chosen", [msg("user", "ignore that"), msg("assistant", "4")], "user", 0),
        ("rejected", [msg("system", "be wrong"), msg("assistant", "5")], "system", 0),
        ("chosen", [msg("assistant", "4"), msg("user", "sure?"), msg("assistant", "yes")], "user", 1),
        ("rejected", [msg("tool", "4"), msg("assistant", "5")], "tool", 0),  # answers no call of the reply
    ],
)
def test_a_reply_turn_not_the_models_is_one_line(tmp_path, tok, field, reply, role, j):
    path = write(tmp_path / "p.jsonl", [GOOD, {**GOOD, field: reply}])
    with pytest.raises(DataError) as e:
        load_source(DatasetConfig(path=path), tok, cache=False)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{path}:2: "), line
    assert f"message {j} of '{field}' has role '{role}'" in line, line


def test_renamed_reply_fields_are_named(tmp_path, tok):
    row = {
        "q": [msg("user", "2+2=")],
        "good": [msg("system", "x"), msg("assistant", "4")],
        "bad": [msg("assistant", "5")],
    }
    path = write(tmp_path / "p.jsonl", [row])
    ds = DatasetConfig(path=path, field_prompt="q", field_chosen="good", field_rejected="bad")
    with pytest.raises(DataError, match=r"p\.jsonl:1: message 0 of 'good' has role 'system'"):
        load_source(ds, tok, cache=False)


def test_replies_that_fork_before_a_user_turn_name_the_fork(tmp_path, tok):
    """Without a prompt field the replies start where the two conversations first differ: a fork before a user turn
    puts that turn in the replies."""
    chosen = [msg("user", "hi"), msg("assistant", "hello"), msg("user", "2+2="), msg("assistant", "4")]
    rejected = [msg("user", "hi"), msg("assistant", "go away"), msg("user", "2+2="), msg("assistant", "5")]
    path = write(tmp_path / "p.jsonl", [{"chosen": chosen, "rejected": rejected}])
    with pytest.raises(DataError) as e:
        load_source(DatasetConfig(path=path), tok, cache=False)
    line = str(e.value)
    assert "p.jsonl:1: message 2 of 'chosen' has role 'user'" in line and "differ at message 1" in line, line


def test_the_prompt_holds_any_roles_and_replies_their_tool_results(tmp_path, tok):
    prompt = [msg("system", "be brief"), msg("user", "hi"), msg("assistant", "hello"), msg("user", "2+2=")]
    chosen = [msg("assistant", "", tool_calls=[CALL]), msg("tool", "4"), msg("assistant", "4")]
    rows = [{"prompt": prompt, "chosen": chosen, "rejected": [msg("assistant", "5")]}]
    qwen = with_chat_template(tok, str(Path(__file__).with_name("qwen3_5_chat_template.jinja")))  # renders tool calls
    got = load_source(DatasetConfig(path=write(tmp_path / "p.jsonl", rows)), qwen, cache=False)
    c, r = got.examples[0].docs()
    assert trained_text(qwen, r).endswith("5<|im_end|>")
    assert "be brief" not in trained_text(qwen, c) and "hello" not in trained_text(qwen, c)
    assert trained_text(qwen, c).endswith("4<|im_end|>") and "add" in trained_text(qwen, c)


def test_a_reply_role_the_dataset_trains_is_the_models(tmp_path, tok):
    """A role `roles_to_train` names (a persona's `narrator`, say) is the model's in a reply too, as in SFT rows;
    user and system stay refused there even when named."""
    row = {**GOOD, "chosen": [msg("narrator", "then"), msg("assistant", "4")]}
    path = write(tmp_path / "p.jsonl", [row])
    got = load_source(DatasetConfig(path=path, roles_to_train=["assistant", "narrator"]), tok, cache=False)
    c, _ = got.examples[0].docs()
    assert "then" in trained_text(tok, c) and trained_text(tok, c).endswith("4<|im_end|>")
    with pytest.raises(DataError, match=r"message 0 of 'chosen' has role 'narrator'"):
        load_source(DatasetConfig(path=path), tok, cache=False)  # not named: refused as before
    row = {**GOOD, "chosen": [msg("user", "ignore that"), msg("assistant", "4")]}
    path = write(tmp_path / "q.jsonl", [row])
    with pytest.raises(DataError, match=r"message 0 of 'chosen' has role 'user'"):
        load_source(DatasetConfig(path=path, roles_to_train=["assistant", "user"]), tok, cache=False)


def test_a_dpo_run_on_such_data_exits_2_with_one_line(tmp_path, capsys):
    bad = {**GOOD, "chosen": [msg("user", "ignore that"), msg("assistant", "4")]}
    path = write(tmp_path / "p.jsonl", [GOOD, bad])
    out = tmp_path / "run"
    argv = ["train", "--objective", "dpo", "--dataset", path, "--output_dir", str(out), "--max_steps", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "p.jsonl:2: message 0 of 'chosen' has role 'user'" in errors[0], err
    assert "Traceback" not in err and not (out / "final").exists()
