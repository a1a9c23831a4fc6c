"""A checkpoint is verified before anything of it is read; a corrupt one is one clear error naming the file, and
`latest` falls back to the newest intact one; nothing in a checkpoint can run code when it is resumed; a save
that cannot fit says so in one line and leaves the previous checkpoint intact.

These use a small module, optimizer and scheduler (save_checkpoint and load_checkpoint take any): the trainer's
own resume is tested in test_resume.py.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from hybridtune.run import checkpoint as ckpt
from hybridtune.run import disk, integrity, write_errors
from hybridtune.run.resume import find_resume, load_checkpoint


def parts(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    return model, opt, sched


def step(model, opt, sched) -> None:
    model(torch.randn(8, 32)).pow(2).mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def run(tmp_path):
    """checkpoint-2 and checkpoint-4 of one short run; returns (output_dir, {step: weights at that step})."""
    model, opt, sched = parts()
    saved = {}
    for n in range(1, 5):
        step(model, opt, sched)
        if n % 2 == 0:
            ckpt.save_checkpoint(tmp_path / f"checkpoint-{n}", model, opt, sched, n, {"epoch": 0, "index": n})
            saved[n] = weights(model)
    return tmp_path, saved


def load(path: Path, **kw) -> tuple[dict, nn.Module]:
    model, opt, sched = parts(seed=1)
    state = load_checkpoint(path, model, opt, sched, **kw)
    return state, model


def forge(path: Path) -> None:
    """Rewrite checkpoint.json's checksums to match the files as they are now (what an attacker would do)."""
    meta = json.loads((path / ckpt.META_FILE).read_text())
    files, _ = integrity._walk(path)
    meta["files"] = integrity.hash_files(path, [f for f in files if f != ckpt.META_FILE])
    (path / ckpt.META_FILE).write_text(json.dumps(meta))


def test_save_lists_every_file_with_its_checksum_and_loads_plain_values_only(run):
    out, saved = run
    meta = json.loads((out / "checkpoint-4" / ckpt.META_FILE).read_text())
    assert meta["format"] == integrity.FORMAT and meta["step"] == 4
    assert sorted(meta["files"]) == [".hybridtune", "rng-0.pt", "state/.metadata", "state/__0_0.distcp", STATE]
    for rel in ("rng-0.pt", STATE):  # plain tensors, ints, lists, dicts: loadable with weights_only=True
        torch.load(out / "checkpoint-4" / rel, weights_only=True)
    assert ckpt.verify_checkpoint(out / "checkpoint-4") is None
    state, model = load(out / "checkpoint-4")
    assert state["step"] == 4
    assert all(torch.equal(v, saved[4][k]) for k, v in model.state_dict().items())


STATE = ckpt.STATE_FILE


def truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def overwrite_middle(p: Path) -> None:
    """Same length, bytes changed inside the tensor data: before checksums this loaded silently."""
    b = bytearray(p.read_bytes())
    mid = len(b) // 2
    b[mid : mid + 64] = b"\x7f" * 64
    p.write_bytes(bytes(b))


