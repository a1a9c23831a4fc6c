"""Trackers (`report_to`): the records of metrics.jsonl also go to TensorBoard or Weights & Biases, from rank 0.

Each record becomes scalars named `<type>/<key>` (`train/loss`, `train/lr`, `eval/eval_loss`, ...) at its optimizer
step, and an eval's `samples` a text table; the `MetricsLog` that writes metrics.jsonl hands every record over and
closes the tracker with itself.

- tensorboard: event files in `output_dir/runs/<run_name>/`; a fresh run replaces earlier ones, a resumed run purges
  the steps logged past its checkpoint (`purge_step`).
- wandb: a run of the `WANDB_PROJECT` project (default "hybridtune") named `run_name`, files under `output_dir/runs/`;
  a resumed run continues the same W&B run (its id in `runs/<run_name>.wandb-id`); `WANDB_MODE=offline` stays local.

Both packages are optional (`pip install 'hybridtune[tensorboard]'`, `'hybridtune[wandb]'`), imported when asked for.
Nothing is written or removed outside `output_dir/runs/`: `run_name` is a plain name, `runs/` and `runs/<run_name>`
are never links, and a fresh run removes event files only from a directory hybridtune made (its marker).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import secrets
from pathlib import Path

from hybridtune.config import TrainConfig, to_dict
from hybridtune.errors import ConfigError, OutputDirError
from hybridtune.files import atomic_write_text, create_new, open_regular
from hybridtune.run.checkpoint import MARKER
from hybridtune.run.outdir import TRACKER_DIR
from hybridtune.runtime.metrics import MetricsLog

logger = logging.getLogger(__name__)

NOT_SCALARS = ("step", "type", "total_steps")


def scalars(record: dict) -> dict[str, float]:
    """The record's numbers under `<type>/<key>`.

    >>> scalars({"type": "train", "step": 3, "loss": 1.5, "lr": 1e-3, "samples": []})
    {'train/loss': 1.5, 'train/lr': 0.001}
    """
    kind = record.get("type", "train")
    return {
        f"{kind}/{k}": float(v)
        for k, v in record.items()
        if k not in NOT_SCALARS and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def samples_markdown(samples: list[dict]) -> str:
    """An eval's generations as a markdown table (TensorBoard renders text as markdown)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "<br>")

    rows = ["| prompt | generated | reference |", "| --- | --- | --- |"]
    rows += [f"| {cell(s['prompt'])} | {cell(s['generated'])} | {cell(s['reference'])} |" for s in samples]
    return "\n".join(rows)


def _missing(name: str) -> ConfigError:
    return ConfigError(
        f"config key 'report_to' = '{name}' needs the {name} package, which is not installed; "
        f"pip install 'hybridtune[{name}]'"
    )


def _import_failed(name: str, e: Exception) -> ConfigError:
    """One line for a tracker whose package is there but raises while importing (a broken install: a mismatched
    protobuf, a half-upgraded dependency); an ImportError with nothing of the package found is `_missing`."""
    try:
        absent = importlib.util.find_spec(name) is None
    except (ImportError, ValueError):  # a half-imported module left in sys.modules: it is there, and broken
        absent = False
    if isinstance(e, ImportError) and absent:
        return _missing(name)
    text = str(e).strip()
    first = text.splitlines()[0][:300] if text else ""
    return ConfigError(
        f"config key 'report_to' = '{name}': importing the {name} package failed with {type(e).__name__}"
        f"{': ' + first if first else ''} (a broken install); repair it (pip install --force-reinstall {name}) "
        "or drop it from report_to (report_to: none)"
    )


