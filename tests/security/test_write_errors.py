"""A write the system refuses for another reason than space (a file larger than `ulimit -f` allows: EFBIG; an I/O
error: EIO) is one line with the errno and what to do, exit 2, in a training save, an export and a merge; nothing
half-written is left (red team 2, defect 9: torch's "unexpected pos" and safetensors' "os error 27" tracebacks)."""

from __future__ import annotations

import contextlib
import errno
import resource
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import SafetensorError

from hybridtune.cli import main
from hybridtune.run import checkpoint as ckpt
from hybridtune.run import write_errors
from hybridtune.run.lock import LOCK_FILE

TRAIN = ["train", "--sequence_len", "128", "--eval_steps", "0", "--val_set_size", "0"]


@contextlib.contextmanager
def file_size_limit(n: int):
    """This process may write files of at most `n` bytes inside the block (`ulimit -f`; Python ignores SIGXFSZ, so
    a write past it fails with EFBIG)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def one_line(argv: list[str], capsys) -> str:
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [x for x in err.replace("\r", "\n").splitlines() if x.startswith("error: ")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "disk full" not in lines[0], lines[0]  # the disk is not full: the line must not say so
    return lines[0]


def temporaries(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob(f"{ckpt.TMP_PREFIX}*"))


def efbig(line: str) -> None:
    assert "File too large (EFBIG)" in line and "ulimit -f" in line, line


def test_a_training_save_past_the_file_size_limit_is_one_line(tmp_path, small_data, capsys):
    """The red team's `(ulimit -f 3000; hybridtune train ... --save_steps 2)`: torch.save's "unexpected pos"."""
    out = tmp_path / "run"
    argv = [*TRAIN, "--dataset", small_data, "--max_steps", "3", "--save_steps", "1", "--output_dir", str(out)]
    with file_size_limit(1 << 20):  # the full fine-tune's DCP state is about 11 MiB
        line = one_line(argv, capsys)
    assert line.startswith(f"error: cannot write checkpoint-1 in '{out}': "), line
    efbig(line)
    assert "nothing of it was kept" in line, line
    assert not list(out.glob("checkpoint-*")) and temporaries(tmp_path) == []


def test_an_export_past_the_file_size_limit_is_one_line(lora_run_dir, tmp_path, capsys):
    out = tmp_path / "export"
    with file_size_limit(200 << 10):  # the preset's base_model/ safetensors is about 3.4 MiB
        line = one_line(["export", str(lora_run_dir / "checkpoint-2"), str(out)], capsys)
    assert line.startswith(
        f"error: exporting '{lora_run_dir / 'checkpoint-2'}' failed: a write in '{out}' was refused"
    ), line
    efbig(line)
    assert line.endswith("nothing was changed. Then run the export again"), line
    assert not out.exists() and temporaries(tmp_path) == []  # not even the lock or the directory


def test_a_merge_past_the_file_size_limit_is_one_line(lora_run_dir, tmp_path, capsys):
    out = tmp_path / "merged"
    with file_size_limit(200 << 10):
        line = one_line(["merge", str(lora_run_dir / "final"), str(out)], capsys)
    assert line.startswith(f"error: cannot write '{out}': "), line
    efbig(line)
    assert not out.exists() and temporaries(tmp_path) == []


def test_an_overwrite_refused_midway_keeps_the_earlier_export(lora_run_dir, tmp_path, capsys):
    out = tmp_path / "export"
    assert main(["export", str(lora_run_dir / "checkpoint-2"), str(out)]) == 0
    before = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != LOCK_FILE}
    with file_size_limit(200 << 10):
        line = one_line(["export", str(lora_run_dir / "checkpoint-2"), str(out), "--overwrite"], capsys)
    efbig(line)
    after = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != LOCK_FILE}
    assert after == before and temporaries(tmp_path) == []


@pytest.mark.parametrize("nth", [1, 2])
def test_an_io_error_in_an_export_names_eio_and_what_changed(lora_run_dir, tmp_path, monkeypatch, capsys, nth):
    """safetensors' own text (no errno attribute): 1 = base_model/ fails, 2 = final/ fails after base_model/."""
    out = tmp_path / "export"
    real, calls = safetensors.torch.serialize_file, []

    def serialize_file(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == nth:
            Path(filename).write_bytes(b"partial")
            raise SafetensorError("Error while serializing: I/O error: Input/output error (os error 5)")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "serialize_file", serialize_file)
    line = one_line(["export", str(lora_run_dir / "checkpoint-2"), str(out)], capsys)
    assert "Input/output error (EIO)" in line and "check it" in line, line
    if nth == 1:
        assert "nothing was changed" in line and not out.exists(), line
    else:
        assert f"only base_model/ in '{out}' changed (written before the write failed)" in line, line
    assert temporaries(tmp_path) == []


