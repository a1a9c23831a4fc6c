"""`hybridtune export OUTPUT_DIR/checkpoint-N OUT`: a training checkpoint as the model transformers and peft load.

The checkpoint (torch DCP, which neither loads) is verified, its model rebuilt from the run's recorded config and
its weights loaded (`infer.load`), then exported exactly as the run's own final model is (`train.export.save_final`):
`OUT/final/` holds the full model or the LoRA adapter with the tokenizer (safetensors), `OUT/base_model/` a
preset's base weights beside an adapter, and `OUT/hybridtune_run.json` the run's record, so that OUT is a finished
output directory of that run at step N (`hybridtune generate OUT`, `hybridtune eval --model OUT --split heldout`).
With `--merged`, a LoRA checkpoint also gives `OUT/merged/`: the adapter folded into its base (run/merge.py), in the
base's dtype and original class, for engines that take no adapters. OUT is locked as a training run locks its output
directory (a run training there, or another export, refuses it) for the whole export, and written through the
guarded layer (run/guarded.py): NaN or Inf weights refused before anything is written, SIGTERM leaves nothing
partial, a killed export's temporaries are removed by the next one.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from hybridtune.errors import ModelError, OutputDirError
from hybridtune.files import atomic_write_text, read_regular_text
from hybridtune.infer.load import missing_checkpoint, open_model
from hybridtune.run import checkpoint as ckpt
from hybridtune.run import export, guarded
from hybridtune.run.card import model_card
from hybridtune.run.lock import LOCK_FILE, OutputLock
from hybridtune.run.merge import merge
from hybridtune.run.outdir import RUN_FILE, record_changes
from hybridtune.run.targets import refuse_run_part, refuse_system_dir
from hybridtune.runtime import distributed
from hybridtune.runtime.adapter_kind import adapter_kind

logger = logging.getLogger(__name__)


MERGED_DIR = "merged"  # OUT/merged: the adapter folded into its base (--merged)


def export_checkpoint(checkpoint: str | Path, out: str | Path, overwrite: bool = False, merged: bool = False) -> Path:
    """Export checkpoint directory `checkpoint` into `out` (see the module docstring); returns `out/final`. SIGTERM
    stops it as Ctrl-C does, leaving nothing partial."""
    src, out = Path(checkpoint).expanduser(), Path(out).expanduser()
    written = (export.FINAL_DIR, export.BASE_DIR, RUN_FILE, MERGED_DIR)  # a full disk: said with what changed
    with guarded.interruptible(), guarded.full_disk_said(f"exporting '{src}'", out, written, "run the export again"):
        return _export(src, out, overwrite, merged)


def _export(src: Path, out: Path, overwrite: bool, merged: bool = False) -> Path:
    if (missing := missing_checkpoint(src)) is not None:
        raise missing
    if not (src / ckpt.META_FILE).is_file():
        final = (src / export.INFO_FILE).is_file()
        what = "a run's final model, already loadable" if final else "not a checkpoint"
        hint = f"; to fold its adapter into the base: hybridtune merge {src} OUT" if final and merged else ""
        raise ModelError(
            f"'{src}' is {what}: give a checkpoint directory (OUTPUT_DIR/checkpoint-N, which holds {ckpt.META_FILE})"
            + hint
        )
    refuse_system_dir(out, "OUT")
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"'{out}' exists and is not a directory; give a directory for the export")
    _check_targets(src, out)  # (the checkpoint itself, then any other checkpoint or a run's final/)
    refuse_run_part(out, "OUT")
    lock = OutputLock(out)  # a run training into OUT (or another export) holds it: refused in one line
    try:
        for sub in (export.FINAL_DIR, export.BASE_DIR, MERGED_DIR):
            guarded.sweep_stale(out, sub)
        if not overwrite and any(p.name != LOCK_FILE for p in out.iterdir()):
            raise OutputDirError(
                f"'{out}' already exists and is not empty; choose another directory or pass --overwrite"
            )
        if not merged and (out / MERGED_DIR).exists():  # it would be left beside a final/ of another step
            raise OutputDirError(
                f"'{out}' holds {MERGED_DIR}/ of an earlier export, which this export without --merged would leave "
                f"beside a final/ of another checkpoint: pass --merged to replace it too, or move it away"
            )
        final = _write(src, out)
        if merged:
            _merged(final, out / MERGED_DIR, overwrite)
    except BaseException:
        lock.release(discard=True)  # a refused or failed export leaves no lock file nor directory it made
        raise
    lock.release()
    return final


def _write(src: Path, out: Path) -> Path:
    opened = open_model(str(src))
    run = opened.run
    meta = json.loads((src / ckpt.META_FILE).read_text(encoding="utf-8"))  # verified by the load above
    record = (
        meta.get("run")
        if isinstance(meta.get("run"), dict)
        else json.loads((src.parent / RUN_FILE).read_text(encoding="utf-8"))
    )
    _refuse_another_run(out, record)
    step = int(opened.step)
    card = model_card(run, opened.loaded, step, src.parent)
    final = export.save_final(
        out, opened.model, opened.model, opened.tokenizer, distributed.ONE, kind=adapter_kind(run),
        loaded=opened.loaded, steps=step, card=card,
    )  # fmt: skip
    atomic_write_text(out / RUN_FILE, json.dumps(record, indent=2))
    logger.info("exported %s (step %d) to %s", src, opened.step, final)
    return final


def _merged(final: Path, target: Path, overwrite: bool) -> None:
    """OUT/merged from the adapter just exported to `final` (run/merge.py, under OUT's lock); for a full fine-tune,
    whose final/ is the whole model already, nothing but a line saying so."""
    if not (final / "adapter_config.json").is_file():
        logger.info("--merged: a full fine-tune's %s is already the whole model; nothing to merge", final)
        return
    merge(final, target, overwrite=overwrite)


def _held_record(out: Path) -> dict | None:
    try:
        held = json.loads(read_regular_text(out / RUN_FILE))
    except (OSError, ValueError, RecursionError):
        return None
    return held if isinstance(held, dict) else None


def _refuse_another_run(out: Path, record: dict) -> None:
    """OUT becomes a finished directory of the checkpoint's run: one that holds another run (its record names another
    config or data, or it has checkpoints without a record) is refused, even with --overwrite, before anything is
    written (replacing its final/ and record would leave its checkpoints under this run's record)."""
    held = _held_record(out)
    changed = record_changes(held, record) if held is not None else []
    steps = [p.name for p in ckpt.list_checkpoints(out)]
    if not changed and (held is not None or not steps):
        return
    what = (f"another run ({'; '.join(changed[:3])})" if changed else f"a run's checkpoints without its {RUN_FILE}") + (
        f" with {', '.join(steps[:3])}" if steps else ""
    )
    raise OutputDirError(
        f"'{out}' holds {what}; an export makes OUT a finished directory of the checkpoint's own run, so it never "
        "replaces another run's final/ and record (not even with --overwrite): give a new or empty OUT"
    )


def _check_targets(src: Path, out: Path) -> None:
    """What the export writes (OUT/final, OUT/base_model, OUT/merged, replaced whole) must not be the user's, and OUT
    must not be inside the checkpoint (its files would be extra files that fail its checksums: a resume skips it)."""
    target, checkpoint = out.resolve(), src.resolve()
    if target == checkpoint or checkpoint in target.parents:
        raise OutputDirError(
            f"'{out}' is inside the checkpoint '{src}', which it would damage; give a directory outside it"
        )
    for sub in (export.FINAL_DIR, export.BASE_DIR, MERGED_DIR):
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
    parser.add_argument(
        "--merged",
        action="store_true",
        help="a LoRA checkpoint: also write OUT/merged, the adapter folded into its base in the base's dtype and "
        "class (for engines that take no adapters)",
    )
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    final = export_checkpoint(args.checkpoint, args.out, args.overwrite, args.merged)
    print(final)
    return 0
