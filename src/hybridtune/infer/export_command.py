"""`hybridtune export OUTPUT_DIR/checkpoint-N OUT`: a training checkpoint as the model transformers and peft load.

The checkpoint (torch DCP, which neither loads) is verified, its model rebuilt from the run's recorded config and
its weights loaded (`infer.load`), then exported exactly as the run's own final model is (`train.export.save_final`):
`OUT/final/` holds the full model or the LoRA adapter with the tokenizer (safetensors), `OUT/base_model/` a
preset's base weights beside an adapter, and `OUT/hybridtune_run.json` the run's record, so that OUT is a finished
output directory of that run at step N (`hybridtune generate OUT`, `hybridtune eval --model OUT --split heldout`).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from hybridtune.errors import ModelError, OutputDirError
from hybridtune.files import atomic_write_text
from hybridtune.infer.load import open_model
from hybridtune.run import checkpoint as ckpt
from hybridtune.run import export
from hybridtune.run.card import model_card
from hybridtune.run.merge import check_out_dir
from hybridtune.run.outdir import RUN_FILE
from hybridtune.runtime import distributed

logger = logging.getLogger(__name__)


def export_checkpoint(checkpoint: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Export checkpoint directory `checkpoint` into `out` (see the module docstring); returns `out/final`."""
    src, out = Path(checkpoint).expanduser(), Path(out).expanduser()
    if not (src / ckpt.META_FILE).is_file():
        what = "a run's final model, already loadable" if (src / export.INFO_FILE).is_file() else "not a checkpoint"
        raise ModelError(
            f"'{src}' is {what}: give a checkpoint directory (OUTPUT_DIR/checkpoint-N, which holds {ckpt.META_FILE})"
        )
    check_out_dir(out, overwrite)
    _check_targets(src, out)
    opened = open_model(str(src))
    run = opened.run
    meta = json.loads((src / ckpt.META_FILE).read_text(encoding="utf-8"))  # verified by the load above
    record = (
        meta.get("run")
        if isinstance(meta.get("run"), dict)
        else json.loads((src.parent / RUN_FILE).read_text(encoding="utf-8"))
    )
    step = int(opened.step)
    card = model_card(run, opened.loaded, step, src.parent)
    final = export.save_final(
        out, opened.model, opened.model, opened.tokenizer, distributed.ONE, adapter=run.adapter, loaded=opened.loaded,
        steps=step, card=card,
    )  # fmt: skip
    atomic_write_text(out / RUN_FILE, json.dumps(record, indent=2))
    logger.info("exported %s (step %d) to %s", src, opened.step, final)
    return final


def _check_targets(src: Path, out: Path) -> None:
    """What the export writes (OUT/final, OUT/base_model, replaced whole) must not be the user's, and OUT must not be
    inside the checkpoint (its files would be extra files that fail its checksums: a resume skips it)."""
    target, checkpoint = out.resolve(), src.resolve()
    if target == checkpoint or checkpoint in target.parents:
        raise OutputDirError(
            f"'{out}' is inside the checkpoint '{src}', which it would damage; give a directory outside it"
        )
    for sub in (export.FINAL_DIR, export.BASE_DIR):
        if (out / sub).exists() and not ckpt.is_ours(out / sub):
            raise OutputDirError(
                f"'{out / sub}' was not written by hybridtune (no {ckpt.MARKER} marker) and the export would replace "
                "it; move it away or give another OUT"
            )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hybridtune export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint directory: OUTPUT_DIR/checkpoint-N")
    parser.add_argument(
        "out", metavar="OUT", help="where to write (must not exist or be empty); the model in OUT/final"
    )
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty OUT")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    final = export_checkpoint(args.checkpoint, args.out, args.overwrite)
    print(final)
    return 0
