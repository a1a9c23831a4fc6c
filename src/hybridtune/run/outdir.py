"""The output directory's policy: which run a directory holds, when a new run may start in it, and the run file
that says what computed its contents."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import hybridtune
from hybridtune.config import TrainConfig, objective_traits, reward_file, to_dict
from hybridtune.data.digests import data_digest, local_files
from hybridtune.errors import OutputDirError
from hybridtune.files import atomic_write_text, read_regular_text
from hybridtune.run import checkpoint as ckpt
from hybridtune.run import integrity, write_errors
from hybridtune.run.export import BASE_DIR, FINAL_DIR
from hybridtune.run.lock import LOCK_FILE, OutputLock
from hybridtune.run.plots import PLOT_FILES
from hybridtune.run.targets import RUN_FILE, refuse_run_part, refuse_system_dir
from hybridtune.runtime.defaults import KEYS as AUTO_KEYS

logger = logging.getLogger(__name__)

DATA_REPORT = "data_report.jsonl"  # every row the run truncated or dropped (data/report.py's records)
TRACKER_DIR = "runs"  # TensorBoard's event files and W&B's offline runs (trackers.py)
# Keys that may differ between a finished run and the same command run again over it (nothing it computed changes).
RERUN_FREE_KEYS = (
    "overwrite",
    "resume_from_checkpoint",
    "logging_steps",
    "profile_steps",
    "num_threads",
    "output_dir",  # the same directory under another spelling, or the run moved
    "save_total_limit",
    "dataset_num_proc",  # how many processes tokenise: the same examples
    "report_to",  # where the metrics also go, and under which name
    "run_name",
    "cuda_graphs",  # replays of the same compiled kernels: the same computation
    "compile_regions",  # each distinct layer traced once instead of inlined: the same computation
)
# Keys a resumed run may change: how often it logs, evaluates, saves and profiles, and how it spreads over processes.
RESUME_FREE_KEYS = (
    *RERUN_FREE_KEYS,
    "eval_steps",
    "eval_samples",
    "eval_max_new_tokens",
    "save_steps",
    "distributed",
    "fsdp_units",
)


def data_fingerprint(cfg: TrainConfig) -> dict[str, str]:
    """sha256 of the local data each source reads (a file; a directory's or a glob's files, with their names under
    it), its test_datasets too, of a chat_template file and of grpo's reward_funcs files: data (or rewards) edited
    in place is another run's data."""
    out = {}
    for ds in [*cfg.resolved_datasets(), *cfg.test_datasets]:
        files, root = local_files(ds.path)
        if not files:
            continue
        out[ds.path] = data_digest(files, root)  # a single file: its plain sha256, as run files have always had
    template = Path(cfg.chat_template).expanduser() if cfg.chat_template else None
    if template is not None and template.is_file():
        out[cfg.chat_template] = integrity.file_sha256(template)
    for path in reward_files(cfg):
        out[path] = integrity.file_sha256(Path(path).expanduser())
    return out


def reward_files(cfg: TrainConfig) -> list[str]:
    """The objective's own files in the run's identity that exist (grpo's reward_funcs files: its traits'
    `identity_files`), as written (relative to the working directory, as data paths are)."""
    files = objective_traits(cfg.objective).identity_files(cfg)
    return [p for p in dict.fromkeys(files) if p and Path(p).expanduser().is_file()]


def run_record(cfg: TrainConfig) -> dict:
    """What a run computes, as the run file and every checkpoint record it: the config and its data's checksums;
    and the directory it ran in (`cwd`), which the config's relative paths (base_model, data) are relative to."""
    return {"config": to_dict(cfg), "data": data_fingerprint(cfg), "cwd": os.getcwd()}


