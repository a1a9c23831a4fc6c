"""report_to: the records of metrics.jsonl in TensorBoard's event files (read back with tensorboard's own reader)
and in a W&B offline run; a resumed run continues the step axis; a missing package is one line."""

from __future__ import annotations

import glob
import json
import struct
import time
from pathlib import Path

import pytest

from hybridtune.config import load_config
from hybridtune.errors import ConfigError
from hybridtune.train.trackers import samples_markdown
from train_runs import metrics_rows, run


def settings(out: Path, data: str, **kw) -> dict:
    return {
        "dataset": data,
        "sequence_len": 64,
        "val_set_size": 8,
        "max_steps": 4,
        "eval_steps": 2,
        "logging_steps": 1,
        "warmup_steps": 1,
        "device": "cpu",
        "output_dir": str(out),
        **kw,
    }


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = ea.EventAccumulator(str(logdir), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_file_holds_the_metrics(tmp_path, small_data):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    run(load_config(None, settings(out, small_data, report_to="tensorboard", run_name="tb", eval_samples=1)))
    logdir = out / "runs" / "tb"
    assert list(logdir.glob("events.out.tfevents.*"))
    got = tensorboard_scalars(logdir)
    want_train, want_eval = metrics_rows(out, "train"), metrics_rows(out, "eval")
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "step_loss"):
        assert got[f"train/{key}"] == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in want_train], key
    for key in ("eval_loss", "exact_match"):
        assert got[f"eval/{key}"] == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in want_eval], key
    # The eval samples as text, at each eval's step.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    text = acc.Tensors("eval/samples/text_summary")
    assert [e.step for e in text] == [r["step"] for r in want_eval]
    assert text[-1].tensor_proto.string_val[0].decode() == samples_markdown(want_eval[-1]["samples"])
    assert "| 4<\\|im_end\\|> |" in samples_markdown([{"prompt": "", "generated": "4<|im_end|>", "reference": ""}])


def test_tensorboard_resume_continues_the_step_axis(tmp_path, small_data):
    """A run stopped after step 3 with its newest checkpoint at step 2 (a kill's aftermath) resumes from step 2:
    the steps the first process logged past its checkpoint are logged again, and TensorBoard shows each step once,
    with the resumed run's values."""
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    cfg = settings(out, small_data, report_to="tensorboard", save_steps=2)
    first = run(load_config(None, cfg), stop_after=3)
    assert first.interrupted
    rest = run(load_config(None, {**cfg, "resume_from_checkpoint": str(out / "checkpoint-2"), "overwrite": True}))
    assert rest.steps == 4
    got = tensorboard_scalars(out / "runs" / "run")
    want = metrics_rows(out, "train")
    assert [r["step"] for r in want] == [1, 2, 3, 4]
    assert got["train/loss"] == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in want]


def test_a_fresh_run_replaces_the_earlier_event_files(tmp_path, small_data):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    cfg = load_config(None, settings(out, small_data, report_to="tensorboard", max_steps=2, eval_steps=0))
    run(cfg)
    run(cfg)  # the same command again: a fresh run, as metrics.jsonl starts empty
    assert len(list((out / "runs" / "run").glob("events.out.tfevents.*"))) == 1
    assert [s for s, _ in tensorboard_scalars(out / "runs" / "run")["train/loss"]] == [1, 2]


def wandb_history(run_dir: Path) -> tuple[list[dict], bool]:
    """The history rows of an offline W&B run (one per step: the records logged at one step are merged), read from
    its .wandb file (a LevelDB-style log of protobuf records after a 7-byte header; 32 KiB blocks, each record
    chunk: crc32, length, type, data), and whether the run's exit record is there yet."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(run_dir / "run-*.wandb"))
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, out, exited = 7, 32768, b"", [], False
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 or pos + 7 + length > len(data):  # zero fill, or a chunk the writer has not finished yet
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            try:
                record.ParseFromString(pending)
            except DecodeError:  # the service process is mid-write (seen in CI): not complete yet, read again
                return out, False
            if record.WhichOneof("record_type") == "exit":
                exited = True
            if record.WhichOneof("record_type") == "history":
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                out.append({**row, "_step": record.history.step.num})
    return out, exited


@pytest.mark.slow  # wandb runs its own service process
def test_wandb_offline_run_holds_the_metrics(tmp_path, small_data, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-home"))  # nothing outside the test's folder
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-home"))
    out = tmp_path / "run"
    run(load_config(None, settings(out, small_data, report_to="wandb", max_steps=3, eval_steps=0)))
    (run_dir,) = (out / "runs" / "wandb").glob("offline-run-*")
    # wandb's service process writes the file: finish() has been seen to return before the last records landed.
    deadline = time.monotonic() + 60
    while not (found := wandb_history(run_dir))[1] and time.monotonic() < deadline:
        time.sleep(0.5)
    history, exited = found
    assert exited
    train_rows = {r["_step"]: r for r in history if "train/loss" in r}
    want = metrics_rows(out, "train")
    assert sorted(train_rows) == [r["step"] for r in want] == [1, 2, 3]
    for r in want:
        assert train_rows[r["step"]]["train/loss"] == pytest.approx(r["loss"], rel=1e-6)
        assert train_rows[r["step"]]["train/lr"] == pytest.approx(r["lr"], rel=1e-6)
    evals = [r for r in history if "eval/eval_loss" in r]
    assert [r["_step"] for r in evals] == [0, 3]
    assert (out / "runs" / "run.wandb-id").read_text().strip() in run_dir.name


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_missing_tracker_package_is_one_line(monkeypatch, name):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == name else real(n, *a))
    with pytest.raises(ConfigError) as e:
        load_config(None, {"report_to": name})
    msg = str(e.value)
    assert "\n" not in msg and f"pip install 'hybridtune[{name}]'" in msg and f"'report_to' = '{name}'" in msg
