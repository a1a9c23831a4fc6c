"""Red-team (s11) failing-first tests for the changes since 683e84e: compile_regions and resume, one_read's kept
digests under symlinked files, and compile_loop's log line under a non-inductor backend."""

from __future__ import annotations

import hashlib
import json
import logging
import os

import pytest
from test_resume import make_cfg

from hybridtune.config import to_dict
from hybridtune.data.digests import data_digest, local_files, one_read
from hybridtune.run import outdir


def _held(out, cfg, data=None) -> None:
    """`out` holds the run of `cfg` (its run file, as claim_output_dir writes it)."""
    out.mkdir(parents=True, exist_ok=True)
    record = {"config": to_dict(cfg), "data": outdir.data_fingerprint(cfg) if data is None else data, "cwd": "."}
    (out / outdir.RUN_FILE).write_text(json.dumps(record))


@pytest.mark.parametrize("before,after", [(False, True), (True, False)])
def test_resume_may_switch_compile_regions(tmp_path, small_data, before, after):
    """compile_regions traces each distinct layer once instead of inlining it: the same model, loss and gradients
    (as cuda_graphs replays the same kernels), so a resume may switch it, e.g. to get a deep model's first step."""
    out = tmp_path / "run"
    _held(out, make_cfg(out, small_data, compile="loop", compile_regions=before))
    cfg = make_cfg(out, small_data, compile="loop", compile_regions=after, resume_from_checkpoint="latest")
    outdir.check_output_dir(cfg)  # refused today: "compile_regions: False -> True"


def _plain(files, root) -> str:
    """What run files have always recorded for a glob: sha256 over name-under-root + NUL + content per file."""
    h = hashlib.sha256()
    for f in files:
        h.update(os.path.relpath(f, root).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


@pytest.fixture
def linked(tmp_path, small_data, monkeypatch):
    """data/train.jsonl and data/test.jsonl, a symlink to it (evaluating on the training rows, say)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(open(small_data).read())
    (tmp_path / "data" / "test.jsonl").symlink_to("train.jsonl")
    return tmp_path


def test_kept_digest_of_a_glob_does_not_depend_on_what_was_hashed_first(linked):
    """Inside one_read, two globs under one root whose files are one file under two names (a symlink) must keep
    their own digests: the names count in a glob's digest, but _kept keys on the resolved path alone."""
    a, b = local_files("data/train*.jsonl"), local_files("data/test*.jsonl")
    alone = data_digest(*b)
    assert alone == _plain(*b)
    with one_read():
        data_digest(*a)
        assert data_digest(*b) == alone  # today: the train glob's digest


def test_an_old_run_over_symlinked_data_still_resumes(linked):
    """A run recorded before one_read (each glob's own digest) is resumed as the trainer does, inside one_read:
    the data is unchanged, so the resume must not call it changed."""
    out = linked / "run"
    keys = dict(
        dataset=None,
        datasets=[{"path": "data/train*.jsonl"}],
        test_datasets=[{"path": "data/test*.jsonl"}],
        val_set_size=0,
    )
    cfg = make_cfg(out, None, **keys)
    old = {p: _plain(*local_files(p)) for p in ("data/train*.jsonl", "data/test*.jsonl")}
    _held(out, cfg, old)
    with one_read():  # as Trainer._setup
        outdir.check_output_dir(make_cfg(out, None, resume_from_checkpoint="latest", **keys))


def test_loop_log_says_inductor_buffer_reuse_off_only_under_inductor(caplog):
    """Under aot_eager nothing of inductor runs; the log line must not claim its buffer reuse is off."""
    from transformers import AutoModelForCausalLM

    from hybridtune.compiler.loop import compile_loop
    from hybridtune.models.presets import preset_config

    model = AutoModelForCausalLM.from_config(preset_config("tiny-qwen3_5", vocab_size=256))
    with caplog.at_level(logging.INFO, logger="hybridtune"):
        compile_loop(model, backend="aot_eager", regional=True)  # torch.compile is lazy: nothing compiles here
    text = "\n".join(r.getMessage() for r in caplog.records if "compile strategy 'loop'" in r.getMessage())
    assert "each distinct layer traced once" in text
    assert "buffer reuse" not in text