def record_changes(held: dict, record: dict) -> list[str]:
    """`key: old -> new` for every config key (bar those a rerun may change) and data checksum in which run record
    `held` (an output directory's RUN_FILE) differs from `record` (a checkpoint's `run`); [] for the same run."""
    old, new = held.get("config"), record.get("config")
    if not isinstance(old, dict) or not isinstance(new, dict):
        return ["the record holds no config"]
    diff = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(old.keys() | new.keys())
            if k not in RERUN_FREE_KEYS and old.get(k) != new.get(k)]  # fmt: skip
    data = [d.get("data") if isinstance(d.get("data"), dict) else {} for d in (held, record)]
    if sorted(map(str, data[0].values())) != sorted(map(str, data[1].values())):
        diff.append("its data files' checksums")
    return diff


def _held_run(out: Path) -> dict | None:
    """The run file of `out` ({"config": ..., "data": ...}), or None when there is none or it is unreadable."""
    try:
        held = json.loads(read_regular_text(out / RUN_FILE))
    except (OSError, ValueError, RecursionError):
        return None
    return held if isinstance(held, dict) and isinstance(held.get("config"), dict) else None


def _checkpoint_run(where: str, out: Path) -> dict | None:
    """The run a checkpoint records in its checkpoint.json (JSON: safe to read before it is verified), or None."""
    path = Path(where)
    if where == "latest":
        found = ckpt.list_checkpoints(out)
        if not found:
            return None
        path = found[-1]
    try:
        run = json.loads(read_regular_text(path / ckpt.META_FILE)).get("run")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return run if isinstance(run, dict) and isinstance(run.get("config"), dict) else None


def _without_data_paths(config: dict) -> dict:
    c = dict(config)
    c.pop("dataset", None)
    c["datasets"] = [
        {k: v for k, v in d.items() if k != "path"} for d in c.get("datasets") or [] if isinstance(d, dict)
    ]
    return c


def changes(held: dict, cfg: TrainConfig, free: tuple[str, ...], data: dict[str, str]) -> list[str]:
    """`key: old -> new` for every key (and data file) that differs between a held run and `cfg` (whose data files
    hash to `data`, `data_fingerprint`), bar `free`. Data files count by content: the same files under other paths
    (relative, absolute, moved) are the same data. A key the held run predates counts at its default."""
    now, old = to_dict(cfg), held["config"]
    rewards = reward_files(cfg)
    if "data" in held and not _records_rewards(held):  # recorded before reward files were: not compared on them
        data = {p: h for p, h in data.items() if p not in rewards}
    same_data = "data" in held and bool(data) and sorted(held["data"].values()) == sorted(data.values())
    if same_data:
        now, old = _without_data_paths(now), _without_data_paths(old)
    # A key the held run does not record is newer than that run, which ran as its default does; a key the config
    # no longer has cannot be set, so it is not compared.
    default = to_dict(TrainConfig())
    if same_data:
        default = _without_data_paths(default)
    old = {k: old.get(k, default.get(k)) for k in now}
    # A key now `auto` that the held run recorded as a number (a run from before it had `auto`, or given then and
    # left out now) is the same run: a resume continues with the recorded number (runtime.defaults.recorded_values).
    free = (*free, *(k for k in AUTO_KEYS if now.get(k) == "auto" and old.get(k) != "auto"))
    diff = [f"{k}: {old[k]!r} -> {now[k]!r}" for k in sorted(now) if k not in free and old[k] != now[k]]
    if "data" in held and not same_data:
        changed = [p for p in sorted(data) if held["data"].get(p) != data[p]]
        diff += [
            f"{'reward' if p in rewards else 'data'} file {p} changed since that run"
            for p in changed
            if p not in rewards or p in held["data"]
        ]
    return diff


def _records_rewards(held: dict) -> bool:
    """Whether a held run's data checksums include its reward files (recorded since they are part of a run)."""
    specs = held["config"].get("reward_funcs")
    files = {reward_file(s) for s in specs if isinstance(s, str)} if isinstance(specs, list) else set()
    return isinstance(held["data"], dict) and any(p in held["data"] for p in files if p)


