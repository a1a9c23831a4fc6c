"""models.source: what an export carries from the source checkpoint's files."""

from __future__ import annotations

import os

import torch

from checkpoints import hub_cache, make_checkpoint
from hybridtune.models.source import carry_files


def test_carried_files_follow_links_only_inside_the_source(tmp_path):
    """A model directory someone handed over with `LICENSE -> a secret of this machine` had the secret copied into
    the export (which is then shared); a hub snapshot's links into its blobs/ are still followed."""
    ckpt = make_checkpoint(tmp_path, "qwen3_5_vl")
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    os.symlink(secret, ckpt / "LICENSE")
    out = tmp_path / "out"
    out.mkdir()
    copied = carry_files(out, ckpt)
    assert "LICENSE" not in copied and not (out / "LICENSE").exists()
    assert "preprocessor_config.json" in copied
    (ckpt / "LICENSE").unlink()
    (ckpt / "LICENSE").write_text("Apache-2.0")
    home = hub_cache(tmp_path, "org/model", ckpt)
    snapshot = next((home / "hub" / "models--org--model" / "snapshots").iterdir())
    out2 = tmp_path / "out2"
    out2.mkdir()
    assert {"LICENSE", "preprocessor_config.json"} <= set(carry_files(out2, snapshot))
    assert (out2 / "LICENSE").read_text() == "Apache-2.0"


def test_a_patched_model_is_saved_with_its_own_config(tmp_path):
    """patch_model turns config.use_cache off for training; every full fine-tune's final/config.json said
    use_cache: false where the source said true."""
    import json

    from hybridtune.models.loading import load_model
    from hybridtune.models.patching import patch_model
    from hybridtune.models.source import save_like_source

    ckpt = make_checkpoint(tmp_path, "qwen3_5_vl")
    model = load_model(str(ckpt)).model
    patch_model(model)
    assert model.config.text_config.use_cache is False
    save_like_source(model, tmp_path / "out", model.state_dict(), ckpt, torch.float32)
    saved, source = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "out", ckpt))
    assert saved["text_config"]["use_cache"] == source["text_config"]["use_cache"] is True
    assert model.config.text_config.use_cache is False  # still patched for what follows
