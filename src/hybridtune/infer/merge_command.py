"""`hybridtune merge MODEL OUT_DIR`: MODEL named as generate, chat, eval and export name it (`load.resolve_dir`: a
run's output directory stands for its final/), then run/merge.py folds its LoRA adapter into the base. What holds no
adapter is one line saying what it is: a full fine-tune's model (nothing to merge), a training checkpoint (export it
first), a path that does not exist."""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridtune.errors import ModelError
from hybridtune.infer.load import ADAPTER_CONFIG, resolve_dir
from hybridtune.run import checkpoint as ckpt
from hybridtune.run.merge import merge

MODEL_HELP = "a run's output directory (its final/), OUTPUT_DIR/final or another LoRA adapter directory"


def adapter_dir(spec: str) -> Path:
    """The LoRA adapter directory MODEL `spec` names; a ModelError (one line) for anything else."""
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelError(f"'{spec}' does not exist; give a run's output directory or its final/ (a LoRA adapter)")
    if not path.is_dir():
        raise ModelError(f"'{spec}' is a file; give a run's output directory or its final/ (a LoRA adapter)")
    path = resolve_dir(path)
    if (path / ADAPTER_CONFIG).is_file():
        return path
    if (path / ckpt.META_FILE).is_file():
        raise ModelError(
            f"'{path}' is a training checkpoint, not an adapter: export it first (hybridtune export {path} OUT), "
            "then merge OUT"
        )
    if (path / "config.json").is_file():
        raise ModelError(
            f"'{path}' is a full model (config.json, no {ADAPTER_CONFIG}): nothing to merge; a full fine-tune's "
            "final/ is already the whole model, loadable with from_pretrained as it is"
        )
    raise ModelError(f"'{path}' holds no LoRA adapter ({ADAPTER_CONFIG}); give a run's output directory or its final/")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hybridtune merge", description=__doc__.splitlines()[0])
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("out_dir", help="where to write the merged model (must not exist)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty out_dir")
    parser.add_argument(
        "--base_quantization",
        choices=("nf4", "none"),
        help="what the adapter trained on, when it records none (a bare peft adapter): nf4 for a QLoRA adapter "
        "(load_in_4bit), whose merge folds it into the base's NF4 values as trained; default: its record",
    )
    args = parser.parse_args(argv)
    merge(adapter_dir(args.model), args.out_dir, args.overwrite, args.base_quantization)
    return 0
