"""The run's curves (run/plots.py): loss.png, reward.png (grpo) and reward_accuracy.png (dpo) drawn from metrics.jsonl
at each save and at the end of a run, written whole, and a drawing failure one warning line that never stops a run."""

from __future__ import annotations

import json
import logging
import random

import pytest
from PIL import Image

from hybridtune.errors import TrainingDiverged
from hybridtune.run import plots
from hybridtune.run.plots import ACCURACY_PLOT, LOSS_PLOT, REWARD_PLOT, curves, plot_run
from train_runs import make_cfg, metrics_rows, run


def write_rows(out, rows) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def drawn(path) -> Image.Image:
    """The PNG at `path`, checked to be a whole image with something drawn on it."""
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = Image.open(path)
    img.load()
    assert img.width > 300 and img.height > 200
    assert len(img.convert("L").getcolors(maxcolors=1 << 16) or []) > 2, "a blank image"
    return img


def test_each_curve_holds_exactly_the_logged_values(tmp_path):
    rng = random.Random()
    steps = sorted(rng.sample(range(1, 500), rng.randrange(7, 40)))
    train = [{"type": "train", "step": s, "loss": rng.uniform(0.1, 9), "reward": rng.random(),
              "rewards/exact_answer/mean": rng.random(), "rewards/format/mean": rng.random(),
              "rewards/accuracies": rng.random(), "rewards/margins": rng.gauss(0, 1)} for s in steps]  # fmt: skip
    train[rng.randrange(len(train))]["loss"] = float("nan")  # a non-finite value is left out, never drawn
    evals = [{"type": "eval", "step": s, "eval_loss": rng.uniform(0.1, 9)} for s in steps[:: rng.randrange(2, 5)]]
    rows = train + evals
    rng.shuffle(rows)
    rows.sort(key=lambda r: r["step"])
    got = curves(rows)
    assert set(got) == {LOSS_PLOT, REWARD_PLOT, ACCURACY_PLOT}

    def pts(key, kind="train"):
        return [(r["step"], r[key]) for r in rows if r["type"] == kind and r[key] == r[key]]

    label, lines = got[LOSS_PLOT]
    assert [name for name, *_ in lines] == ["train loss", "eval loss"]
    assert list(zip(*lines[0][1:])) == pts("loss") and list(zip(*lines[1][1:])) == pts("eval_loss", "eval")
    names = [name for name, *_ in got[REWARD_PLOT][1]]
    assert names == ["mean reward", "exact_answer", "format"]  # each reward function beside the mean
    assert list(zip(*got[ACCURACY_PLOT][1][0][1:])) == pts("rewards/accuracies")


def test_an_sft_run_gets_loss_png_only_and_a_single_reward_function_no_second_line(tmp_path):
    rng = random.Random()
    n = rng.randrange(3, 20)
    write_rows(tmp_path / "sft", [{"type": "train", "step": s, "loss": rng.uniform(1, 5)} for s in range(1, n)])
    assert [p.name for p in plot_run(tmp_path / "sft")] == [LOSS_PLOT]
    drawn(tmp_path / "sft" / LOSS_PLOT)
    assert not (tmp_path / "sft" / REWARD_PLOT).exists() and not (tmp_path / "sft" / ACCURACY_PLOT).exists()
    grpo = [{"type": "train", "step": s, "loss": 0.0, "reward": rng.random(), "rewards/exact_answer/mean": rng.random()}
            for s in range(1, n)]  # fmt: skip
    assert [name for name, *_ in curves(grpo)[REWARD_PLOT][1]] == ["mean reward"]


def test_nothing_logged_yet_draws_nothing_and_says_nothing(tmp_path, caplog):
    (tmp_path / "empty").mkdir()
    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        assert plot_run(tmp_path / "empty") == []
        write_rows(tmp_path / "evalonly", [{"type": "eval", "step": 0, "eval_loss": 2.5}])  # max_steps 0
        assert plot_run(tmp_path / "evalonly") == []
    assert not caplog.records and not list((tmp_path / "empty").iterdir())


def test_a_torn_line_is_skipped_and_a_link_at_the_name_is_replaced_not_followed(tmp_path):
    out = tmp_path / "run"
    write_rows(out, [{"type": "train", "step": s, "loss": 3.0 / s} for s in range(1, 9)])
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"type": "train", "step": 9, "lo')  # a kill mid-write
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    (out / LOSS_PLOT).symlink_to(victim)
    assert plot_run(out) == [out / LOSS_PLOT]
    assert victim.read_text() == "mine" and not (out / LOSS_PLOT).is_symlink()
    drawn(out / LOSS_PLOT)


