"""What a run finds in its output_dir before training: stale temp dirs of a dead writer are removed; an earlier
run's checkpoints never mislead pruning or `resume latest`, and are never removed without a reason the user gave.

The contract, as `hybridtune train` reads an existing output_dir:
- another run's files: refused unless --overwrite (unchanged; tests/train/test_cli.py);
- an earlier, finished run of the same config: started again; its checkpoints are removed first;
- an earlier, unfinished run of the same config (checkpoints, no final model after them): refused with the
  way to resume it, unless --overwrite (then started again, its checkpoints removed);
- a resume from step S while checkpoints past S exist: refused unless --overwrite (then they are removed);
- at the start of every run, `.tmp-*` dirs (writes that never committed) are removed;
- only what hybridtune wrote (its marker, or an earlier version's checkpoint.json) is ever removed: a
  `checkpoint-N` or `.tmp-*` directory of someone else's is left alone, and refused where a save would replace it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from pathlib import Path

import pytest

from hybridtune import files
from hybridtune.errors import OutputDirError
from hybridtune.run import checkpoint as ckpt
from hybridtune.run import outdir
from hybridtune.run.outdir import claim_output_dir
from train_runs import make_cfg, run


def fake_checkpoint(out: Path, step: int, meta: bool = True) -> Path:
    p = out / f"checkpoint-{step}"
    p.mkdir(parents=True)
    (p / ckpt.MARKER).touch()
    if meta:
        (p / ckpt.META_FILE).write_text(json.dumps({"step": step}))
    return p


def fake_tmp(out: Path, name: str) -> Path:
    p = out / name
    p.mkdir(parents=True)
    (p / ckpt.MARKER).touch()
    return p


def fake_final(out: Path, steps: int) -> None:
    (out / "final").mkdir(parents=True, exist_ok=True)
    (out / "final" / "hybridtune.json").write_text(json.dumps({"steps": steps}))


def names(out: Path) -> list[str]:
    return sorted(os.listdir(out))


def test_fresh_run_removes_the_earlier_runs_checkpoints_and_stale_temp_dirs(tmp_path):
    for step in (2, 10):
        fake_checkpoint(tmp_path, step)
    fake_checkpoint(tmp_path, 7, meta=False)  # hybridtune's, lost its checkpoint.json: also the earlier run's
    fake_tmp(tmp_path, ".tmp-checkpoint-12-abcd1234")  # a rank died mid-save
    (tmp_path / ".tmp-checkpoint-12-abcd1234" / "__1_0.distcp").write_bytes(b"\0" * 10)
    fake_final(tmp_path, 10)
    (tmp_path / ".old-final-4242").mkdir()  # a commit replaced final/ but died before removing the old copy
    fake_tmp(tmp_path, ".old-checkpoint-3-77")  # died between the renames: the only copy, kept
    (tmp_path / "notes.txt").write_text("kept")
    line = outdir.tidy_output_dir(tmp_path, fresh=True, resume_from=None, overwrite=False)
    assert names(tmp_path) == [".old-checkpoint-3-77", "final", "notes.txt"]
    assert line == (
        f"output_dir {tmp_path}: removed 3 checkpoint(s) of the earlier run (checkpoint-2, checkpoint-7, "
        "checkpoint-10) and 2 stale temporary dir(s) (.old-final-4242, .tmp-checkpoint-12-abcd1234)"
    )
    assert outdir.tidy_output_dir(tmp_path, fresh=True, resume_from=None, overwrite=False) is None  # nothing left
    assert outdir.tidy_output_dir(tmp_path / "absent", fresh=True, resume_from=None, overwrite=False) is None


def test_resume_keeps_checkpoints_up_to_its_step_and_refuses_later_ones_without_overwrite(tmp_path):
    for step in (2, 4, 6, 8):
        fake_checkpoint(tmp_path, step)
    fake_tmp(tmp_path, ".tmp-checkpoint-10-x")
    before = names(tmp_path)
    # `latest`: nothing is past it; only the temp dir goes.
    line = outdir.tidy_output_dir(tmp_path, fresh=False, resume_from="latest", overwrite=False)
    assert line == f"output_dir {tmp_path}: removed 1 stale temporary dir(s) (.tmp-checkpoint-10-x)"
    assert names(tmp_path) == before[1:]

    fake_tmp(tmp_path, ".tmp-checkpoint-10-x")
    at4 = str(tmp_path / "checkpoint-4")
    with pytest.raises(OutputDirError, match=r"at step 4 but .* later checkpoints \(checkpoint-6, checkpoint-8\)"):
        outdir.tidy_output_dir(tmp_path, fresh=False, resume_from=at4, overwrite=False)
    assert names(tmp_path) == before  # a refusal touches nothing
    line = outdir.tidy_output_dir(tmp_path, fresh=False, resume_from=at4, overwrite=True)
    assert "removed 2 checkpoint(s) past the resumed step 4 (checkpoint-6, checkpoint-8)" in line
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4"]
    assert names(tmp_path) == ["checkpoint-2", "checkpoint-4"]


def test_restart_is_refused_over_an_unfinished_run_only(tmp_path):
    fake_checkpoint(tmp_path, 4)
    with pytest.raises(OutputDirError, match="unfinished run .*newest checkpoint-4.*--resume_from_checkpoint latest"):
        outdir.check_restart(tmp_path)
    fake_final(tmp_path, 4)
    outdir.check_restart(tmp_path)  # finished at its newest checkpoint: may start again
    fake_checkpoint(tmp_path, 6)  # a later run of the same config got to step 6 and died; final/ is older
    with pytest.raises(OutputDirError, match="newest checkpoint-6"):
        outdir.check_restart(tmp_path)
    outdir.check_restart(tmp_path / "empty")


def test_restart_of_a_finished_run_replaces_its_checkpoints(tmp_path, small_data, caplog):
    """The bug this guards: a restarted run's checkpoint-2 sat below the earlier run's checkpoint-4, so pruning
    kept the earlier run's and `latest` resumed it."""
    out = tmp_path / "run"
    first = run(make_cfg(out, small_data, max_steps=4, save_steps=2, save_total_limit=2))
    assert first.steps == 4 and [p.name for p in ckpt.list_checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    fake_tmp(out, ".tmp-checkpoint-6-dead")  # left by a writer that died

    # Another max_steps over a finished run needs --overwrite (issue 16 item 3); it then starts again.
    with pytest.raises(OutputDirError, match=r"finished run of another config \(max_steps: 4 -> 2\)"):
        claim_output_dir(make_cfg(out, small_data, max_steps=2, save_steps=2, save_total_limit=2))
    caplog.set_level(logging.INFO, logger="hybridtune")
    again = run(make_cfg(out, small_data, max_steps=2, save_steps=2, save_total_limit=2, overwrite=True))
    assert again.steps == 2 and again.losses == pytest.approx(first.losses[:2], rel=1e-6)
    removed = [r.getMessage() for r in caplog.records if "removed" in r.getMessage()]
    assert removed == [
        f"output_dir {out}: removed 2 checkpoint(s) of the earlier run (checkpoint-2, checkpoint-4) and "
        "1 stale temporary dir(s) (.tmp-checkpoint-6-dead)"
    ]
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["checkpoint-2"]
    assert json.loads((out / "checkpoint-2" / ckpt.META_FILE).read_text())["step"] == 2
    assert not list(out.glob(".tmp-*"))

    # Interrupted at step 3: unfinished. The same command again is refused (nothing touched) and says how to
    # continue; --overwrite starts over.
    part = run(make_cfg(out, small_data, max_steps=4, save_steps=2, save_total_limit=2, overwrite=True), stop_after=3)
    assert part.interrupted and [p.name for p in ckpt.list_checkpoints(out)] == ["checkpoint-2", "checkpoint-3"]
    before = names(out)
    with pytest.raises(OutputDirError, match="unfinished run of this config .*--resume_from_checkpoint latest"):
        claim_output_dir(make_cfg(out, small_data, max_steps=4, save_steps=2, save_total_limit=2))[0]
    assert names(out) == before
    cfg = make_cfg(out, small_data, max_steps=4, save_steps=2, save_total_limit=2, overwrite=True)
    fresh, lock, _ = claim_output_dir(cfg)
    assert fresh and ckpt.list_checkpoints(out)  # the claim removes nothing: data, model and resume are unchecked
    outdir.tidy(cfg, fresh)  # what the trainer does once they pass
    lock.release()
    assert ckpt.list_checkpoints(out) == []


def test_tidy_removes_only_what_hybridtune_wrote(tmp_path):
    """The bug this guards: --overwrite removed any `checkpoint-<digits>` or `.tmp-*` directory, marker or not."""
    fake_checkpoint(tmp_path, 2)
    mine = tmp_path / "checkpoint-4"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    (tmp_path / ".tmp-cache").mkdir()
    (tmp_path / ".tmp-cache" / "blob").write_text("kept")
    (tmp_path / ".tmp-empty").mkdir()  # nothing in it to lose
    before = names(tmp_path)
    with pytest.raises(OutputDirError, match=r"holds checkpoint-4, not written by hybridtune .*it is not removed"):
        outdir.tidy_output_dir(tmp_path, fresh=True, resume_from=None, overwrite=True)
    assert names(tmp_path) == before  # a refusal touches nothing
    shutil.move(mine, tmp_path / "thesis")
    line = outdir.tidy_output_dir(tmp_path, fresh=True, resume_from=None, overwrite=True)
    assert (
        line
        == f"output_dir {tmp_path}: removed 1 checkpoint(s) of the earlier run (checkpoint-2) and 1 stale temporary dir(s) (.tmp-empty)"
    )
    assert names(tmp_path) == [".tmp-cache", "thesis"]
    assert (tmp_path / "thesis" / "thesis.tex").read_text() == "years of work"
    # An earlier hybridtune's checkpoint (checkpoint.json with step and data position, no marker) is still its own.
    old = tmp_path / "checkpoint-6"
    old.mkdir()
    (old / ckpt.META_FILE).write_text(json.dumps({"step": 6, "data_position": {}}))
    assert ckpt.is_ours(old) and not ckpt.is_ours(tmp_path / "thesis") and not ckpt.is_ours(tmp_path / ".tmp-cache")


def test_a_link_is_never_ours(tmp_path):
    target = fake_checkpoint(tmp_path / "elsewhere", 2)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "checkpoint-2").symlink_to(target)
    (tmp_path / "out" / ".tmp-x").symlink_to(target)
    assert outdir.tidy_output_dir(tmp_path / "out", fresh=False, resume_from="latest", overwrite=True) is None
    with pytest.raises(OutputDirError, match="holds checkpoint-2, not written by hybridtune"):
        outdir.tidy_output_dir(tmp_path / "out", fresh=True, resume_from=None, overwrite=True)
    assert (target / ckpt.META_FILE).is_file()


