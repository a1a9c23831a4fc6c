"""`use_compile_caches`: inductor's and Triton's caches in a place that outlives the process (hybridtune's cache
directory, or where TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR say), and one line saying whether each is cold or
warm."""

from __future__ import annotations

import os

import pytest

from hybridtune.kernels import environment
from hybridtune.kernels.environment import use_compile_caches


@pytest.fixture
def clean(monkeypatch, tmp_path):
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "HYBRIDTUNE_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def test_unset_caches_go_under_hybridtunes_cache_and_start_cold(clean, monkeypatch):
    monkeypatch.setenv("HYBRIDTUNE_CACHE_DIR", str(clean / "ht"))
    line = use_compile_caches()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(clean / "ht" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(clean / "ht" / "triton")
    assert (
        line
        == f"compile caches: inductor {clean / 'ht' / 'inductor'} (cold, empty); triton {clean / 'ht' / 'triton'} (cold, empty)"
    )


def test_xdg_cache_home_and_then_home(clean, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(clean / "xdg"))
    use_compile_caches()
    assert os.environ["TRITON_CACHE_DIR"] == str(clean / "xdg" / "hybridtune" / "triton")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    use_compile_caches()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(clean / "home" / ".cache" / "hybridtune" / "inductor")


def test_a_users_variables_are_kept_and_a_filled_cache_is_warm(clean, monkeypatch):
    mine = clean / "my-inductor"
    (mine / "fxgraph" / "ab").mkdir(parents=True)
    for i in range(3):
        (mine / "fxgraph" / "ab" / f"entry{i}").write_text("x")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(mine))
    monkeypatch.setenv("HYBRIDTUNE_CACHE_DIR", str(clean / "ht"))
    (clean / "ht" / "triton").mkdir(parents=True)  # there, but empty: still cold
    line = use_compile_caches()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(mine)
    assert f"inductor {mine} (warm, 3 files, from TORCHINDUCTOR_CACHE_DIR)" in line
    assert f"triton {clean / 'ht' / 'triton'} (cold, empty)" in line


def test_counting_stops_at_the_cap(clean, monkeypatch):
    monkeypatch.setattr(environment, "CACHE_COUNT_CAP", 5)
    big = clean / "big"
    for d in range(4):
        (big / str(d)).mkdir(parents=True)
        for i in range(3):
            (big / str(d) / str(i)).write_text("x")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(big))
    assert f"triton {big} (warm, 5+ files, from TRITON_CACHE_DIR)" in use_compile_caches()