def test_a_failure_is_one_warning_once_and_never_raises(tmp_path, caplog, monkeypatch):
    out = tmp_path / "run"
    write_rows(out, [{"type": "train", "step": s, "loss": 1.0} for s in range(1, 5)])

    def boom(*a, **k):
        raise RuntimeError("no font")

    monkeypatch.setattr(plots, "draw", boom)
    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        assert plot_run(out) == [] and plot_run(out) == []
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "no font" in said[0] and "\n" not in said[0], said


def test_a_run_writes_loss_png_at_a_save_and_at_the_end(tmp_path, small_data, caplog, monkeypatch):
    out = tmp_path / "run"
    cfg = make_cfg(out, small_data, max_steps=6, save_steps=2, eval_steps=3, lora_dropout=0.0)
    seen = []
    real = plots.plot_run

    def spy(where):
        written = real(where)
        seen.append(max(r["step"] for r in metrics_rows(out, "train")))
        return written

    monkeypatch.setattr("hybridtune.train.trainer.plot_run", spy)
    assert run(cfg).final_dir
    assert seen == [2, 4, 6, 6]  # each save (2, 4, the last step's) and after the final eval
    drawn(out / LOSS_PLOT)
    # Another run over it (--overwrite) counts the curves as the earlier run's own files, not the user's.
    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        assert run(make_cfg(out, small_data, max_steps=3, lora_dropout=0.0, overwrite=True)).final_dir
    said = [r.getMessage() for r in caplog.records if "holds another run" in r.getMessage()]
    assert len(said) == 1 and "not hybridtune's" not in said[0], said


def test_a_run_whose_curves_fail_finishes_with_one_warning(tmp_path, small_data, caplog, monkeypatch):
    monkeypatch.setattr(plots, "draw", lambda *a, **k: 1 / 0)
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        res = run(make_cfg(out, small_data, max_steps=3, save_steps=1, lora_dropout=0.0))
    assert res.steps == 3 and res.final_dir
    said = [r.getMessage() for r in caplog.records if "could not draw" in r.getMessage()]
    assert len(said) == 1 and "ZeroDivisionError" in said[0]
    assert not (out / LOSS_PLOT).exists()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> str:
    rng = random.Random()
    rows = []
    for _ in range(40):
        a, b = rng.randrange(50), rng.randrange(50)
        rows.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + rng.choice([-1, 1, 10]))})
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_dpo_run_draws_its_reward_accuracy(tmp_path, pairs):
    out = tmp_path / "dpo"
    assert run(make_cfg(out, pairs, objective="dpo", max_steps=3, sequence_len=128, lora_dropout=0.0)).final_dir
    drawn(out / LOSS_PLOT)
    drawn(out / ACCURACY_PLOT)
    assert not (out / REWARD_PLOT).exists()


def test_a_grpo_run_draws_its_reward(tmp_path):
    rng = random.Random()
    rows = [
        {"prompt": f"{a}+{b}=", "answer": str(a + b)}
        for a, b in ((rng.randrange(5), rng.randrange(5)) for _ in range(8))
    ]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "grpo"
    cfg = make_cfg(out, str(tmp_path / "prompts.jsonl"), objective="grpo", max_steps=2, reward_funcs=["exact_answer"],
                   num_generations=2, max_completion_length=4, micro_batch_size=2, gradient_accumulation_steps=1,
                   val_set_size=0, lora_dropout=0.0)  # fmt: skip
    assert run(cfg).final_dir
    drawn(out / REWARD_PLOT)
    drawn(out / LOSS_PLOT)


def test_a_run_that_diverges_leaves_the_curve_up_to_it(tmp_path, small_data):
    """A non-finite loss stops the run (exit 3) before any save: the curve of the steps it logged is what shows why."""
    out = tmp_path / "run"
    with pytest.raises(TrainingDiverged):
        run(make_cfg(out, small_data, learning_rate=1e6, max_steps=6, warmup_steps=0, lora_dropout=0.0))
    assert not list(out.glob("checkpoint-*")) and metrics_rows(out, "train")
    drawn(out / LOSS_PLOT)
