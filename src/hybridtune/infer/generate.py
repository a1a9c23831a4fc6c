"""`hybridtune generate MODEL --prompt ... | --prompts FILE`: completions from a trained model (or any model).

Each prompt becomes a user turn rendered by the tokenizer's chat template with the generation prompt
(`--no_chat_template`: the text as it is), prompts go through transformers' own `generate` in batches (left
padding) with the model's recurrent cache, greedy unless `--temperature` > 0, and each completion stops at the end
of its turn: any end-of-sequence id of the model's generation config or the tokenizer.

A vision-language model takes images: `--image PATH` (repeatable, relative to the working directory) goes with each
`--prompt`, before its text; a prompts file's messages may hold image parts (`{"type": "image", "image": PATH}`,
relative to the file). Each image is read and checked (as training data's) before the model loads, then goes
through the checkpoint's own image processor. Videos: `--video PATH` (a folder of frames, or frame paths joined by
commas; `--fps`) and a prompts file's video parts, as training data's (infer/video_prompts.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from hybridtune.data.chat import check_template_kwargs
from hybridtune.data.images import URI, image_source, is_image_part, load_image, part_reference
from hybridtune.data.video import is_video_part
from hybridtune.errors import ConfigError, DataError
from hybridtune.infer import video_prompts
from hybridtune.runtime.generation import Sampling, generate, not_vision
from hybridtune.textfile import not_a_file, read_utf8

logger = logging.getLogger(__name__)

MODEL_HELP = (
    "a run's output directory (its final/), OUTPUT_DIR/final, OUTPUT_DIR/checkpoint-N, a LoRA adapter directory, "
    "a model directory, a hub id or a preset"
)


def read_prompts(path: str, wheres: list[str] | None = None) -> list:
    """Prompts from a file: JSONL rows with "prompt" (text or a conversation) or "messages" (a conversation),
    else one per line. Each conversation is checked here, before any model loads: a list of objects with a "role"
    and a "content" (text, or a list of text parts, joined). `wheres` gets each prompt's file:line."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise DataError(f"--prompts '{path}' is a directory; give a file: one prompt per line, or JSONL rows")
    if not p.is_file():
        raise DataError(f"prompts file '{path}' {not_a_file(p)}; give a file: one prompt per line, or JSONL rows")
    text = read_utf8(p, "a prompts file", DataError)
    lines = [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    if wheres is not None:  # (each line one prompt, or an error)
        wheres += [f"{p}:{i}" for i, _ in lines]
    if p.suffix.lower() not in (".jsonl", ".ndjson"):
        return [line for _, line in lines]
    prompts: list = []
    for i, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{p}:{i}: malformed JSON ({e.msg} at column {e.colno}); fix or remove the line") from None
        key = next((k for k in ("prompt", "messages") if isinstance(row, dict) and k in row), None)
        value = row[key] if key else None
        if not isinstance(value, (str, list)):
            raise DataError(f'{p}:{i}: expected an object with "prompt" (text) or "messages" (a conversation)')
        prompts.append(value if isinstance(value, str) else conversation(value, f"{p}:{i}", key, p.parent))
    return prompts


def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def conversation(value: list, where: str, key: str, base: Path | None = None) -> list[dict]:
    """`value` as the chat template takes a conversation: objects with a "role" and text "content" (a list of
    {"type": "text"} parts joined; null or no content only beside "tool_calls"). DataError (one line) otherwise.
    A content list with image parts stays a list, each image's path made absolute (relative ones from `base`)."""
    if not value:
        raise DataError(f'{where}: "{key}" is an empty list; give at least one {{"role": ..., "content": ...}}')
    if all(isinstance(m, str) for m in value):
        raise DataError(
            f'{where}: "{key}" is a list of {len(value)} strings; give one text per row as "prompt", or a '
            'conversation: a list of {"role": ..., "content": ...}'
        )
    messages = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise DataError(
                f'{where}: message {j} of "{key}" is {_shown(m)}; give an object with a "role" and a "content"'
            )
        content = m.get("content")
        texts = isinstance(content, list) and all(
            isinstance(c, dict)
            and (c.get("type") == "text" and isinstance(c.get("text"), str) or is_image_part(c) or is_video_part(c))
            for c in content
        )
        if texts and not any(is_image_part(c) or is_video_part(c) for c in content):
            content = "".join(c["text"] for c in content)
        elif texts:
            content = [(video_prompts.resolved if is_video_part(c) else _resolved)(
                c, where, f"message {j} of {key!r}, content part {k}", base) for k, c in enumerate(content)]  # fmt: skip
        elif content is None and m.get("tool_calls"):
            content = ""  # an assistant turn that only calls tools (OpenAI writes null)
        if not isinstance(content, (str, list)):
            got = 'no "content"' if "content" not in m else f'"content" {_shown(content)}'
            raise DataError(
                f'{where}: message {j} of "{key}" (role {m["role"]!r}) has {got}; give its text as "content" '
                '(a string, or a list of {"type": "text", "text": ...} and {"type": "image", "image": PATH} parts)'
            )
        messages.append({**m, "content": content})
    return messages


def _resolved(part: dict, where: str, what: str, base: Path | None) -> dict:
    """A content part; an image part as {"type": "image", "image": SOURCE} (an absolute path or a data: URI), the
    image read and checked now, before any model loads (as training data's images: one DataError line)."""
    if not is_image_part(part):
        return part
    source = image_source(part_reference(part, where, what), base, where, what)
    load_image(source, where, what)
    return {"type": "image", "image": source}


def with_images(prompts: list, images: list[str], videos: tuple = (), fps: float = video_prompts.DEFAULT_FPS) -> list:
    """The --prompt texts, each a user turn of the `images` (paths from the working directory, or data: URIs;
    each read and checked), the `videos` (--video: folders of frames or frame lists at `fps`), then its text."""
    if not images and not videos:
        return prompts
    parts = [{"type": "image", "image": image_arg(x, f"--image {i}")} for i, x in enumerate(images, 1)]
    parts += [video_prompts.video_arg(x, fps, f"--video {i}") for i, x in enumerate(videos, 1)]
    return [[{"role": "user", "content": [*parts, {"type": "text", "text": p}]}] for p in prompts]


def image_arg(x: str, where: str) -> str:
    """An image given on the command line (`where`: '--image 2'): a path from the working directory or a data: URI,
    read and checked; its source (an absolute path). DataError (one line) for a bad one."""
    path = Path(x).expanduser()
    if not x.startswith("data:") and not URI.match(x) and not path.is_file():  # (a URL: image_source says so)
        there = not_a_file(path)
        raise DataError(f"{where}: '{x}' {there} (a path relative to the working directory); fix the path")
    return _resolved({"type": "image", "image": x}, where, "the image", None)["image"]  # (typed: not confined)


def has_images(prompts: list) -> bool:
    return any(
        isinstance(m.get("content"), list) and any(is_image_part(c) for c in m["content"])
        for p in prompts
        if isinstance(p, list)
        for m in p
    )


def media_given(args, rows: list, wheres: list[str]) -> str:
    """What put images or videos into the prompts, as a text model's error names it to drop: the flags given, and
    the first row of the prompts file (`rows`, each at its `wheres` file:line) holding each kind of part."""
    named = [flag for flag, values in (("--image", args.image), ("--video", args.video)) if values]
    for kind, holds in (("image", has_images), ("video", video_prompts.has_videos)):
        at = [where for row, where in zip(rows, wheres) if holds([row])]
        more = f" (and of {len(at) - 1} more row{'s' * (len(at) > 2)})" if len(at) > 1 else ""
        named += [f"the {kind} parts of {at[0]}{more}"] if at else []
    return " and ".join(named)


def vision_of(opened, needed: str | bool, run=None):
    """The opened model's image side (runtime.vision.vision_for: its processor, the min/max_pixels of `run`, else
    of the run it comes from), or None for a text model; when `needed` (the prompts hold images or videos; a text:
    what put them there, to name), a text model is one ModelError line."""
    from hybridtune.runtime.vision import vision_for  # why here: torch-bound, past argument parsing

    loaded = opened.loaded
    source = loaded.source_dir if loaded is not None else opened.path
    run = run if run is not None else opened.run
    sizes = getattr(run, "min_pixels", None), getattr(run, "max_pixels", None)
    vision = vision_for(source, opened.tokenizer, *sizes, recorded=True)
    if vision is None and needed:
        raise not_vision(opened.name, *([needed] if isinstance(needed, str) else []))
    return vision


def utf8_text(text: str, where: str) -> str:
    """`text` when it is text; one DataError line when it holds bytes that were not UTF-8 (Python passes them on
    as lone surrogates from argv, and from stdin in the C locale), which the tokenizer refuses with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        byte = f" (byte 0x{code - 0xDC00:02x})" if 0xDC80 <= code <= 0xDCFF else ""
        raise DataError(f"{where}: not valid UTF-8 text at column {e.start + 1}{byte}; give UTF-8 text") from None
    return text


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The flags `generate` and `chat` share: decoding, template, device."""
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("--max_new_tokens", type=int, default=256, help="most new tokens per completion (256)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling share when sampling (1.0: off)")
    parser.add_argument("--top_k", type=int, default=0, help="sample among the k likeliest tokens (0: off)")
    parser.add_argument("--seed", type=int, default=None, help="random seed of the sampling")
    parser.add_argument("--no_chat_template", action="store_true", help="give the text as it is (a base model)")
    parser.add_argument(
        "--chat_template_kwargs",
        type=template_kwargs,
        default={},
        metavar="JSON",
        help="variables for the chat template, e.g. '{\"enable_thinking\": false}' (as train's key of that name)",
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="where to run (auto: GPU)")
    parser.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="weights' dtype (auto: as saved)"
    )