def test_atomic_write_text_never_follows_a_planted_link(tmp_path):
    """The bug this guards: the fixed temp name `.<name>.tmp` was opened for writing, so a link planted there
    overwrote its target."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".hybridtune_run.json.tmp").symlink_to(victim)  # the old fixed temp name
    files.atomic_write_text(out / "hybridtune_run.json", "{}")
    assert victim.read_text() == "precious" and (out / "hybridtune_run.json").read_text() == "{}"
    (out / "link.json").symlink_to(victim)  # a link at the name itself is replaced, not written through
    files.atomic_write_text(out / "link.json", "new")
    assert victim.read_text() == "precious" and not (out / "link.json").is_symlink()
    assert sorted(os.listdir(out)) == [".hybridtune_run.json.tmp", "hybridtune_run.json", "link.json"]


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_written_files_and_dirs_follow_the_umask(tmp_path, mask):
    """The bug this guards: exports and checkpoints were 0700 (tempfile's mode) whatever the umask, so a serving
    account could not read them."""
    old = os.umask(mask)
    try:
        ckpt.atomic_dir(tmp_path / "final", lambda d: (d / "model.safetensors").write_bytes(b"x"))
        files.atomic_write_text(tmp_path / "run.json", "{}")
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(tmp_path / "final") == 0o777 & ~mask
    assert mode(tmp_path / "final" / "model.safetensors") == 0o666 & ~mask
    assert mode(tmp_path / "run.json") == 0o666 & ~mask
    assert ckpt.is_ours(tmp_path / "final")  # carries the marker
