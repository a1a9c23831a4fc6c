"""`hybridtune eval --model M --dataset F`: held-out loss, perplexity, exact match and token counts of a model on a
dataset, computed as the trainer computes its eval (the same data preparation, the same packed forward through
hybridtune's ops, `train.evaluation.evaluate`), so a run's logged eval and this command agree on the same data.

`--split all` (the default) evaluates every example of the file; `--split heldout` the held-out examples a run
with this config holds out (its `val_set_size` and `seed`, or its `test_datasets`; its `eval_max_examples`): for a
model that comes from a run's output directory and that run's own data, the very examples its logged evals read. Data keys
(format, fields, `sequence_len`, `train_on_inputs`) are the run's when the model comes from one, else the defaults;
the flags below override them. Exact match is reported for prompt/response data (chat, sharegpt, alpaca,
prompt_completion) only: for plain text it means nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re

import torch

from hybridtune.config import TrainConfig, load_config, to_dict
from hybridtune.data import PackedCollator
from hybridtune.data.build import covering_length, load_data, prepare
from hybridtune.data.examples import load_examples
from hybridtune.data.formats import detect_type
from hybridtune.data.images import set_image_policy
from hybridtune.data.packing import Example, fit_to_length
from hybridtune.data.pairs import PREFERENCE, Pair, is_preference
from hybridtune.data.sources import ACCEPTED, open_source
from hybridtune.errors import ConfigError, DataError
from hybridtune.infer.generate import MODEL_HELP, template_kwargs, vision_of
from hybridtune.infer.load import Opened, open_model, recorded_run
from hybridtune.runtime.adapter_kind import FULL, LORA
from hybridtune.runtime.choices import choose_bf16, pick_device
from hybridtune.runtime.distributed import ONE, LossModule
from hybridtune.runtime.measure import measure
from hybridtune.train.evaluation import evaluate
from hybridtune.train.objectives.preference import prepare_pairs

logger = logging.getLogger(__name__)

RESPONSE_FORMATS = (
    "chat",
    "sharegpt",
    "alpaca",
    "prompt_completion",
    PREFERENCE,
)  # formats where exact match means something

# The config key each flag sets: an error about one names the flag the user gave.
FLAG_KEYS = {
    "--sequence_len": "sequence_len",
    "--val_set_size": "val_set_size",
    "--max_examples": "eval_max_examples",
    "--chat_template_kwargs": "chat_template_kwargs",
    "--dataset": "datasets[0].path",
    "--dataset_type": "datasets[0].type",
    "--dataset_split": "datasets[0].split",
    "--dataset_name": "datasets[0].name",
}


def eval_config(run: TrainConfig | None, overrides: dict, data: dict | None = None) -> TrainConfig:
    """The run's config (or the defaults) with the command's keys on top. `data`: a data source (DatasetConfig keys)
    that replaces the run's data, its test_datasets too."""
    base = to_dict(run) if run is not None else {}
    if data is not None:
        for key in ("dataset", "datasets", "test_datasets"):
            base.pop(key, None)
        overrides = {**overrides, "datasets": [data]}
    return load_config(None, {**base, **overrides}, warn=False, training=False)  # (eval trains nothing)