def test_a_short_torch_write_without_an_errno_is_said_as_it_is(tmp_path, small_data, monkeypatch, capsys):
    """torch.save's zip writer says only "unexpected pos" (no errno): without a file-size limit, not called EFBIG."""
    real = torch.save

    def short(obj, f, *a, **k):
        if str(f).endswith(ckpt.STATE_FILE):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return real(obj, f, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", short)
    monkeypatch.setattr(write_errors, "file_size_limit", lambda: None)
    out = tmp_path / "run"
    argv = [*TRAIN, "--dataset", small_data, "--max_steps", "2", "--save_steps", "1", "--output_dir", str(out)]
    line = one_line(argv, capsys)
    assert "a write stopped short ([enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598)" in line
    assert "EFBIG" not in line and not list(out.glob("checkpoint-*")) and temporaries(tmp_path) == []


def test_an_error_that_is_no_refused_write_is_not_hidden(tmp_path):
    """A bug inside a write (not an OSError, not a write the system refused) still raises as itself."""

    def buggy(tmp: Path) -> None:
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        write_errors.guard(buggy, 0, lambda free: "full", lambda why: why)(tmp_path)
    for code in (errno.EFBIG, errno.EIO, errno.EROFS):
        said = write_errors.failure(OSError(code, "x"))
        assert said is not None and errno.errorcode[code] in said
    assert write_errors.failure(ValueError("unexpected pos")) is None


def test_a_read_only_disk_is_one_line_in_a_save_and_a_merge(lora_run_dir, tmp_path, small_data, monkeypatch, capsys):
    """EROFS where the temporary directory is made, before any write of it (a disk remounted read-only): the merge
    ended in an OSError traceback."""
    real = ckpt.make_tmp_dir

    def read_only(target):
        raise OSError(errno.EROFS, "Read-only file system", str(target))

    monkeypatch.setattr(ckpt, "make_tmp_dir", read_only)
    out = tmp_path / "merged"
    line = one_line(["merge", str(lora_run_dir / "final"), str(out)], capsys)
    assert line.startswith(f"error: cannot write '{out}': Read-only file system (EROFS)"), line
    run = tmp_path / "run"
    argv = [*TRAIN, "--dataset", small_data, "--max_steps", "2", "--save_steps", "1", "--output_dir", str(run)]
    line = one_line(argv, capsys)
    assert line.startswith(f"error: cannot write checkpoint-1 in '{run}': Read-only file system (EROFS)"), line
    monkeypatch.setattr(ckpt, "make_tmp_dir", real)
    assert temporaries(tmp_path) == []


def test_a_last_checkpoint_past_the_limit_still_writes_final(tmp_path, small_data, capsys):
    """The last step's checkpoint (about 11 MiB) is refused under a 5 MiB limit, final/ (about 3.4 MiB) is not: the
    run says so in one warning and keeps what it trained (the trainer's rule for a last checkpoint that does not fit)."""
    out = tmp_path / "run"
    with file_size_limit(5 << 20):
        assert main([*TRAIN, "--dataset", small_data, "--max_steps", "2", "--output_dir", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"cannot write checkpoint-2 in '{out}': File too large (EFBIG); writing final/ (the trained model)" in err
    assert (out / "final" / "model.safetensors").is_file() and not list(out.glob("checkpoint-*"))
    assert temporaries(tmp_path) == []
