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
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hybridtune.errors import ConfigError, DataError, ModelError
from hybridtune.textfile import read_utf8

logger = logging.getLogger(__name__)

MODEL_HELP = (
    "a run's output directory (its final/), OUTPUT_DIR/final, OUTPUT_DIR/checkpoint-N, a LoRA adapter directory, "
    "a model directory, a hub id or a preset"
)


@dataclass
class Completion:
    prompt: str
    completion: str
    new_tokens: int
    finish_reason: str  # "stop" (end of turn) or "length" (max_new_tokens)


@dataclass
class Sampling:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None

    def kwargs(self) -> dict:
        """generate()'s decoding arguments; every one is given, so a model's own sampling defaults (a released
        checkpoint's generation_config often samples) never turn greedy decoding into sampling."""
        if self.temperature <= 0:
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k or None}


def eos_ids(model, tokenizer) -> list[int]:
    """The ids that end a turn: the generation config's end-of-sequence ids and the tokenizer's."""
    ids: list[int] = []
    for value in (getattr(getattr(model, "generation_config", None), "eos_token_id", None), tokenizer.eos_token_id):
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def render(tokenizer, conversation: list[dict] | str, chat: bool) -> str:
    """The text the model continues: a conversation through the chat template with the assistant's generation
    prompt, or plain text as it is."""
    if not chat:
        return conversation if isinstance(conversation, str) else "\n".join(m["content"] for m in conversation)
    if isinstance(conversation, str):
        conversation = [{"role": "user", "content": conversation}]
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError("the model's tokenizer has no chat template; pass --no_chat_template to give plain text")
    return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)


def model_device(model) -> torch.device:
    return next(model.parameters()).device


@torch.inference_mode()
def complete(
    model, tokenizer, texts: list[str], sampling: Sampling, chat: bool = True, batch_size: int = 8, streamer=None
) -> list[tuple[list[int], str]]:
    """The new tokens of each rendered text (cut after the first end-of-turn id, which they keep) and its finish
    reason. `chat`: the texts were rendered by the chat template, which writes its own special tokens."""
    eos = eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # the new tokens of every row start at the same column
    out: list[tuple[list[int], str]] = []
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    try:
        for start in range(0, len(texts), batch_size):
            chunk = texts[start : start + batch_size]
            enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=not chat)
            enc = {k: v.to(model_device(model)) for k, v in enc.items()}
            gen = model.generate(
                **enc,
                max_new_tokens=sampling.max_new_tokens,
                eos_token_id=eos or None,
                pad_token_id=pad,
                streamer=streamer,
                **sampling.kwargs(),
            )
            for row in gen[:, enc["input_ids"].shape[1] :].tolist():
                stop = next((i for i, t in enumerate(row) if t in eos), None)
                out.append((row, "length") if stop is None else (row[: stop + 1], "stop"))
    finally:
        tokenizer.padding_side = side
    return out


def generate(
    model, tokenizer, prompts: list, sampling: Sampling, chat: bool = True, batch_size: int = 8
) -> list[Completion]:
    """Completions of `prompts` (each a string, or a conversation: a list of {role, content})."""
    texts = [render(tokenizer, p, chat) for p in prompts]
    done = complete(model, tokenizer, texts, sampling, chat, batch_size)
    return [
        Completion(
            p if isinstance(p, str) else json.dumps(p), tokenizer.decode(ids, skip_special_tokens=True), len(ids), why
        )
        for p, (ids, why) in zip(prompts, done)
    ]


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
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="where to run (auto: GPU)")
    parser.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="weights' dtype (auto: as saved)"
    )


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
    done = generate(opened.model, opened.tokenizer, prompts, sampling, not args.no_chat_template, args.batch_size)
    if args.json:
        print(json.dumps([asdict(c) for c in done], indent=2, ensure_ascii=False))
    elif len(done) == 1:
        print(done[0].completion)
    else:
        for i, c in enumerate(done, 1):
            print(f"### {i}: {c.prompt}\n{c.completion}\n")
    sys.stdout.flush()
    return 0
