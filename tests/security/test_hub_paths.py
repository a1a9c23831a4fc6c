"""A hub id never reaches outside the hub cache: a `refs/main` holding `../..`, a snapshot (or a file in one) that
links elsewhere, and a `revision` that is a path (`..`, a leading `/`) are refused in one line (exit 2) before
anything there is read, while a cache reached through a symlink (a cache on another disk) still resolves."""

from __future__ import annotations

import json
import os

import pytest

from checkpoints import fake_sha, hub_cache, make_checkpoint
from hybridtune.errors import ModelError
from hybridtune.models.hub import resolve_source

REPO = "acme/tiny"
SHA = fake_sha("main")


@pytest.fixture
def cache(model_dir, tmp_path, monkeypatch):
    """(HF_HOME of an offline cache holding REPO at SHA, its repo folder, a model directory outside the cache)."""
    home = hub_cache(tmp_path, REPO, model_dir, SHA)
    outside = make_checkpoint(tmp_path, "qwen3_5_text", name="outside", seed=3)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    return home, home / "hub" / "models--acme--tiny", outside


def test_the_cache_resolves_also_through_a_symlink(cache, tmp_path, monkeypatch):
    home, repo, _ = cache
    assert resolve_source(REPO).path == repo / "snapshots" / SHA
    linked = tmp_path / "linked-home"
    linked.symlink_to(home, target_is_directory=True)
    monkeypatch.setenv("HF_HOME", str(linked))
    assert resolve_source(REPO).path.resolve() == (repo / "snapshots" / SHA).resolve()  # not refused


def test_a_ref_that_climbs_out_of_the_cache_is_refused(cache, error_line):
    home, repo, outside = cache
    (repo / "refs" / "main").write_text(os.path.relpath(outside, repo / "snapshots"))  # ../../../../outside
    line = error_line(["generate", REPO, "--prompt", "hi", "--max_new_tokens", "2"])
    assert "outside the hub cache" in line and REPO in line, line


def test_a_snapshot_linked_outside_the_cache_is_refused(cache, error_line):
    home, repo, outside = cache
    snapshot = repo / "snapshots" / SHA
    snapshot.rename(repo / "moved")
    snapshot.symlink_to(outside, target_is_directory=True)
    line = error_line(["generate", REPO, "--prompt", "hi", "--max_new_tokens", "2"])
    assert "outside the hub cache" in line, line


def test_a_snapshot_file_linked_outside_the_cache_is_refused(cache, tmp_path):
    home, repo, _ = cache
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"token": "abc"}))
    (repo / "snapshots" / SHA / "tokenizer_config.json").unlink()
    (repo / "snapshots" / SHA / "tokenizer_config.json").symlink_to(secret)
    with pytest.raises(ModelError, match="tokenizer_config.json.* outside the hub cache"):
        resolve_source(REPO)


@pytest.mark.parametrize("revision", ["../../../../outside", "main/../../x", "/etc", "refs/../../x", "a\\..\\b"])
def test_a_revision_that_is_a_path_is_refused(revision, cache, tmp_path, error_line):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "one two three"}) + "\n")
    argv = ["train", "--base_model", REPO, "--revision", revision, "--dataset", str(data), "--max_steps", "1"]
    line = error_line([*argv, "--output_dir", str(tmp_path / "out")])
    assert f"revision '{revision}'" in line and "branch, tag or commit" in line, line
    assert not (tmp_path / "out").exists()


def test_an_adapters_recorded_revision_is_checked_too(cache, tmp_path, error_line):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    config = {"peft_type": "LORA", "base_model_name_or_path": REPO, "revision": "../../../../outside"}
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "r": 2, "target_modules": ["q_proj"]}))
    line = error_line(["generate", str(adapter), "--prompt", "hi"])
    assert "revision '../../../../outside' is not a branch, tag or commit name" in line, line


def test_branch_names_with_slashes_are_revisions(cache, model_dir, tmp_path):
    home, repo, _ = cache
    (repo / "refs" / "pr").mkdir()
    hub_cache(tmp_path, REPO, model_dir, fake_sha("pr"), ref="pr/1", hf_home=home)
    assert resolve_source(REPO, "pr/1").revision == fake_sha("pr")
