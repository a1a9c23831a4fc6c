"""`export` and `merge` take `train`'s output-directory rules (red team 2, defects 12 and 13): a filesystem root or the
home directory is refused even with --overwrite (`export CKPT / --overwrite` wrote /final, /hybridtune_run.json and
/.hybridtune.lock), and `export --overwrite` into another run's directory is refused rather than replacing that run's
final/ and record (its checkpoints were left under another run's record)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hybridtune.cli import main
from hybridtune.errors import OutputDirError
from hybridtune.run import checkpoint as ckpt
from hybridtune.run.outdir import RUN_FILE
from hybridtune.run.targets import refuse_system_dir

TRAIN = ["train", "--sequence_len", "128", "--eval_steps", "0", "--val_set_size", "0", "--max_steps", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data) -> tuple[Path, Path]:
    """Two finished full fine-tunes of the default preset that differ in their learning rate, each with checkpoint-2."""
    root = tmp_path_factory.mktemp("export-outdir")
    for name, lr in (("a", "1e-3"), ("b", "3e-4")):
        argv = [*TRAIN, "--dataset", small_data, "--save_steps", "1", "--learning_rate", lr]
        assert main([*argv, "--output_dir", str(root / name)]) == 0
    return root / "a", root / "b"


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_export_overwrite_into_another_finished_run_is_refused(runs, tmp_path, error_line):
    """The red team's `export r2/checkpoint-2 runs/k9 --overwrite`: k9's final/ became r2's step 2, its record r2's."""
    a, b = runs
    other = tmp_path / "other"
    shutil.copytree(b, other)
    before = snapshot(other)
    line = error_line(["export", str(a / "checkpoint-2"), str(other), "--overwrite"])
    assert line.startswith(f"error: '{other}' holds another run (learning_rate: 0.0003 -> 0.001)"), line
    assert "with checkpoint-1, checkpoint-2" in line and "not even with --overwrite" in line, line
    assert snapshot(other) == before  # its final/, record and lock file as they were


def test_checkpoints_without_their_record_are_another_run(runs, tmp_path, error_line):
    a, b = runs
    other = tmp_path / "other"
    shutil.copytree(b, other)
    (other / RUN_FILE).unlink()
    shutil.rmtree(other / "final")
    before = snapshot(other)
    line = error_line(["export", str(a / "checkpoint-2"), str(other), "--overwrite"])
    assert f"holds a run's checkpoints without its {RUN_FILE} with checkpoint-1, checkpoint-2" in line, line
    assert snapshot(other) == before


def test_export_overwrite_of_the_same_run_still_replaces_it(runs, tmp_path):
    """The same run's export (or its own directory) is what --overwrite is for: step 1 replaced by step 2."""
    a, _ = runs
    out = tmp_path / "export"
    assert main(["export", str(a / "checkpoint-1"), str(out)]) == 0
    assert main(["export", str(a / "checkpoint-2"), str(out), "--overwrite"]) == 0
    assert ckpt._json(out / "final" / ckpt.FINAL_META)["steps"] == 2
    own = tmp_path / "own"
    shutil.copytree(a, own)
    assert main(["export", str(own / "checkpoint-1"), str(own), "--overwrite"]) == 0
    assert ckpt._json(own / "final" / ckpt.FINAL_META)["steps"] == 1


@pytest.mark.parametrize("command", ["export", "merge", "train"])
def test_the_home_directory_is_refused_even_with_overwrite(runs, tmp_path, monkeypatch, error_line, command):
    a, _ = runs
    home = tmp_path / "home"
    (home / "notes").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    adapter = tmp_path / "adapter"  # (OUT_DIR is checked before the adapter is read)
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    argv = {
        "export": ["export", str(a / "checkpoint-2"), "~", "--overwrite"],
        "merge": ["merge", str(adapter), str(home), "--overwrite"],
        "train": [*TRAIN, "--output_dir", str(home), "--overwrite"],
    }[command]
    line = error_line(argv)
    assert "is your home directory" in line and "refused even with --overwrite" in line, line
    assert sorted(p.name for p in home.iterdir()) == ["notes"]


@pytest.mark.parametrize("where", ["/", "//", "/.", "~"])
def test_a_filesystem_root_or_home_is_never_an_output_directory(where, tmp_path, monkeypatch):
    """Checked on the path alone (a CLI run that got this wrong would write into `/`)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(OutputDirError, match="refused even with --overwrite"):
        refuse_system_dir(Path(where), "OUT")
    refuse_system_dir(tmp_path / "runs" / "x", "OUT")  # a directory of its own: no error
