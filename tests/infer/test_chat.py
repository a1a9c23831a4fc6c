"""`hybridtune chat`: the loop driven through stdin in-process. The conversation is kept (each reply is what
`generate` gives for the whole conversation so far), /reset forgets it, /exit and end of input end it, and a
streamed reply prints the same text."""

from __future__ import annotations

import io
import sys

import pytest

from hybridtune import cli
from hybridtune.infer.chat import chat_loop
from hybridtune.infer.load import open_model
from hybridtune.runtime.generation import Sampling, complete, render

SAMPLING = Sampling(max_new_tokens=8, temperature=1.0, seed=5)  # varied replies, the same for the same seed


def reply(opened, messages) -> str:
    [(ids, _)] = complete(opened.model, opened.tokenizer, [render(opened.tokenizer, messages, True)], SAMPLING)
    return opened.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def opened(trained):
    return open_model(str(trained("tiny-qwen3_5", "lora")))


def test_the_conversation_is_kept_and_reset(opened):
    out = io.StringIO()
    stdin = io.StringIO("3+4=\n\n17+25=\n/reset\nWhat is 40+2?\n/exit\nnever read\n")
    messages = chat_loop(opened.model, opened.tokenizer, SAMPLING, stdin, out, stream=False)
    first = reply(opened, [{"role": "user", "content": "3+4="}])
    turns = [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": first}]
    second = reply(opened, [*turns, {"role": "user", "content": "17+25="}])
    third = reply(opened, [{"role": "user", "content": "What is 40+2?"}])
    assert messages == [{"role": "user", "content": "What is 40+2?"}, {"role": "assistant", "content": third}]
    assert out.getvalue() == f"{first}\n{second}\n(conversation reset)\n{third}\n"
    assert stdin.readline() == "never read\n"  # /exit stopped reading


def test_a_streamed_reply_prints_the_same_text_and_end_of_input_ends(opened):
    out = io.StringIO()
    messages = chat_loop(
        opened.model, opened.tokenizer, SAMPLING, io.StringIO("3+4="), out, system="Be brief.", stream=True
    )
    system = {"role": "system", "content": "Be brief."}
    want = reply(opened, [system, {"role": "user", "content": "3+4="}])
    assert out.getvalue() == want + "\n"
    assert messages[0] == system and messages[-1] == {"role": "assistant", "content": want}


def test_chat_command_reads_stdin(trained, monkeypatch, capsys):
    out = trained("tiny-qwen3_5", "lora")
    monkeypatch.setattr(sys, "stdin", io.StringIO("3+4=\n"))
    argv = ["chat", str(out), "--max_new_tokens", "8", "--temperature", "1.0", "--seed", "5"]
    assert cli.main(argv) == 0
    opened = open_model(str(out))
    assert capsys.readouterr().out == reply(opened, [{"role": "user", "content": "3+4="}]) + "\n"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_it_prompts_and_streams(opened):
    out = Terminal()
    chat_loop(opened.model, opened.tokenizer, SAMPLING, Terminal("3+4=\n"), out)
    want = reply(opened, [{"role": "user", "content": "3+4="}])
    assert out.getvalue() == f"commands: /reset (forget the conversation), /exit (or Ctrl-D)\n> {want}\n> \n"
