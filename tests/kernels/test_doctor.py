"""`hybridtune doctor`: the real CLI entry, JSON and text, presets and renamed checkpoint directories."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from hybridtune import cli  # noqa: E402
from hybridtune.errors import ModelError  # noqa: E402
from hybridtune.kernels import doctor  # noqa: E402


def _json(capsys, argv):
    assert doctor.main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def renamed_checkpoint(tmp_path_factory):
    from hybridtune.models.presets import preset_config

    path = tmp_path_factory.mktemp("ckpt") / "my-finetune-final"
    preset_config("tiny-qwen3_next", vocab_size=256).save_pretrained(path)
    return path


def test_json_for_preset(capsys, monkeypatch):
    monkeypatch.setenv("HYBRIDTUNE_KERNELS", "auto")  # doctor checks only, whatever the environment says
    d = _json(capsys, ["--model", "tiny-qwen3_5", "--json"])
    assert d["environment"]["versions"]["transformers"]
    assert d["model"]["model_type"] == "qwen3_5_text"
    assert d["model"]["gdn_layouts"] == ["H=2 HV=4 K=32 V=32"]
    prov = d["provision"]
    assert prov["policy"] == "check"
    assert prov["architecture"]["needs"] == ["causal_conv1d", "fla"]
    assert d["mixers"]["mixers"][0]["count"] == 3
    (patched,) = d["mixers_hybridtune"]["mixers"]
    assert patched["count"] == 3 and patched["path"].startswith("hybridtune op -> ")
    assert d["mixers_hybridtune"]["attention"]
    assert "packed_path" in d["attention"]


def test_renamed_checkpoint_matches_preset(capsys, renamed_checkpoint):
    by_dir = _json(capsys, ["--model", str(renamed_checkpoint), "--json"])
    by_preset = _json(capsys, ["--model", "tiny-qwen3_next", "--json"])
    for key in ("needs", "modeling_module", "mixer_classes", "uses"):
        assert by_dir["provision"]["architecture"][key] == by_preset["provision"]["architecture"][key]
    assert by_dir["mixers"] == by_preset["mixers"]
    assert by_dir["model"]["source"].startswith("checkpoint ")


def test_text_output(capsys):
    assert doctor.main(["--model", "tiny-qwen3_5"]) == 0
    out = capsys.readouterr().out
    assert "needs: causal_conv1d, fla" in out
    assert "3 x Qwen3_5GatedDeltaNet" in out
    assert "mixers, hybridtune train (patched):" in out
    assert "fast path:" in out


def test_without_model(capsys):
    assert doctor.main([]) == 0
    out = capsys.readouterr().out
    assert "packed attention:" in out and "--model" in out


def test_bad_model_is_one_line_exit_2(capsys):
    with pytest.raises(ModelError, match="neither a preset, a local checkpoint directory nor a hub id"):
        doctor.main(["--model", "tiny-qwen3.5"])
    assert cli.main(["doctor", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err


def test_compile_plan_is_reported(capsys):
    d = _json(capsys, ["--model", "tiny-qwen3_5", "--json"])
    plan = {p["class"]: p for p in d["compile_plan"]}
    assert plan["Qwen3_5GatedDeltaNet"]["decision"] == "routed"  # patched mixers run hybridtune ops
    assert plan["Qwen3_5ForCausalLM"]["decision"] == "eager"
    assert doctor.main(["--model", "tiny-qwen3_5"]) == 0
    assert "compile plan (`compile: modules`)" in capsys.readouterr().out


def test_git_commit_named_by_the_environment_wins(monkeypatch, caplog):
    """A tree copied to the GPU machine can carry a stale .git; the commit the runner names is the one recorded,
    with a warning when the tree's HEAD says otherwise."""
    from hybridtune.kernels.environment import git_commit

    monkeypatch.delenv("HYBRIDTUNE_GIT_COMMIT", raising=False)
    head = git_commit()
    assert head is None or len(head) == 40
    monkeypatch.setenv("HYBRIDTUNE_GIT_COMMIT", "0123abcd")
    with caplog.at_level("WARNING", logger="hybridtune.kernels.environment"):
        assert git_commit() == "0123abcd"
    assert ("differs from the tree's git HEAD" in caplog.text) == (head is not None)
    if head:
        caplog.clear()
        monkeypatch.setenv("HYBRIDTUNE_GIT_COMMIT", head[:7])
        assert git_commit() == head[:7] and "differs" not in caplog.text