def eval_examples(cfg: TrainConfig, tokenizer, split: str, vision=None) -> tuple[list[Example], int]:
    """The examples evaluated, and how many were dropped as longer than sequence_len (or without a scored token);
    a `sequence_len: auto` is decided in `cfg` (`all`: the smallest power of two holding every example).

    `heldout`: the trainer's own held-out examples (`data.build.prepare`, capped at eval_max_examples). `all`:
    every example of the data, prepared as the held-out ones are (overlong ones dropped, not truncated). Of
    preference pairs, the chosen replies (as the trainer evaluates them). `vision`: a vision-language model's
    (data/vision.py), which takes the rows' images as training does."""
    if split == "heldout":
        loaded = load_data(cfg, tokenizer, vision)
        pairs = any(src.fmt == PREFERENCE for src in loaded.sources)
        data = prepare_pairs(cfg, loaded) if pairs else prepare(cfg, tokenizer, loaded)
        held, cfg.sequence_len = data.eval_examples, data.sequence_len  # (a run's own, or auto's 256)
        if not held:
            raise DataError(f"val_set_size={cfg.val_set_size} holds out no example of this data; use --split all")
        return held[: cfg.eval_max_examples], 0
    examples: list[Example] = []
    set_image_policy(cfg.allow_outside_images, cfg.image_roots)  # (as load_data: where images may be read from)
    for ds in cfg.resolved_datasets():
        kwargs = cfg.chat_template_kwargs
        got = load_examples(
            ds, tokenizer, cfg.train_on_inputs, cfg.dataset_num_proc, template_kwargs=kwargs, vision=vision
        )
        examples.extend(e.docs()[0] if isinstance(e, Pair) else e for e in got)
    if cfg.sequence_len == "auto":  # a model outside a run: every example whole
        cfg.sequence_len = covering_length([len(e) for e in examples], 1.0)
    kept, stats = fit_to_length(examples, cfg.sequence_len, "drop")
    if not kept:
        raise DataError(
            f"no example to evaluate ({stats.examples_in} read, {stats.dropped} longer than sequence_len="
            f"{cfg.sequence_len} or without a scored token); raise --sequence_len or check the data"
        )
    return kept, stats.dropped


def data_formats(cfg: TrainConfig) -> set[str]:
    """The row format of each data source (its first row's, where `auto`, as data.examples detects it)."""
    found = set()
    for ds in cfg.resolved_datasets():
        if ds.type != "auto":
            found.add(ds.type)
            continue
        src = open_source(ds)
        if len(src):
            found.add(PREFERENCE if is_preference(src.row(0), ds) else detect_type(src.row(0), ds, src.where(0)))
    return found


def as_trained(model: torch.nn.Module, bf16: bool) -> None:
    """The dtypes the trainer evaluates its model in (runtime/adapter_kind.py, `AdapterKind.held_dtype`): a full
    fine-tune's fp32 masters; under LoRA the frozen base in bf16 when bf16 computes, else fp32, and the adapters in
    fp32. A model saved in bf16 is upcast exactly; a full fine-tune exported in bf16 was rounded there, so its eval
    differs from the logged one by that rounding alone."""
    held = (LORA if hasattr(model, "peft_config") else FULL).held_dtype(bf16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point():
                p.data = p.data.to(torch.float32 if "lora_" in name else held)


def run_eval(opened: Opened, cfg: TrainConfig, split: str = "all", device: str = "cpu") -> dict:
    """The eval of `opened` (opened with `patched=True`) on the data of `cfg`; the trainer's numbers for the same
    examples, plus perplexity and token counts."""
    vision = vision_of(opened, False, cfg)  # a vision-language model's image processor (None for a text model)
    examples, dropped = eval_examples(cfg, opened.tokenizer, split, vision)
    dev = pick_device(device)
    bf16 = choose_bf16(cfg, measure(cfg, dev, ONE)).value
    as_trained(opened.model, bf16)
    model = opened.model.to(dev)

    def autocast():
        return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16)

    res = evaluate(LossModule(model), examples, cfg.sequence_len, dev, autocast, ONE, PackedCollator(vision=vision))
    formats = data_formats(cfg)
    scored = sum(sum(e.loss_mask[1:]) for e in examples)  # targets: masked-in tokens past each document's first
    return {
        "model": opened.name,
        "step": opened.step,
        "split": split,
        "eval_loss": res["eval_loss"],
        "perplexity": math.exp(min(res["eval_loss"], 700.0)),
        "exact_match": res["exact_match"] if formats and formats <= set(RESPONSE_FORMATS) else None,
        "eval_examples": res["eval_examples"],
        "dropped_examples": dropped,
        "eval_tokens": scored,
        "tokens": sum(len(e) for e in examples),
        "formats": sorted(formats),
    }


