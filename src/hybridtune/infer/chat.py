"""`hybridtune chat MODEL`: talk to a model. The conversation is kept (rendered whole by the chat template each
turn); on a terminal the reply streams token by token. `/reset` starts over, `/exit` or Ctrl-D ends."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from hybridtune.errors import DataError
from hybridtune.infer.generate import add_model_args, open_for_generation, sampling_of, utf8_text
from hybridtune.runtime.generation import Sampling, complete, render

HELP = "commands: /reset (forget the conversation), /exit (or Ctrl-D)"


def chat_loop(
    model,
    tokenizer,
    sampling: Sampling,
    stdin: TextIO,
    stdout: TextIO,
    system: str | None = None,
    stream: bool | None = None,
    chat: bool = True,
    template_kwargs: dict | None = None,
) -> list[dict]:
    """Read user turns from `stdin` until /exit or end of input, answer each on `stdout`; returns the conversation.

    `stream`: print tokens as they come (default: when `stdout` is a terminal); otherwise each reply is printed
    whole. Without `chat` (a base model) the turns are joined as plain text."""
    tty = stdin.isatty() and stdout.isatty()
    stream = stdout.isatty() if stream is None else stream
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    if tty:
        print(HELP, file=stdout)
    n = 0
    while True:
        n += 1
        line = _read_turn(stdin, stdout, tty, n)
        if line is None:  # Ctrl-D / end of input
            break
        text = utf8_text(line.rstrip("\r\n"), f"stdin line {n}")
        if not text.strip():
            continue
        if text.strip() == "/exit":
            break
        if text.strip() == "/reset":
            messages = list(start)
            print("(conversation reset)", file=stdout, flush=True)
            continue
        messages.append({"role": "user", "content": text})
        prompt = render(tokenizer, messages, chat, template_kwargs)
        streamer = _Streamer(tokenizer, stdout) if stream else None
        [(ids, _)] = complete(model, tokenizer, [prompt], sampling, chat, 1, streamer=streamer)
        reply = tokenizer.decode(ids, skip_special_tokens=True)
        if streamer is None:
            print(reply, file=stdout, flush=True)
        messages.append({"role": "assistant", "content": reply})
    return messages


def _read_turn(stdin: TextIO, stdout: TextIO, tty: bool, n: int) -> str | None:
    """The next line the user typed (line `n`), or None at end of input. On the process's own terminal through
    `input()` (line editing and history where the readline module exists). Bytes that are not UTF-8 are one
    DataError line (main lets them through as lone surrogates, which utf8_text names by line)."""
    try:
        if tty and stdin is sys.stdin and stdout is sys.stdout:
            try:
                return input("> ")
            except EOFError:
                print(file=stdout)
                return None
        if tty:
            print("> ", end="", file=stdout, flush=True)
        line = stdin.readline()
    except UnicodeDecodeError as e:  # a stream decoded in chunks: the bad byte is in this line or a later one
        byte = f" (byte 0x{e.object[e.start]:02x})" if e.start < len(e.object) else ""
        raise DataError(f"stdin, line {n} or after: not valid UTF-8 text{byte}; give UTF-8 text") from None
    if not line and tty:
        print(file=stdout)
    return line or None


def _streamer_class():
    from transformers import TextStreamer

    class Streamer(TextStreamer):
        """transformers' TextStreamer, writing to a given stream (it prints to sys.stdout)."""

        def __init__(self, tokenizer, out: TextIO):
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
            self.out = out

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            print(text, end="\n" if stream_end else "", file=self.out, flush=True)

    return Streamer


def _Streamer(tokenizer, out: TextIO):  # noqa: N802 (a class made on first use: transformers loads lazily)
    return _streamer_class()(tokenizer, out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hybridtune chat", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    parser.add_argument("--system", help="a system message that starts the conversation")
    args = parser.parse_args(argv)
    sampling = sampling_of(args)
    system = utf8_text(args.system, "--system") if args.system else None
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 reach utf8_text, which says which line
        sys.stdin.reconfigure(errors="surrogateescape")
    opened = open_for_generation(args)
    chat, kwargs = not args.no_chat_template, args.chat_template_kwargs
    chat_loop(
        opened.model, opened.tokenizer, sampling, sys.stdin, sys.stdout, system, chat=chat, template_kwargs=kwargs
    )
    return 0
