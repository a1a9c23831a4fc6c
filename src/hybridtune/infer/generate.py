"""`hybridtune generate MODEL --prompt ... | --prompts FILE`: completions from a trained model (or any model).

Each prompt becomes a user turn rendered by the tokenizer's chat template with the generation prompt
(`--no_chat_template`: the text as it is), prompts go through transformers' own `generate` in batches (left
padding) with the model's recurrent cache, greedy unless `--temperature` > 0, and each completion stops at the end
of its turn: any end-of-sequence id of the model's generation config or the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from hybridtune.data.chat import check_template_kwargs
from hybridtune.errors import ConfigError, DataError
from hybridtune.runtime.generation import Sampling, generate
from hybridtune.textfile import read_utf8

logger = logging.getLogger(__name__)

MODEL_HELP = (
    "a run's output directory (its final/), OUTPUT_DIR/final, OUTPUT_DIR/checkpoint-N, a LoRA adapter directory, "
    "a model directory, a hub id or a preset"
)


def read_prompts(path: str) -> list:
    """Prompts from a file: JSONL rows with "prompt" (text) or "messages" (a conversation), else one per line."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"prompts file '{path}' does not exist")
    text = read_utf8(p, "a prompts file", DataError)
    lines = [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    if p.suffix.lower() not in (".jsonl", ".ndjson"):
        return [line for _, line in lines]
    prompts: list = []
    for i, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{p}:{i}: malformed JSON ({e.msg} at column {e.colno}); fix or remove the line") from None
        value = row.get("prompt", row.get("messages")) if isinstance(row, dict) else None
        if not isinstance(value, (str, list)):
            raise DataError(f'{p}:{i}: expected an object with "prompt" (text) or "messages" (a conversation)')
        prompts.append(value)
    return prompts


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
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise ConfigError("--temperature must be >= 0, --top_p in (0, 1] and --top_k >= 0")
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
    parser.add_argument("--batch_size", type=int, default=8, help="prompts per generate() call (8)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of completions")
    args = parser.parse_args(argv)
    prompts: list = list(args.prompt) + (read_prompts(args.prompts) if args.prompts else [])
    if not prompts:
        raise ConfigError("no prompt: give --prompt TEXT (repeatable) or --prompts FILE")
    if args.batch_size < 1:
        raise ConfigError(f"--batch_size {args.batch_size}: give at least 1")
    sampling = sampling_of(args)
    opened = open_for_generation(args)
    chat, kwargs = not args.no_chat_template, args.chat_template_kwargs
    done = generate(opened.model, opened.tokenizer, prompts, sampling, chat, args.batch_size, kwargs)
    if args.json:
        print(json.dumps([asdict(c) for c in done], indent=2, ensure_ascii=False))
    elif len(done) == 1:
        print(done[0].completion)
    else:
        for i, c in enumerate(done, 1):
            print(f"### {i}: {c.prompt}\n{c.completion}\n")
    sys.stdout.flush()
    return 0