def _foreign(out: Path) -> list[str]:
    """Entries of `out` that no hybridtune run wrote (a run's own: run file, lock, metrics and their curves,
    checkpoints, profiles, final model and base, and the temporary directories of its writes). A link is never a
    run's own."""
    own = {RUN_FILE, LOCK_FILE, "metrics.jsonl", DATA_REPORT, *PLOT_FILES}
    return sorted(
        p.name
        for p in out.iterdir()
        if p.is_symlink()
        or not (
            (p.name in own and p.is_file())
            or ckpt.is_ours(p)
            or (p.name.startswith("profile-") and p.name.endswith(".json") and p.is_file())
            or (p.name == TRACKER_DIR and p.is_dir())
        )
    )


def check_output_dir(cfg: TrainConfig, data: dict[str, str] | None = None, say: bool = True) -> bool:
    """Refuse an output_dir this run must not write into. Returns True when metrics should start fresh.

    - a final/ or base_model/ that hybridtune did not write: refused always (the export would replace it).
    - empty or new: a fresh run.
    - `--resume_from_checkpoint`: the directory must hold this run or be empty; the config (bar the keys a resume
      may change) and the data must be those the run file, or else the checkpoint, records; what changed is
      listed and refused (`--overwrite` accepts it).
    - the same command again over a finished run (every key the same): starts it again; another config, files
      that are not a run's, or a run whose final model differs need `--overwrite`.

    `data`: the run's `data_fingerprint`, when the caller has it (hashed here otherwise, only if needed). `say`:
    log what an accepted change is (False for a check that is repeated).
    """
    out = Path(cfg.output_dir)
    refuse_system_dir(out, "output_dir")
    refuse_run_part(out, "output_dir")
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"output_dir '{out}' is a file; choose a directory")
    empty = not out.exists() or not any(p.name != LOCK_FILE for p in out.iterdir())
    foreign = [] if empty else _foreign(out)
    kept = [n for n in (FINAL_DIR, BASE_DIR) if n in foreign]
    if kept:
        raise OutputDirError(
            f"output_dir '{out}' holds {' and '.join(f'{n}/' for n in kept)} not written by hybridtune, which this "
            "run's export would replace (--overwrite never does): move it away, or choose another --output_dir"
        )
    held = None if empty else _held_run(out)

    def diff(run: dict, free: tuple[str, ...]) -> list[str]:
        nonlocal data
        data = data_fingerprint(cfg) if data is None else data
        return changes(run, cfg, free, data)

    if cfg.resume_from_checkpoint:
        if held is None and foreign:
            raise OutputDirError(
                f"output_dir '{out}' holds files that are not from a hybridtune run ({', '.join(foreign[:5])}); "
                "resume into an empty --output_dir or the run's own"
            )
        held = held or _checkpoint_run(cfg.resume_from_checkpoint, out)
        if held is None and say:
            logger.warning("resume_from_checkpoint: the checkpoint does not record its run's config; not compared")
        changed = diff(held, RESUME_FREE_KEYS) if held is not None else []
        if changed and not cfg.overwrite:
            raise OutputDirError(
                f"resume_from_checkpoint: the config differs from the run it continues ({'; '.join(changed)}); resume "
                "with the run's own config, or pass --overwrite to continue under the new one"
            )
        if changed and say:
            logger.warning("resuming under a changed config (--overwrite): %s", "; ".join(changed))
        return False
    if empty:
        return True
    changed = diff(held, RERUN_FREE_KEYS) if held is not None else []
    if held is not None and not changed:
        if not cfg.overwrite:
            check_restart(out)  # an unfinished run's checkpoints: resume it, or --overwrite
        if say:
            logger.info("output_dir %s holds an earlier run of the same command; starting it again", out)
        return True
    if cfg.overwrite:
        also = f" (its files that are not hybridtune's stay: {', '.join(foreign[:5])})" if foreign else ""
        if say:
            logger.warning(
                "output_dir %s holds another run; --overwrite given, its files will be replaced%s", out, also
            )
        return True
    if held is None:
        what = (
            f"files that are not from a hybridtune run ({', '.join(foreign[:5])})"
            if foreign
            else f"checkpoints without their run's {RUN_FILE}"
        )
    elif _finished(out):
        what = "a finished run of another config (" + "; ".join(changed[:4]) + ")"
    else:
        what = "another hybridtune run (" + "; ".join(changed[:4]) + ")"
    raise OutputDirError(
        f"output_dir '{out}' already holds {what}; choose another --output_dir, resume with "
        f"--resume_from_checkpoint latest, or pass --overwrite"
    )


