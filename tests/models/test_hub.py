"""A hub id resolves as transformers resolves it: through the local hub cache (HF_HOME / HF_HUB_CACHE, laid out here
by tests/checkpoints.hub_cache) with HF_HUB_OFFLINE=1, at a revision; what cannot be had is one ModelError line."""

from __future__ import annotations

import pytest
import torch

from checkpoints import fake_sha, hub_cache, make_checkpoint, read_tensors
from hybridtune.cli import main
from hybridtune.errors import ModelError
from hybridtune.models.hub import resolve_source
from hybridtune.models.loading import load_model, tokenizer_for


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)


def test_hub_id_loads_from_the_cache_offline(tmp_path, monkeypatch, offline):
    ckpt = make_checkpoint(tmp_path, "qwen3_5_vl")
    sha = fake_sha("main")
    home = hub_cache(tmp_path, "acme/tiny-vl", ckpt, sha)
    monkeypatch.setenv("HF_HOME", str(home))
    loaded = load_model("acme/tiny-vl")
    snapshot = home / "hub" / "models--acme--tiny-vl" / "snapshots" / sha
    assert (loaded.name, loaded.source_dir, loaded.revision) == ("acme/tiny-vl", snapshot, sha)
    assert type(loaded.model).__name__ == "Qwen3_5ForConditionalGeneration" and not loaded.random_init
    saved = read_tensors(ckpt)
    state = loaded.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items() if not k.startswith("mtp.")), "weights as saved"
    # The tokenizer comes from the snapshot too (the same files as the checkpoint's).
    assert tokenizer_for("acme/tiny-vl").get_vocab() == loaded.tokenizer.get_vocab()


def test_revision_picks_the_snapshot_and_hf_hub_cache_wins_over_hf_home(tmp_path, monkeypatch, offline):
    old = make_checkpoint(tmp_path, "qwen3_5_text", name="old", seed=1)
    new = make_checkpoint(tmp_path, "qwen3_5_text", name="new", seed=2)
    home = tmp_path / "home"
    hub_cache(tmp_path, "acme/tiny", old, fake_sha("v1"), ref="v1", hf_home=home)
    hub_cache(tmp_path, "acme/tiny", new, fake_sha("main"), hf_home=home)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    emb = "model.embed_tokens.weight"
    for revision, ckpt, sha in [
        (None, new, fake_sha("main")),
        ("v1", old, fake_sha("v1")),
        (fake_sha("v1"), old, None),
    ]:
        loaded = load_model("acme/tiny", revision=revision)
        assert loaded.revision == (sha or revision)
        assert torch.equal(loaded.model.state_dict()[emb], read_tensors(ckpt)[emb]), revision


