"""A run interrupted in its first step (a second Ctrl-C: the step is abandoned, checkpoint-0 saved) resumes as the run
that was never interrupted. torch's get_state_dict had made the optimizer's state for checkpoint-0 by a step at lr 0
(every `step` 1): the resumed optimizer's count ran one ahead of the trainer's (Adam's bias correction with it), and the
resumed run's checkpoint-1 was refused: "'step' is 2 but the checkpoint is at step 1"."""

from __future__ import annotations

import pytest
import torch

from hybridtune.run import checkpoint as ckpt
from hybridtune.runtime import health
from hybridtune.train.trainer import Trainer
from train_runs import make_cfg


def trained(cfg, monkeypatch=None):
    """(the trainer after its run of `cfg`, its result); with `monkeypatch`, Ctrl-C in the first step."""
    t = Trainer(cfg)
    t.setup()
    if monkeypatch is not None:

        def interrupted(*args, **kwargs):  # after the first step's backward, before its update
            raise KeyboardInterrupt

        monkeypatch.setattr(health, "check_step", interrupted)
    try:
        return t, t.train()
    finally:
        monkeypatch.undo() if monkeypatch is not None else None


@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_a_run_interrupted_in_its_first_step_resumes_as_never_interrupted(tmp_path, small_data, monkeypatch, adapter):
    # (No dropout: the abandoned step drew its masks from the RNG the checkpoint then saved, so with dropout the
    # resumed step 1 draws others than the uninterrupted run's; the optimizer's state is what this test is about.)
    keys = dict(adapter=adapter, max_steps=2, save_steps=1, lora_dropout=0.0)
    torch.use_deterministic_algorithms(True)
    try:
        full, done = trained(make_cfg(tmp_path / "a", small_data, **keys))
        _, part = trained(make_cfg(tmp_path / "b", small_data, **keys), monkeypatch)
        assert part.interrupted and part.steps == 0 and part.losses == []
        assert [p.name for p in ckpt.list_checkpoints(tmp_path / "b")] == ["checkpoint-0"]
        rest, resumed = trained(make_cfg(tmp_path / "b", small_data, **keys, resume_from_checkpoint="latest"))
        # The resumed run's own checkpoint-1 resumes too (was refused), into another output_dir: its last step is the
        # uninterrupted run's.
        again = make_cfg(tmp_path / "c", small_data, **keys, resume_from_checkpoint=str(tmp_path / "b/checkpoint-1"))
        last, tail = trained(again)
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(done.losses) == 2 and len(resumed.losses) == 2 and len(tail.losses) == 1
    assert max(abs(a - b) for a, b in zip(done.losses, resumed.losses)) < 1e-6, (done.losses, resumed.losses)
    assert abs(done.losses[1] - tail.losses[0]) < 1e-6, (done.losses, tail.losses)
    for t in (rest, last):
        for (name, want), got in zip(full.model.named_parameters(), t.model.parameters()):
            assert torch.allclose(want, got, rtol=0, atol=1e-6), name
        assert {float(s["step"]) for s in t.optimizer.state.values()} == {2.0}