class TensorBoard:
    def __init__(self, logdir: Path, fresh: bool, resumed_step: int) -> None:
        try:  # optional dependency: imported only when report_to asks for it
            from torch.utils.tensorboard import SummaryWriter
        except Exception as e:  # a broken install raises anything at import: one line, exit 2, before training
            raise _import_failed("tensorboard", e) from None
        if fresh:
            _remove_own_events(logdir)
        _own_dir(logdir)
        purge = None if fresh else resumed_step + 1
        self.writer = SummaryWriter(log_dir=str(logdir), purge_step=purge)

    def log(self, record: dict) -> None:
        step = record["step"]
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, step)
        if record.get("samples"):
            self.writer.add_text(f"{record.get('type', 'eval')}/samples", samples_markdown(record["samples"]), step)
        self.writer.flush()  # a record is on disk once logged, as in metrics.jsonl

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, root: Path, name: str, fresh: bool, config: dict) -> None:
        try:  # optional dependency: imported only when report_to asks for it
            import wandb
        except Exception as e:  # a broken install raises anything at import: one line, exit 2, before training
            raise _import_failed("wandb", e) from None
        self.wandb = wandb
        id_file = root / f"{name}.wandb-id"
        run_id = (_read_id(id_file) if not fresh else None) or secrets.token_hex(4)
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "hybridtune"),
                name=name,
                id=run_id,
                resume="allow",
                dir=str(root),
                config=config,
            )
        except Exception as e:  # wandb's own kinds (no login, no network): say it in one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"report_to: wandb could not start a run ({first}); run `wandb login`, or set WANDB_MODE=offline "
                "to log locally"
            ) from None
        atomic_write_text(id_file, run_id + "\n")  # replaces a link planted at the name, never writes through it

    def log(self, record: dict) -> None:
        data: dict = scalars(record)
        if record.get("samples"):
            rows = [[s["prompt"], s["generated"], s["reference"]] for s in record["samples"]]
            data[f"{record.get('type', 'eval')}/samples"] = self.wandb.Table(
                columns=["prompt", "generated", "reference"], data=rows
            )
        self.run.log(data, step=record["step"])

    def close(self) -> None:
        self.run.finish()


def run_name(cfg: TrainConfig) -> str:
    """`run_name`, or the output directory's name; a name that is not a plain file name is refused (ConfigError),
    since the tracker's files would land outside `output_dir/runs/`."""
    if cfg.run_name is None:
        return Path(cfg.output_dir).resolve().name or "run"
    name = str(cfg.run_name)
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ConfigError(
            f"config key 'run_name' = {name!r} is not a plain name (it holds a path separator or is '.' or '..'); the "
            f"tracker writes into output_dir/{TRACKER_DIR}/<run_name>, so give a name such as 'lr-1e-4'"
        )
    return name


def _no_link(path: Path) -> None:
    if path.is_symlink():
        raise OutputDirError(
            f"'{path}' is a symbolic link; the tracker writes only into a directory of the run's own (a link could "
            "send its files, and the removal of old ones, elsewhere): remove the link"
        )


def _own_dir(path: Path) -> None:
    """Create `path` (a directory) with hybridtune's marker, or leave an existing one as it is."""
    _no_link(path)
    if not path.exists():
        path.mkdir()
        os.close(create_new(path / MARKER))


def _remove_own_events(logdir: Path) -> None:
    """A fresh run's TensorBoard directory starts empty of event files, but only when hybridtune made it: another
    tool's event files (a directory without the marker) are left, and said so."""
    if not logdir.is_dir():
        return
    events = [p for p in logdir.glob("events.out.tfevents.*") if p.is_file() and not p.is_symlink()]
    if not (logdir / MARKER).is_file() or (logdir / MARKER).is_symlink():
        if events:
            logger.warning(
                "%s holds %d event file(s) that hybridtune did not write (no %s marker); they are kept", logdir,
                len(events), MARKER,
            )  # fmt: skip
        return
    for p in events:
        p.unlink()


def _read_id(path: Path) -> str | None:
    """A W&B run id written by an earlier run (never read through a link), or None."""
    try:
        with open_regular(path) as f:
            text = f.read(200).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.isalnum() else None


def open_tracker(cfg: TrainConfig, out: Path, fresh: bool, step: int) -> TensorBoard | WandB | None:
    """The tracker `report_to` names (None for `none`); `fresh`: a new run's log, else resumed at `step`."""
    if cfg.report_to == "none":
        return None
    name = run_name(cfg)
    root = out / TRACKER_DIR
    _own_dir(root)
    if cfg.report_to == "tensorboard":
        logdir = root / name
        _no_link(logdir)
        return TensorBoard(logdir, fresh, step)
    return WandB(root, name, fresh, to_dict(cfg))


def open_metrics(cfg: TrainConfig, out: Path, fresh: bool, step: int) -> MetricsLog:
    """metrics.jsonl (a fresh one, or a resumed run's without the rows logged past `step`) and the tracker."""
    tracker = open_tracker(cfg, out, fresh, step)
    try:
        return MetricsLog(out / "metrics.jsonl", fresh, None if fresh else step, tracker)
    except BaseException:
        if tracker is not None:
            tracker.close()
        raise