def _finished(out: Path) -> bool:
    return (out / FINAL_DIR).is_dir()


def _finished_at(output_dir: Path, newest: Path) -> bool:
    """The run that wrote `newest` also wrote its final model: `final/` says it ran to that same step."""
    try:
        return json.loads(read_regular_text(Path(output_dir) / ckpt.FINAL_DIR / ckpt.FINAL_META))[
            "steps"
        ] == ckpt.step_of(newest)
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return False


def check_restart(output_dir: Path) -> None:
    """A fresh run of the same config may start over a finished run, not over an unfinished one's checkpoints.

    Starting again removes them (see `tidy_output_dir`); without --overwrite that is almost always a
    forgotten `--resume_from_checkpoint latest` after a crash or Ctrl-C, so it is refused.
    """
    found = ckpt.list_checkpoints(output_dir)
    if found and not _finished_at(output_dir, found[-1]):
        raise OutputDirError(
            f"output_dir '{output_dir}' holds an unfinished run of this config (newest {found[-1].name}, no final "
            "model after it); continue it with --resume_from_checkpoint latest, or pass --overwrite to start over "
            "(its checkpoints are removed)"
        )


def tidy_output_dir(output_dir: Path, fresh: bool, resume_from: str | None, overwrite: bool) -> str | None:
    """Before training, on rank 0: remove what earlier processes left in `output_dir` that would mislead this run.

    Only directories hybridtune wrote are ever removed (`is_ours`: its marker, or an earlier version's
    checkpoint.json); a `checkpoint-N` that is not hybridtune's is refused, since a save would replace it.
    - Always: temporary directories of writes that never committed (`.tmp-*`: a process or rank died
      mid-save), and `.old-X-*` copies whose replacement `X` was committed. (An `.old-X` without `X`, a crash
      between the two renames of a commit, is the last committed copy of `X`: left alone.) Empty ones too.
    - A fresh run (`fresh`: the caller has allowed it, i.e. an empty directory, a restart of a finished run
      of the same config, or --overwrite): every `checkpoint-N/` of the earlier run. Left there, their higher
      step numbers would make pruning delete this run's new checkpoints first and `latest` resume the old run.
    - A run resumed from step S: checkpoints of `output_dir` past S are another continuation that this run
      would replace; removed under --overwrite, refused otherwise (nothing is touched then).

    Returns the one line that says what was removed, or None when nothing was.
    """
    out = Path(output_dir)
    if not out.is_dir():
        return None
    stale = [p for p in sorted(out.iterdir()) if _is_stale(p)]
    start = None
    if fresh:
        # Links too: never removed, and refused below (a save would not write through them).
        checkpoints = [p for p in out.glob("checkpoint-*") if ckpt.is_step_dir(p) or ckpt.is_step_link(p)]
    else:
        start = _resume_step(resume_from)
        checkpoints = [p for p in ckpt.list_checkpoints(out) if start is not None and ckpt.step_of(p) > start]
    foreign = sorted((p for p in checkpoints if not ckpt.is_ours(p)), key=ckpt.step_of)
    if foreign:
        raise OutputDirError(
            f"output_dir '{out}' holds {', '.join(p.name for p in foreign)}, not written by hybridtune (no {ckpt.MARKER} "
            "marker or checkpoint.json); it is not removed, and a save would replace it: move it away, or choose "
            "another --output_dir"
        )
    if checkpoints and not fresh and not overwrite:
        raise OutputDirError(
            f"resume_from_checkpoint '{resume_from}' is at step {start} but output_dir '{out}' holds later "
            f"checkpoints ({', '.join(p.name for p in sorted(checkpoints, key=ckpt.step_of))}) that this run would replace "
            "and that 'latest' would pick; pass --overwrite to remove them, or resume into another --output_dir"
        )
    checkpoints.sort(key=ckpt.step_of)
    for p in stale + checkpoints:
        shutil.rmtree(p)
    done = []
    if checkpoints:
        why = "of the earlier run" if fresh else f"past the resumed step {start}"
        done.append(f"{len(checkpoints)} checkpoint(s) {why} ({', '.join(p.name for p in checkpoints)})")
    if stale:
        done.append(f"{len(stale)} stale temporary dir(s) ({', '.join(p.name for p in stale)})")
    return f"output_dir {out}: removed " + " and ".join(done) if done else None