def test_offline_and_not_cached_is_one_line(tmp_path, monkeypatch, offline, capsys):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    with pytest.raises(ModelError) as e:
        resolve_source("Qwen/Qwen3.5-0.8B", "main")
    msg = str(e.value)
    assert "\n" not in msg and "'Qwen/Qwen3.5-0.8B' at revision 'main'" in msg
    assert "HF_HUB_OFFLINE" in msg and str(tmp_path / "empty" / "hub") in msg and "hf download" in msg
    assert "qwen3_5-0.8b" not in msg, "a hub id is not pointed at a random-weight preset"
    # A cached repo without the asked revision says the same, with that revision.
    home = hub_cache(tmp_path, "acme/tiny", make_checkpoint(tmp_path, "qwen3_5_text"))
    monkeypatch.setenv("HF_HOME", str(home))
    with pytest.raises(ModelError, match=r"'acme/tiny' at revision 'v9' is not in the hub cache"):
        resolve_source("acme/tiny", "v9")
    # Through the CLI: exit 2, one line, no traceback, nothing trained.
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    out = tmp_path / "run"
    capsys.readouterr()
    assert (
        main(
            [
                "train",
                "--base_model",
                "Qwen/Qwen3.5-0.8B",
                "--output_dir",
                str(out),
                "--max_steps",
                "1",
                "--warmup_steps",
                "0",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Qwen/Qwen3.5-0.8B" in err[0] and "Traceback" not in err[0], err
    assert not (out / "final").exists()


def test_names_that_are_no_model_suggest_presets(tmp_path):
    with pytest.raises(
        ModelError, match=r"neither a preset, a local checkpoint directory nor a hub id.*'tiny-qwen3_5'"
    ):
        resolve_source("tiny-qwen3.5")
    with pytest.raises(ModelError, match=r"Presets \(random weights\): tiny-qwen3_5, "):
        resolve_source("no-such-model")
    with pytest.raises(ModelError, match=r"'\./my-modle': no such directory \(.*my-modle does not exist\)"):
        resolve_source("./my-modle")  # a mistyped local path: said so, never looked up on the hub
    with pytest.raises(ModelError, match=r"no such directory \(.*missing/dir does not exist\)"):
        resolve_source(str(tmp_path / "missing" / "dir"))
    (tmp_path / "noconfig").mkdir()
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_source(str(tmp_path / "noconfig"))


def test_a_local_directory_wins_over_a_hub_id_of_the_same_name(tmp_path, monkeypatch, offline):
    ckpt = make_checkpoint(tmp_path, "qwen3_5_text", name="acme")
    (ckpt.parent / "acme" / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    source = resolve_source("acme")
    assert source.path.resolve() == ckpt.resolve() and source.revision is None


def test_a_hub_that_cannot_be_reached_is_one_line(tmp_path, monkeypatch):
    """Online as far as hybridtune knows (HF_HUB_OFFLINE=0), but no request can leave (huggingface_hub's own offline
    switch, as a missing network would): one line, naming the cache, never a traceback."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # every request refused before it leaves this process
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    with pytest.raises(ModelError) as e:
        resolve_source("acme/absent")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("base_model 'acme/absent' cannot be downloaded"), msg
    assert str(tmp_path / "empty" / "hub") in msg


def test_doctor_reads_a_hub_ids_config_from_the_cache(tmp_path, monkeypatch, offline, capsys):
    """`hybridtune doctor --model org/name` refused hub ids; it now reads the config.json of the cached snapshot
    (the kernel report of the VL checkpoint's text model), and an uncached id offline is one line, exit 2."""
    home = hub_cache(tmp_path, "acme/tiny-vl", make_checkpoint(tmp_path, "qwen3_5_vl"), fake_sha("vl"))
    monkeypatch.setenv("HF_HOME", str(home))
    assert main(["doctor", "--model", "acme/tiny-vl", "--json"]) == 0
    out = capsys.readouterr().out
    assert "hub model acme/tiny-vl" in out and fake_sha("vl") in out and "qwen3_5" in out
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    assert main(["doctor", "--model", "acme/missing"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'acme/missing'" in err and "HF_HUB_OFFLINE" in err


def test_a_hub_download_fetches_every_file_an_export_carries():
    """An export carries the source's processor, template, generation and licence files (models.source): a hub id's
    snapshot must hold them, and Qwen's repositories name their licence `LICENSE` (no suffix, not fetched)."""
    from fnmatch import fnmatch

    from hybridtune.models.hub import HUB_FILES

    carried = ["preprocessor_config.json", "video_preprocessor_config.json", "chat_template.jinja"]
    carried += ["generation_config.json", "LICENSE", "LICENSE.md", "NOTICE"]
    assert [f for f in carried if not any(fnmatch(f, p) for p in HUB_FILES)] == []


def test_a_resume_loads_the_commit_its_checkpoint_trained_on(tmp_path, monkeypatch, offline):
    """A hub id's branch that moves between a run and its resume (a new commit on `main`) must not move the run: the
    resumed base would be other weights under the trained adapter or optimizer state. A checkpoint records the
    commit (`base_revision`), and a resume loads that one, saying so."""
    import json

    from hybridtune.config import load_config
    from hybridtune.train.trainer import Trainer

    home = tmp_path / "hf"
    first = make_checkpoint(tmp_path, "qwen3_5_text", name="first", seed=1)
    hub_cache(tmp_path, "acme/tiny", first, fake_sha("first"), hf_home=home)
    monkeypatch.setenv("HF_HOME", str(home))
    rows = [{"text": f"{i} + {i} = {2 * i}"} for i in range(40)]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    settings = dict(base_model="acme/tiny", dataset=str(data), output_dir=str(tmp_path / "out"), adapter="lora",
                    sequence_len=64, max_steps=2, eval_steps=0, val_set_size=4, warmup_steps=0)  # fmt: skip

    def run(**kw) -> Trainer:
        t = Trainer(load_config(None, settings | kw))
        t.setup()
        t.train()
        return t

    assert run().loaded.revision == fake_sha("first")
    meta = json.loads((tmp_path / "out" / "checkpoint-2" / "checkpoint.json").read_text())
    assert meta["base_revision"] == fake_sha("first")
    # `main` moves on: a new commit with other weights.
    hub_cache(tmp_path, "acme/tiny", make_checkpoint(tmp_path, "qwen3_5_text", name="second", seed=2), fake_sha("second"), hf_home=home)  # fmt: skip
    assert resolve_source("acme/tiny").revision == fake_sha("second")
    resumed = run(resume_from_checkpoint="latest")
    assert resumed.loaded.revision == fake_sha("first") and resumed.step == 2
    from hybridtune.infer.load import open_model

    # generate / eval / export open the checkpoint on the same commit
    assert open_model(str(tmp_path / "out" / "checkpoint-2")).loaded.revision == fake_sha("first")
    fresh = run(overwrite=True)  # a new run takes the branch as it is now
    assert fresh.loaded.revision == fake_sha("second")
