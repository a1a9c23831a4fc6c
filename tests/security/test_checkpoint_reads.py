"""A checkpoint reads only its own files: the paths its checkpoint.json records (chat template, tokenizer) and the
storage paths its DCP metadata names never make a load or an export read anything else."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil

import pytest
import torch

from hybridtune.cli import main
from hybridtune.errors import UserError
from hybridtune.run import checkpoint as ckpt
from hybridtune.run import integrity


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished two-step run of the default preset with checkpoint-2 (which holds its own tokenizer)."""
    out = tmp_path_factory.mktemp("ckpt-reads") / "run"
    argv = ["train", "--max_steps", "2", "--save_steps", "2", "--sequence_len", "128", "--eval_steps", "0"]
    assert main([*argv, "--output_dir", str(out)]) == 0
    return out


@pytest.fixture
def run_copy(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, symlinks=True)
    return copy


def _edit_meta(path, change):
    meta = json.loads((path / ckpt.META_FILE).read_text())
    change(meta)
    (path / ckpt.META_FILE).write_text(json.dumps(meta))


def _relist(path, rel):
    """Rewrite one file's checksum in checkpoint.json to match it as it is now (what an attacker would do)."""
    data = (path / rel).read_bytes()
    _edit_meta(
        path, lambda m: m["files"].__setitem__(rel, {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    )


def test_a_checkpoint_carries_its_tokenizer(run_dir):
    own = ckpt.own_tokenizer(run_dir / "checkpoint-2")
    assert own is not None and (own / "tokenizer_config.json").is_file()
    assert ckpt.verify_checkpoint(run_dir / "checkpoint-2") is None  # listed with its checksums


def test_a_recorded_chat_template_path_is_never_read(run_copy, tmp_path, capsys):
    secret = tmp_path / "creds"
    secret.write_text("AWS_SECRET=abc")
    c2 = run_copy / "checkpoint-2"
    _edit_meta(c2, lambda m: m["run"]["config"].__setitem__("chat_template", str(secret)))
    out = tmp_path / "export"
    assert main(["export", str(c2), str(out)]) == 0  # the checkpoint's own template: the record is not read
    written = "".join(
        p.read_text(errors="replace") for p in out.rglob("*") if p.is_file() and p.suffix != ".safetensors"
    )
    assert "AWS_SECRET" not in written


def test_an_old_checkpoint_naming_a_template_file_is_refused(run_copy, tmp_path, capsys):
    secret = tmp_path / "creds.jinja"
    secret.write_text("AWS_SECRET=abc")
    c2 = run_copy / "checkpoint-2"
    shutil.rmtree(c2 / ckpt.TOKENIZER_DIR)  # as a checkpoint written before they carried their tokenizer

    def forget_tokenizer(meta):
        for rel in [k for k in meta["files"] if k.startswith("tokenizer/")]:
            del meta["files"][rel]

    _edit_meta(c2, forget_tokenizer)
    _edit_meta(c2, lambda m: m["run"]["config"].__setitem__("chat_template", str(secret)))
    out = tmp_path / "export"
    assert main(["export", str(c2), str(out)]) == 2
    err = capsys.readouterr().err
    assert "does not read from a record" in err and "Traceback" not in err
    assert not out.exists()


def _point_storage_at(c2, target: str):
    md = integrity.read_dcp_metadata((c2 / "state" / ".metadata").read_bytes())
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    key = next(iter(md.storage_data))
    old = md.storage_data[key]
    md.storage_data[key] = _StorageInfo(target, old.offset, old.length, None)
    md.storage_meta = None
    (c2 / "state" / ".metadata").write_bytes(pickle.dumps(md))
    _relist(c2, "state/.metadata")


@pytest.mark.parametrize("how", ["absolute", "dotdot", "unlisted"])
def test_dcp_metadata_cannot_read_outside_the_checkpoint(run_copy, tmp_path, how, capsys):
    victim = tmp_path / "victim.pt"
    torch.save(torch.full((4, 4), 1234.5), victim)
    c2 = run_copy / "checkpoint-2"
    if how == "unlisted":
        shutil.copy(victim, c2 / "state" / "extra.distcp")  # inside state/, but not among the checkpoint's files
        _relist(c2, "state/extra.distcp")
        _edit_meta(c2, lambda m: m["files"].pop("state/extra.distcp"))
        (c2 / "state" / "extra.distcp").unlink()
    target = {"absolute": str(victim), "dotdot": "../../victim.pt", "unlisted": "extra.distcp"}[how]
    _point_storage_at(c2, target)
    assert ckpt.verify_checkpoint(c2) is not None
    out = tmp_path / "export"
    assert main(["export", str(c2), str(out)]) == 2
    err = capsys.readouterr().err
    assert "reads only its own files" in err and "Traceback" not in err
    assert not out.exists()


def test_the_reader_refuses_a_fifo_or_a_link_in_state(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    os.mkfifo(state / "pipe.distcp")
    (state / "link.distcp").symlink_to(tmp_path / "elsewhere")
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    def allowed(name):
        return (state / name).is_file() and not (state / name).is_symlink()

    for name in ("pipe.distcp", "link.distcp"):
        md = Metadata(state_dict_metadata={}, storage_data={"k": _StorageInfo(name, 0, 1, None)})
        with pytest.raises(UserError, match="reads only its own files"):
            integrity.confine_storage(md, allowed)
