"""Generated code loaded from disk fails closed: hash, owner, mode and symlinks are all checked."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from hybridtune.compiler.modules.diskload import MANIFEST, UnsafeGeneratedCode, load_verified, read_verified, write_dump

TEXT = "VALUE = 41 + 1\n"
SHA = hashlib.sha256(TEXT.encode()).hexdigest()


@pytest.fixture
def dump(tmp_path):
    d = tmp_path / "dump"
    write_dump(d, {"gen.py": TEXT})
    return d


def test_roundtrip(dump):
    assert oct(os.stat(dump).st_mode & 0o777) == oct(0o700)
    assert json.loads((dump / MANIFEST).read_text()) == {"gen.py": SHA}
    assert read_verified(dump, "gen.py", SHA) == TEXT
    assert load_verified(dump, "gen.py", SHA).VALUE == 42


def test_edited_bytes_are_refused(dump):
    (dump / "gen.py").write_text("VALUE = 666\n")
    with pytest.raises(UnsafeGeneratedCode, match="does not match"):
        read_verified(dump, "gen.py", SHA)


def test_manifest_is_not_trusted(dump):
    # Whoever edits the file can edit the manifest; only the hash of what was generated counts.
    (dump / "gen.py").write_text("VALUE = 666\n")
    (dump / MANIFEST).write_text(json.dumps({"gen.py": hashlib.sha256(b"VALUE = 666\n").hexdigest()}))
    with pytest.raises(UnsafeGeneratedCode):
        read_verified(dump, "gen.py", SHA)


def test_group_or_other_writable_dir_is_refused(dump):
    os.chmod(dump, 0o770)
    with pytest.raises(UnsafeGeneratedCode, match="writable by group or others"):
        read_verified(dump, "gen.py", SHA)
    os.chmod(dump, 0o707)
    with pytest.raises(UnsafeGeneratedCode, match="writable by group or others"):
        read_verified(dump, "gen.py", SHA)


def test_writable_file_is_refused(dump):
    os.chmod(dump / "gen.py", 0o666)
    with pytest.raises(UnsafeGeneratedCode, match="writable by group or others"):
        read_verified(dump, "gen.py", SHA)


def test_symlinked_file_is_refused(dump, tmp_path):
    real = tmp_path / "elsewhere.py"
    real.write_text(TEXT)
    os.replace(dump / "gen.py", tmp_path / "moved.py")
    os.symlink(real, dump / "gen.py")
    with pytest.raises(UnsafeGeneratedCode, match="symlink"):
        read_verified(dump, "gen.py", SHA)


def test_symlinked_dir_is_refused(dump, tmp_path):
    link = tmp_path / "link"
    os.symlink(dump, link)
    with pytest.raises(UnsafeGeneratedCode, match="symlink"):
        read_verified(link, "gen.py", SHA)


def test_foreign_owner_is_refused(dump, monkeypatch):
    monkeypatch.setattr(os, "getuid", lambda: os.stat(dump).st_uid + 1)
    with pytest.raises(UnsafeGeneratedCode, match="owned by uid"):
        read_verified(dump, "gen.py", SHA)


def test_path_names_are_refused(dump):
    with pytest.raises(UnsafeGeneratedCode):
        read_verified(dump, "../gen.py", SHA)


def test_dump_refuses_an_unsafe_directory(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(UnsafeGeneratedCode):
        write_dump(d, {"gen.py": TEXT})


def test_dump_never_writes_through_a_planted_manifest_link(tmp_path):
    """Issue 16 item 12: the manifest was written with write_text, which follows a link planted at its name."""
    d = tmp_path / "dump"
    write_dump(d, {"gen.py": TEXT})
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (d / MANIFEST).unlink()
    (d / MANIFEST).symlink_to(victim)
    with pytest.raises(UnsafeGeneratedCode, match="is a symlink"):
        write_dump(d, {"gen.py": TEXT})
    assert victim.read_text() == "keep"
