"""`hybridtune chat MODEL`: talk to a model. The conversation is kept (rendered whole by the chat template each
turn); on a terminal the reply streams token by token. `/reset` starts over, `/exit` or Ctrl-D ends.

A vision-language model takes images: `--image PATH` (repeatable) goes with the first message, `/image PATH` with
the next one; the images stay in the conversation. `--video PATH` (a folder of frames or frame paths joined by
commas, `--fps`) goes with the first message too (infer/video_prompts.py)."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from hybridtune.errors import DataError, UserError
from hybridtune.infer import video_prompts
from hybridtune.infer.generate import (
    add_model_args,
    add_video_args,
    image_arg,
    media_given,
    open_for_generation,
    sampling_of,
    utf8_text,
    vision_of,
)
from hybridtune.runtime.generation import Sampling, complete, not_vision, render, with_image_text

HELP = "commands: /reset (forget the conversation), /exit (or Ctrl-D)"
IMAGE_HELP = "commands: /image PATH (an image for your next message), " + HELP.removeprefix("commands: ")
IMAGE_COMMAND = "/image"


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
    vision=None,
    images: list[str] | None = None,
    name: str = "MODEL",
) -> list[dict]:
    """Read user turns from `stdin` until /exit or end of input, answer each on `stdout`; returns the conversation.

    `stream`: print tokens as they come (default: when `stdout` is a terminal); otherwise each reply is printed
    whole. Without `chat` (a base model) the turns are joined as plain text. `images` (sources, checked): the first
    message's, again after /reset; `vision`: the model's (data.vision.Vision), which /image needs."""
    tty = stdin.isatty() and stdout.isatty()
    stream = stdout.isatty() if stream is None else stream
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    pending = list(images or [])  # the images of the next user turn
    if tty:
        print(HELP if vision is None else IMAGE_HELP, file=stdout)
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
            messages, pending = list(start), list(images or [])
            print("(conversation reset)", file=stdout, flush=True)
            continue
        if text.strip().split(maxsplit=1)[0] == IMAGE_COMMAND:
            pending += _image_command(text.strip()[len(IMAGE_COMMAND) :].strip(), n, vision, name, stdout)
            continue
        parts = [{"type": "image", "image": s} if isinstance(s, str) else s for s in pending]  # (a dict: a video)
        messages.append({"role": "user", "content": [*parts, {"type": "text", "text": text}] if parts else text})
        pending = []
        held, videos = video_prompts.as_placeholders(messages, vision, f"stdin line {n}") if vision else (messages, [])
        conversation, sources = with_image_text(held, vision, f"stdin line {n}", name)
        prompt = render(tokenizer, conversation, chat, template_kwargs)
        streamer = _Streamer(tokenizer, stdout) if stream else None
        if videos:  # (a conversation with videos: their inputs go with the generate call)
            [(ids, _)] = video_prompts.complete_videos(
                model, tokenizer, [prompt], [videos], sampling, chat, 1, [sources], vision, streamer
            )
        else:
            [(ids, _)] = complete(
                model, tokenizer, [prompt], sampling, chat, 1, streamer=streamer, images=[sources], vision=vision
            )
        reply = tokenizer.decode(ids, skip_special_tokens=True)
        if streamer is None:
            print(reply, file=stdout, flush=True)
        messages.append({"role": "assistant", "content": reply})
    return messages


def _image_command(path: str, n: int, vision, name: str, stdout: TextIO) -> list[str]:
    """`/image PATH`: the image checked and kept for the next turn ([source]); a bad one or a text model is said on
    `stdout` as one line (the conversation goes on) and nothing is kept."""
    try:
        if not path:
            raise DataError(f"stdin line {n}: {IMAGE_COMMAND} needs a path: {IMAGE_COMMAND} PATH")
        if vision is None:
            raise not_vision(name, IMAGE_COMMAND)
        source = image_arg(path, f"stdin line {n}")
    except UserError as e:
        print(f"error: {e}", file=stdout, flush=True)
        return []
    print(f"(image {path} goes with your next message)", file=stdout, flush=True)
    return [source]


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
    parser.add_argument(
        "--image", action="append", default=[], metavar="PATH", help="an image for the first message (repeatable)"
    )
    add_video_args(parser, "for the first message, after its images")
    args = parser.parse_args(argv)
    images = [image_arg(x, f"--image {i}") for i, x in enumerate(args.image, 1)]
    images += [video_prompts.video_arg(x, args.fps, f"--video {i}") for i, x in enumerate(args.video, 1)]
    sampling = sampling_of(args)
    system = utf8_text(args.system, "--system") if args.system else None
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 reach utf8_text, which says which line
        sys.stdin.reconfigure(errors="surrogateescape")
    opened = open_for_generation(args)
    vision = vision_of(opened, needed=media_given(args, [], []))  # (the flags given)
    chat, kwargs = not args.no_chat_template, args.chat_template_kwargs
    chat_loop(
        opened.model,
        opened.tokenizer,
        sampling,
        sys.stdin,
        sys.stdout,
        system,
        chat=chat,
        template_kwargs=kwargs,
        vision=vision,
        images=images,
        name=args.model,
    )
    return 0