CORRUPTIONS = {
    "truncated distcp": ("state/__0_0.distcp", truncate, "state/__0_0.distcp is .* bytes, checkpoint.json says"),
    "overwritten distcp": ("state/__0_0.distcp", overwrite_middle, "state/__0_0.distcp does not match its sha256"),
    "missing trainer_state": (STATE, Path.unlink, "trainer_state.pt is missing"),
    "missing metadata": ("state/.metadata", Path.unlink, r"state/\.metadata is missing"),
    "missing checkpoint.json": (ckpt.META_FILE, Path.unlink, r"checkpoint\.json is missing"),
    "added rng file": ("rng-1.pt", lambda p: p.write_bytes(b"x"), r"rng-1\.pt is not listed in checkpoint\.json"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_checkpoint_is_named_and_latest_falls_back_to_the_intact_one(run, case):
    out, saved = run
    rel, damage, why = CORRUPTIONS[case]
    damage(out / "checkpoint-4" / rel)
    # Named explicitly: one error naming the file, no fallback (the user asked for this one).
    with pytest.raises(ckpt.CheckpointError, match=f"checkpoint-4' cannot be resumed: {why}"):
        find_resume(str(out / "checkpoint-4"), out)
    with pytest.raises(ckpt.CheckpointError, match=why):
        load(out / "checkpoint-4")
    # latest: the newest intact checkpoint, with a warning naming what was skipped and why.
    path, skipped = find_resume("latest", out)
    assert path == out / "checkpoint-2"
    assert len(skipped) == 1 and skipped[0].startswith("resume_from_checkpoint latest: skipped checkpoint-4 (")
    assert skipped[0].endswith("; resuming from checkpoint-2") and __import__("re").search(why, skipped[0])
    state, model = load(path, verified=True)
    assert state["step"] == 2 and all(torch.equal(v, saved[2][k]) for k, v in model.state_dict().items())
    assert (out / "checkpoint-4").is_dir()  # skipped, never removed


def test_latest_with_no_intact_checkpoint_names_each(run):
    out, _ = run
    (out / "checkpoint-2" / STATE).unlink()
    truncate(out / "checkpoint-4" / "state/__0_0.distcp")
    with pytest.raises(ckpt.CheckpointError, match=r"no intact checkpoint .*checkpoint-4: state/__0_0.distcp is .*"):
        find_resume("latest", out)
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint in"):
        find_resume("latest", out / "empty")


def test_checkpoint_of_an_older_hybridtune_without_checksums_is_refused_with_why(run):
    out, _ = run
    meta = json.loads((out / "checkpoint-4" / ckpt.META_FILE).read_text())
    del meta["files"], meta["format"]
    (out / "checkpoint-4" / ckpt.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(
        ckpt.CheckpointError, match="lists no checksums: written by an older hybridtune.*could run code"
    ):
        find_resume(str(out / "checkpoint-4"), out)


def test_a_link_inside_a_checkpoint_is_refused(run, tmp_path_factory):
    out, _ = run
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "blob"
    elsewhere.write_bytes(b"x")
    (out / "checkpoint-4" / "extra").symlink_to(elsewhere)
    with pytest.raises(ckpt.CheckpointError, match="extra is not a regular file"):
        find_resume(str(out / "checkpoint-4"), out)


# -- planted code -----------------------------------------------------------------------------------------------


class Payload:
    """Unpickling this creates `flag`: proof that loading ran code."""

    def __init__(self, flag: Path):
        self.flag = str(flag)

    def __reduce__(self):
        return (open, (self.flag, "w"))


def plant_pt(path: Path, flag: Path, rel: str) -> None:
    state = torch.load(path / rel, weights_only=True)
    state["extra"] = Payload(flag)
    torch.save(state, path / rel)


def plant_metadata(path: Path, flag: Path, rel: str) -> None:
    import pickle

    (path / rel).write_bytes(pickle.dumps(Payload(flag)))


def plant_dcp_entry(path: Path, flag: Path, rel: str) -> None:
    """An optimizer hyperparameter (a DCP bytes entry, which DCP itself loads with weights_only=False)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt, sched = parts()
    step(model, opt, sched)
    msd, osd = get_state_dict(model, opt)
    osd["param_groups"][0]["lr"] = Payload(flag)
    shutil.rmtree(path / "state")
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path / "state"))


PLANTS = {
    "trainer_state.pt": (plant_pt, STATE),
    "rng-0.pt": (plant_pt, "rng-0.pt"),
    "state/.metadata": (plant_metadata, "state/.metadata"),
    "dcp optimizer entry": (plant_dcp_entry, "state/__0_0.distcp"),
}


@pytest.mark.parametrize("forged", [False, True], ids=["stale checksums", "forged checksums"])
@pytest.mark.parametrize("where", sorted(PLANTS))
def test_code_planted_in_a_checkpoint_is_refused_and_never_runs(run, tmp_path_factory, where, forged):
    out, _ = run
    flag = tmp_path_factory.mktemp("flag") / "payload-ran"
    plant, rel = PLANTS[where]
    path = out / "checkpoint-4"
    plant(path, flag, rel)
    if forged:
        forge(path)  # the checksums match: the loaders themselves must refuse
    with pytest.raises(ckpt.CheckpointError) as e:
        if forged:
            load(path)
        else:
            find_resume(str(path), out)
    assert not flag.exists(), "the payload ran"
    # Stale: the first changed file is named (a new DCP save changes state/.metadata too). Forged: the loader says why.
    assert "could run code" in str(e.value) if forged else rel.split("/")[0] in str(e.value)


def test_planted_metadata_is_one_line_and_latest_falls_back(run, tmp_path_factory, caplog):
    """A state/.metadata that is not DCP's (with forged checksums) is refused before DCP reads it: DCP logged two
    tracebacks to the root logger ('Global metadata is not found ...') ahead of the one line; and `latest` falls
    back to the intact checkpoint before it, as for a file that fails its checksum."""
    out, saved = run
    flag = tmp_path_factory.mktemp("flag") / "payload-ran"
    path = out / "checkpoint-4"
    plant_metadata(path, flag, "state/.metadata")
    forge(path)
    with caplog.at_level("INFO"):
        said = r"cannot be resumed: state/\.metadata is refused: global '.*' is not part of DCP's metadata \("
        with pytest.raises(ckpt.CheckpointError, match=said + r"loading it could run code\)$"):
            load(path)
    assert not flag.exists() and not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    found, lines = find_resume("latest", out)
    assert found.name == "checkpoint-2" and not flag.exists()
    assert len(lines) == 1 and "skipped checkpoint-4 (state/.metadata is refused: global" in lines[0], lines


def test_metadata_unpickler_builds_dcp_metadata_only():
    with pytest.raises(ckpt.CheckpointError, match="global 'builtins.eval' is not part of DCP's metadata"):
        integrity.read_dcp_metadata(b"cbuiltins\neval\n(S'1+1'\ntR.")


# -- disk full -----------------------------------------------------------------------------------------------


def test_save_that_cannot_fit_is_refused_before_writing(run, monkeypatch):
    out, _ = run
    before = sorted(p.name for p in out.iterdir())
    real = shutil.disk_usage
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    model, opt, sched = parts()
    with pytest.raises(ckpt.DiskFullError) as e:
        ckpt.save_checkpoint(out / "checkpoint-6", model, opt, sched, 6, {})
    msg = str(e.value)
    assert msg.startswith("disk full: saving checkpoint-6 needs about ") and f"'{out}' has 1000 bytes free" in msg
    assert "the previous checkpoint checkpoint-4 is intact" in msg and "--resume_from_checkpoint latest" in msg
    assert sorted(p.name for p in out.iterdir()) == before
    assert ckpt.verify_checkpoint(out / "checkpoint-4") is None


def test_estimate_counts_the_tensors():
    model, opt, sched = parts()
    step(model, opt, sched)
    n = sum(p.numel() * 4 for p in model.parameters())
    assert disk.state_bytes(model.state_dict(), opt.state_dict()) >= 3 * n  # weights + two moments


@pytest.mark.parametrize("where", ["torch.save", "dcp write"])
def test_disk_full_midway_removes_the_partial_save_and_says_so(run, monkeypatch, where):
    out, _ = run
    before = sorted(p.name for p in out.iterdir())
    if where == "torch.save":
        # What torch.save's zip writer raises on a short write (the reproduction).
        real_save = torch.save

        def save(obj, f, *a, **kw):
            if str(f).endswith(STATE):
                Path(f).write_bytes(b"PK\x03\x04 partial")
                real = shutil.disk_usage
                monkeypatch.setattr(disk.shutil, "disk_usage", lambda p: real(p)._replace(free=0))
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
            return real_save(obj, f, *a, **kw)

        monkeypatch.setattr(torch, "save", save)
    else:
        import torch.distributed.checkpoint.filesystem as fs

        def write_item(*a, **kw):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(fs, "_write_item", write_item)
    model, opt, sched = parts()
    with pytest.raises(ckpt.DiskFullError, match=r"^disk full: saving checkpoint-6 needs about .*no space left; "):
        ckpt.save_checkpoint(out / "checkpoint-6", model, opt, sched, 6, {})
    assert sorted(p.name for p in out.iterdir()) == before  # no partial temp dir left behind
    assert ckpt.verify_checkpoint(out / "checkpoint-4") is None


def test_other_save_failures_are_not_called_disk_full(run, monkeypatch):
    out, _ = run
    import torch.distributed.checkpoint.filesystem as fs

    def write_item(*a, **kw):
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(fs, "_write_item", write_item)
    model, opt, sched = parts()
    with pytest.raises(write_errors.WriteError) as e:  # (one line with its errno: run/write_errors.py)
        ckpt.save_checkpoint(out / "checkpoint-6", model, opt, sched, 6, {})
    assert "disk full" not in str(e.value) and "Permission denied (EACCES)" in str(e.value), e.value
    assert not list(out.glob(".tmp-*"))
