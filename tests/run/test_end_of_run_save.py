"""Nothing trained is lost at the end of a run: when the last step's checkpoint (weights, fp32 masters and AdamW
state) does not fit on the disk but the final model does, final/ is written and the run says so."""

from __future__ import annotations

import shutil

from hybridtune.cli import main
from hybridtune.run import disk


def test_final_model_is_kept_when_the_last_checkpoint_does_not_fit(tmp_path, monkeypatch, capfd):
    out = tmp_path / "run"
    params = 869_560  # tiny-qwen3_5: a full fine-tune's checkpoint is about 3 x 4 bytes each, its final/ 4 bytes each
    real = shutil.disk_usage
    free = 8 * params  # room for final/ (about 3.5 MB), not for the checkpoint (about 10.7 MB)
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda p: real(p)._replace(free=free))
    argv = ["train", "--max_steps", "2", "--sequence_len", "128", "--eval_steps", "0", "--output_dir", str(out)]
    assert main(argv) == 0
    assert (out / "final" / "config.json").is_file()
    assert any(p.suffix == ".safetensors" for p in (out / "final").iterdir())
    assert not list(out.glob("checkpoint-*")), "the checkpoint that did not fit left nothing behind"
    said = capfd.readouterr().err
    assert "disk full: saving checkpoint-2" in said and "writing final/ (the trained model) anyway" in said