def _is_stale(path: Path) -> bool:
    """A temporary or replaced directory of hybridtune's that no commit needs any more (see tidy_output_dir)."""
    if path.is_symlink() or not path.is_dir():
        return False
    if path.name.startswith(ckpt.TMP_PREFIX):
        pass
    elif path.name.startswith(ckpt.OLD_PREFIX):
        committed = path.parent / path.name[len(ckpt.OLD_PREFIX) :].rsplit("-", 1)[0]  # .old-<name>-<pid>
        if not committed.exists():
            return False
    else:
        return False
    return ckpt.is_ours(path) or not any(path.iterdir())


def _resume_step(resume_from: str | None) -> int | None:
    """The step a run resumes from, when that is a complete checkpoint (`latest`: none is past it)."""
    if not resume_from or resume_from == "latest":
        return None
    try:
        return int(json.loads(read_regular_text(Path(resume_from) / ckpt.META_FILE))["step"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None  # not a complete checkpoint: the resume itself says so, after the model is built


def claim_output_dir(cfg: TrainConfig) -> tuple[bool, OutputLock, dict]:
    """`check_output_dir` (nothing written when it refuses), lock the directory, and check again under the lock
    (another run may have started in between). Returns (metrics start fresh, the lock held for the run, the
    `run_record`: its data files are hashed once, here). Nothing is removed here: `tidy` runs once data, model and
    resume have passed their checks."""
    record = run_record(cfg)
    check_output_dir(cfg, record["data"], say=False)  # said once, by the check under the lock
    lock = OutputLock(Path(cfg.output_dir))
    try:
        fresh = check_output_dir(cfg, record["data"])
    except BaseException:
        lock.release(discard=True)
        raise
    return fresh, lock, record


def tidy(cfg: TrainConfig, fresh: bool) -> None:
    """Remove what earlier processes left in the output directory that would mislead this run (rank 0; see
    `tidy_output_dir`), and say so."""
    done = tidy_output_dir(Path(cfg.output_dir), fresh, cfg.resume_from_checkpoint, cfg.overwrite)
    if done:
        logger.info("%s", done)


def write_run_file(out: Path, record: dict) -> None:
    """The run's config, data checksums (`run_record`) and hybridtune version, which a later run in the same
    directory compares itself with."""
    data = {**record, "hybridtune_version": hybridtune.__version__}
    try:
        atomic_write_text(out / RUN_FILE, json.dumps(data, indent=2))
    except OSError as e:  # (EFBIG under ulimit -f, EIO, a full disk: one line, as every guarded write)
        why = write_errors.failure(e) or str(e)
        raise write_errors.WriteError(f"cannot write the run's record {out / RUN_FILE}: {why}", why) from None