def add_video_args(parser: argparse.ArgumentParser, where: str) -> None:
    parser.add_argument(
        "--video",
        action="append",
        default=[],
        metavar="PATH",
        help=f"a video {where}: a folder of frames (its image files by name) or frame paths joined by commas "
        "(repeatable; a vision-language model)",
    )
    parser.add_argument(
        "--fps",
        type=float,
        default=video_prompts.DEFAULT_FPS,
        help="the --video frames' rate (timestamps; 2; one frame an hour to 240 a second)",
    )


def template_kwargs(text: str) -> dict:
    """`--chat_template_kwargs` (an argparse type): a JSON object of the template's variables."""
    try:
        return check_template_kwargs(json.loads(text), "the object")
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"not JSON ({e.msg} at column {e.colno}); give an object, e.g. '{{\"enable_thinking\": false}}'"
        ) from None
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def sampling_of(args) -> Sampling:
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens {args.max_new_tokens}: give at least 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(f"--temperature {args.temperature:g}: give a number >= 0 (0: greedy decoding)")
    if not 0 < args.top_p <= 1:  # (NaN too)
        raise ConfigError(f"--top_p {args.top_p:g}: give a share in (0, 1] (1: off)")
    if args.top_k < 0:
        raise ConfigError(f"--top_k {args.top_k}: give 0 (off) or more")
    if args.seed is not None and not 0 <= args.seed < 2**64:  # what torch.manual_seed takes
        raise ConfigError(f"--seed {args.seed}: give a whole number from 0 to 2**64 - 1")
    return Sampling(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed)


