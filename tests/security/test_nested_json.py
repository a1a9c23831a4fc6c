"""A run's JSON files nested past Python's recursion limit are one line, exit 2, never a RecursionError traceback
(red team 2, defect 11: a `checkpoint.json` nested 100,000 levels deep, given to `export`)."""

from __future__ import annotations

import pytest
from resumes import lora_run

from hybridtune.run import checkpoint as ckpt
from hybridtune.run.outdir import RUN_FILE


def nested(depth: int) -> str:
    """A JSON object whose one value is `depth` nested arrays (depth well past the recursion limit)."""
    return '{"a": ' + "[" * depth + "]" * depth + "}"


@pytest.mark.parametrize("depth", [100_000, 3_000])
def test_a_deeply_nested_checkpoint_json_is_one_line(lora_run_copy, tmp_path, error_line, small_data, depth):
    (lora_run_copy / "checkpoint-2" / ckpt.META_FILE).write_text(nested(depth))
    said = "checkpoint.json is not the JSON a save writes (nested too deeply to read)"
    line = error_line(["export", str(lora_run_copy / "checkpoint-2"), str(tmp_path / "out")])
    assert line == f"error: checkpoint '{lora_run_copy / 'checkpoint-2'}' cannot be loaded: {said}", line
    assert not (tmp_path / "out").exists()
    line = error_line(["eval", "--model", str(lora_run_copy / "checkpoint-2"), "--dataset", small_data])
    assert said in line, line
    resume = lora_run(small_data, lora_run_copy)
    line = error_line([*resume, "--resume_from_checkpoint", "latest"])
    assert f"checkpoint-2: {said}" in line, line


def test_a_deeply_nested_run_record_in_out_is_one_line(lora_run_dir, lora_run_copy, error_line):
    """export --overwrite into a directory whose record cannot be read: its checkpoints are another run's."""
    (lora_run_copy / RUN_FILE).write_text(nested(100_000))
    line = error_line(["export", str(lora_run_dir / "checkpoint-2"), str(lora_run_copy), "--overwrite"])
    assert f"holds a run's checkpoints without its {RUN_FILE} with checkpoint-2" in line, line


@pytest.mark.parametrize("name", ["adapter_config.json", ckpt.FINAL_META])
def test_a_deeply_nested_adapter_file_is_one_line_for_merge(lora_run_copy, tmp_path, error_line, name):
    (lora_run_copy / "final" / name).write_text(nested(100_000))
    line = error_line(["merge", str(lora_run_copy / "final"), str(tmp_path / "merged")])
    assert str(lora_run_copy / "final" / name) in line and "restore" in line, line
    assert not (tmp_path / "merged").exists()
