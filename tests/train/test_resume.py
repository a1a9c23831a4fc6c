"""Resume continues the exact loss curve; Ctrl-C saves a checkpoint; checkpoints are atomic."""

from __future__ import annotations

import os

import pytest
import torch

from hybridtune.run import checkpoint as ckpt
from train_runs import make_cfg, run


@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_resume_equals_uninterrupted(tmp_path, small_data, adapter):
    torch.use_deterministic_algorithms(True)
    try:
        full = run(make_cfg(tmp_path / "a", small_data, adapter=adapter))
        # Ctrl-C after step 3: a checkpoint is saved and the run reports the interruption.
        part = run(make_cfg(tmp_path / "b", small_data, adapter=adapter), stop_after=3)
        assert part.interrupted and part.steps == 3
        assert [p.name for p in ckpt.list_checkpoints(tmp_path / "b")] == ["checkpoint-3"]
        rest = run(make_cfg(tmp_path / "b", small_data, adapter=adapter, resume_from_checkpoint="latest"))
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(full.losses) == 8 and len(rest.losses) == 5
    resumed = part.losses + rest.losses
    assert max(abs(a - b) for a, b in zip(full.losses, resumed)) < 1e-6, (full.losses, resumed)


def test_atomic_dir_keeps_old_on_failure(tmp_path):
    target = tmp_path / "checkpoint-1"
    ckpt.atomic_dir(target, lambda d: (d / "a.txt").write_text("old"))

    def boom(d):
        (d / "a.txt").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        ckpt.atomic_dir(target, boom)
    assert (target / "a.txt").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1"]  # no temp dir left behind


def test_incomplete_checkpoint_is_ignored(tmp_path):
    (tmp_path / "checkpoint-5").mkdir()  # no checkpoint.json: never completed
    (tmp_path / ".tmp-checkpoint-6-x").mkdir()
    ckpt.atomic_dir(tmp_path / "checkpoint-2", lambda d: (d / ckpt.META_FILE).write_text("{}"))
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-2"]


@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_a_lora_checkpoint_of_another_preset_draw_is_refused(tmp_path, small_data, adapter):
    """A checkpoint records which draw of a preset's random weights it trained on. LoRA from an earlier draw
    (written before the record existed: no `preset_draw`) is refused with one line, as its adapter would continue on
    other base weights; a full fine-tune's checkpoint holds every weight and resumes."""
    import json

    from hybridtune.models.presets import PRESET_DRAW
    from hybridtune.run.checkpoint import CheckpointError

    out = tmp_path / "run"
    run(make_cfg(out, small_data, adapter=adapter, max_steps=2, save_steps=2))
    meta_file = out / "checkpoint-2" / "checkpoint.json"
    meta = json.loads(meta_file.read_text())
    assert meta["preset_draw"] == PRESET_DRAW
    del meta["preset_draw"]  # as an earlier hybridtune wrote it
    meta_file.write_text(json.dumps(meta))
    resume = make_cfg(out, small_data, adapter=adapter, max_steps=4, save_steps=2, resume_from_checkpoint="latest",
                      overwrite=True)  # fmt: skip
    if adapter == "lora":
        with pytest.raises(CheckpointError, match=r"as drawn by an earlier hybridtune \(draw 1; this one makes draw"):
            run(resume)
        from hybridtune.infer.load import open_model

        with pytest.raises(CheckpointError, match="as drawn by an earlier hybridtune"):  # generate, eval, export
            open_model(str(out / "checkpoint-2"))
    else:
        assert run(resume).losses