def format_result(res: dict) -> str:
    em = "n/a (plain text)" if res["exact_match"] is None else f"{res['exact_match']:.3f}"
    lines = [
        f"eval_loss    {res['eval_loss']:.4f}",
        f"perplexity   {res['perplexity']:.3f}",
        f"exact_match  {em}",
        f"examples     {res['eval_examples']} ({res['split']}; {res['dropped_examples']} dropped as too long)",
        f"tokens       {res['eval_tokens']} scored of {res['tokens']}",
    ]
    return "\n".join(lines)


def check_flags(args: argparse.Namespace) -> None:
    """The numeric flags, checked here so that an error names the flag, not the config key it sets."""
    if args.max_examples is not None and args.max_examples < 1:
        raise ConfigError(f"--max_examples {args.max_examples}: give at least 1 (it caps --split heldout)")
    if args.sequence_len is not None and args.sequence_len < 2:
        raise ConfigError(f"--sequence_len {args.sequence_len}: give at least 2 (tokens per packed eval row)")
    if args.val_set_size is not None and not (math.isfinite(args.val_set_size) and args.val_set_size >= 0):
        raise ConfigError(
            f"--val_set_size {args.val_set_size:g}: give a share of the data below 1 or a count of examples (>= 0)"
        )


def in_flags(message: str) -> str:
    """A config error about a key a flag set, said with the flag: "config key 'eval_max_examples' = 0 ..." becomes
    "--max_examples = 0 ..." (keys that no flag sets keep their names)."""
    message = message.removeprefix("command line: ")
    for flag, key in FLAG_KEYS.items():
        message = re.sub(rf"(config )?key '{re.escape(key)}'", flag, message)
    return message


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hybridtune eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help=MODEL_HELP)
    parser.add_argument("--dataset", help=f"the data: {ACCEPTED} (default: the data of the run MODEL comes from)")
    parser.add_argument("--dataset_type", help="row format of --dataset (default: auto, from the first row's fields)")
    parser.add_argument("--dataset_split", help="--dataset a directory with splits or a dataset id: the split (train)")
    parser.add_argument("--dataset_name", help="--dataset a directory or dataset id: the config (subset) to read")
    parser.add_argument(
        "--split", choices=["all", "heldout"], default="all", help="every example (default), or a run's held-out split"
    )
    parser.add_argument("--sequence_len", type=int, help="tokens per packed eval row; longer examples are dropped")
    parser.add_argument(
        "--chat_template_kwargs", type=template_kwargs, metavar="JSON", help="the chat template's variables (the run's)"
    )
    parser.add_argument("--val_set_size", type=float, help="--split heldout: the held-out share or count")
    parser.add_argument("--max_examples", type=int, help="--split heldout: at most this many (eval_max_examples)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="where to run (auto: GPU)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    overrides = {
        key: value
        for key, value in (
            ("sequence_len", args.sequence_len),
            ("val_set_size", args.val_set_size),
            ("eval_max_examples", args.max_examples),
            ("chat_template_kwargs", args.chat_template_kwargs),
        )
        if value is not None
    }
    data = None
    if args.dataset is not None:
        data = {"path": args.dataset, "type": args.dataset_type or "auto", "split": args.dataset_split or "train"}
        data.update({"name": args.dataset_name} if args.dataset_name else {})
    elif args.dataset_type or args.dataset_split or args.dataset_name:
        raise ConfigError("--dataset_type, --dataset_split and --dataset_name describe --dataset: give --dataset too")
    run = recorded_run(args.model)
    if run is None and data is None:
        raise ConfigError(f"--model {args.model} does not come from a run's output directory: give --dataset")
    check_flags(args)
    try:
        cfg = eval_config(run, overrides, data)  # before the model loads: a bad key answers at once
    except ConfigError as e:
        raise ConfigError(in_flags(str(e))) from None
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    opened = open_model(args.model, patched=True)
    res = run_eval(opened, cfg, args.split, args.device)
    print(json.dumps(res, indent=2) if args.json else format_result(res))
    return 0