def open_for_generation(args):
    """The model named on the command line, unpatched, on its device (quiet transformers progress bars)."""
    # why here: past argument parsing, so --help and a bad flag answer before transformers loads
    from transformers.utils import logging as hf_logging

    from hybridtune.infer.load import open_model
    from hybridtune.runtime.choices import pick_device

    hf_logging.disable_progress_bar()
    dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    opened = open_model(args.model, dtype=dtype)
    opened.model.to(pick_device(args.device))
    return opened


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hybridtune generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    parser.add_argument("--prompts", metavar="FILE", help="prompts: one per line, or JSONL with prompt / messages")
    parser.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image for each --prompt, before its text (repeat for several; a vision-language model)",
    )
    add_video_args(parser, "for each --prompt, after its images")
    parser.add_argument("--batch_size", type=int, default=8, help="prompts per generate() call (8)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of completions")
    args = parser.parse_args(argv)
    given = [utf8_text(text, f"--prompt {i}") for i, text in enumerate(args.prompt, 1)]
    for flag, parts in (("--image", args.image), ("--video", args.video)):
        if parts and not given:
            raise ConfigError(
                f"{flag} goes with --prompt TEXT; in a prompts file, give {flag[2:]} parts in the messages"
            )
    prompts: list = with_images(given, args.image, args.video, args.fps)
    wheres: list[str] = []
    from_file = read_prompts(args.prompts, wheres) if args.prompts else []
    prompts += from_file
    if not prompts:
        raise ConfigError("no prompt: give --prompt TEXT (repeatable) or --prompts FILE")

    if args.batch_size < 1:
        raise ConfigError(f"--batch_size {args.batch_size}: give at least 1")
    sampling = sampling_of(args)
    opened = open_for_generation(args)
    videos = video_prompts.has_videos(prompts)
    vision = vision_of(opened, needed=media_given(args, from_file, wheres))
    chat, kwargs = not args.no_chat_template, args.chat_template_kwargs
    run = video_prompts.generate if videos else generate
    done = run(opened.model, opened.tokenizer, prompts, sampling, chat, args.batch_size, kwargs, vision, args.model)
    if args.json:
        print(json.dumps([asdict(c) for c in done], indent=2, ensure_ascii=False))
    elif len(done) == 1:
        print(done[0].completion)
    else:
        for i, c in enumerate(done, 1):
            print(f"### {i}: {c.prompt}\n{c.completion}\n")
    sys.stdout.flush()
    return 0
