"""Every data source gives the same examples as the JSONL it was made from: JSON array, JSON lines, CSV, Parquet,
Arrow (a file and a save_to_disk directory), a glob, a local dataset repository with configs and splits, and a
dataset id served offline from the datasets cache; bad rows name their file and line or row."""

from __future__ import annotations

import glob
import json
import shutil
from pathlib import Path

import datasets
import pytest

from hybridtune.config import DatasetConfig
from hybridtune.data.examples import load_examples
from hybridtune.data.sources import open_source, read_rows
from hybridtune.errors import DataError
from hybridtune.models.tokenizer_files import bundled_tokenizer


@pytest.fixture(scope="module")
def tok():
    return bundled_tokenizer()


@pytest.fixture(autouse=True)
def _own_datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))


def chats(n: int, start: int = 0) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"{i} + 1 ="},
                {"role": "assistant", "content": str(i + 1)},
                {"role": "user", "content": f"{i} + 2 ="},
                {"role": "assistant", "content": str(i + 2)},
            ]
        }
        for i in range(start, start + n)
    ]


def alpacas(n: int) -> list[dict]:
    return [
        {"instruction": f"Add {i} and 1", "input": "" if i % 2 else f"{i} 1", "output": str(i + 1)} for i in range(n)
    ]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def ids(examples) -> list[tuple[list[int], list[int]]]:
    return [(e.input_ids, e.loss_mask) for e in examples]


def load(path, tok, **kw):
    return ids(load_examples(DatasetConfig(path=str(path), **kw), tok, cache=False))


def test_json_csv_parquet_arrow_and_globs_give_the_jsonl_examples(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for rows in (chats(12), alpacas(12)):
        d = tmp_path / ("chat" if "messages" in rows[0] else "alpaca")
        d.mkdir()
        want = load(write_jsonl(d / "d.jsonl", rows), tok)
        assert len(want) == 12 and all(any(m) for _, m in want)
        (d / "array.json").write_text(json.dumps(rows, indent=2))  # a JSON array over many lines
        write_jsonl(d / "lines.json", rows)
        pq.write_table(pa.Table.from_pylist(rows), d / "d.parquet")
        datasets.Dataset.from_list(rows).save_to_disk(str(d / "saved"))
        shutil.copy(glob.glob(str(d / "saved" / "*.arrow"))[0], d / "d.arrow")
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(d / "saved_dict"))
        write_jsonl(d / "part-0.jsonl", rows[:5])
        write_jsonl(d / "part-1.jsonl", rows[5:])
        for name in ("array.json", "lines.json", "d.parquet", "saved", "d.arrow", "saved_dict", "part-*.jsonl"):
            assert load(d / name, tok) == want, name
        if "instruction" in rows[0]:  # flat rows: CSV too (an empty cell is no input, as "" is)
            with (d / "d.csv").open("w", newline="") as f:
                import csv

                w = csv.DictWriter(f, ["instruction", "input", "output"])
                w.writeheader()
                w.writerows(rows)
            assert load(d / "d.csv", tok) == want
            # pandas' to_csv writes its index as a first column without a name; a TSV is tab-separated.
            lines = (d / "d.csv").read_text().splitlines()
            (d / "i.csv").write_text("".join(f"{'' if k == 0 else k - 1},{ln}\n" for k, ln in enumerate(lines)))
            assert load(d / "i.csv", tok) == want
            datasets.Dataset.from_list(rows).to_csv(str(d / "d.tsv"), sep="\t", index=False)
            assert load(d / "d.tsv", tok) == want


def test_bad_rows_name_file_and_line_or_row(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = alpacas(4)
    rows[2]["output"] = None
    (tmp_path / "a.json").write_text(json.dumps(rows, indent=1))
    line = json.dumps(rows, indent=1).splitlines().index('  "output": null') + 1 - 3  # the object's opening line
    with pytest.raises(DataError, match=rf"a\.json:{line}: alpaca row has field 'output' but it is null"):
        load(tmp_path / "a.json", tok)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    with pytest.raises(DataError, match=r"a\.parquet:row 3: alpaca row has field 'output' but it is null"):
        load(tmp_path / "a.parquet", tok)
    (tmp_path / "a.csv").write_text("instruction,input,output\nAdd,1 2,3\nAdd,,\n")
    with pytest.raises(DataError, match=r"a\.csv:row 2: alpaca row has field 'output' but it is null"):
        load(tmp_path / "a.csv", tok)
    (tmp_path / "a.csv").write_text("instruction,output\nAdd,3\nAdd,4,5,6\n")
    with pytest.raises(DataError, match=r"a\.csv: cannot read as CSV \(.*line 3.*\); check the file"):
        load(tmp_path / "a.csv", tok)
    # A glob names the file the row is in.
    write_jsonl(tmp_path / "p-0.jsonl", alpacas(3))
    write_jsonl(tmp_path / "p-1.jsonl", [*alpacas(1), {"instruction": "x"}])
    with pytest.raises(DataError, match=r"p-1\.jsonl:2: alpaca row has no field 'output'"):
        load(tmp_path / "p-*.jsonl", tok, type="alpaca")
    # JSON arrays: malformed text and items that are not objects.
    (tmp_path / "b.json").write_text('[\n {"text": "a"},\n {"text": "b"} {"text": "c"}\n]\n')
    with pytest.raises(DataError, match=r"b\.json:3: malformed JSON \(Expecting ',' delimiter at column 16\)"):
        list(read_rows(str(tmp_path / "b.json")))
    (tmp_path / "b.json").write_text('[{"text": "a"},\n 5]')
    with pytest.raises(DataError, match=r"b\.json:2: item 2 of the JSON array is not an object"):
        list(read_rows(str(tmp_path / "b.json")))
    with pytest.raises(DataError, match=r"dataset glob '.*nothing-\*\.jsonl' matches no file"):
        load(tmp_path / "nothing-*.jsonl", tok)
    (tmp_path / "d.txt").write_text("hi\n")
    with pytest.raises(DataError, match=r"d\.txt: unsupported file type '\.txt'; give a JSONL, JSON, CSV"):
        load(tmp_path / "d.txt", tok)


def _repo(root, configs: dict[str, dict[str, list[dict]]]):
    """A dataset repository as on the hub: data files per config and split, and a README naming them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    card = ["---", "configs:"]
    for config, splits in configs.items():
        card += [f"- config_name: {config}", "  data_files:"]
        for split, rows in splits.items():
            (root / config).mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pylist(rows), root / config / f"{split}-00000-of-00001.parquet")
            card += [f"  - split: {split}", f"    path: {config}/{split}-*.parquet"]
    (root / "README.md").write_text("\n".join([*card, "---", "a test dataset", ""]))
    return root


def test_local_dataset_repository_with_configs_and_splits(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    repo = _repo(
        tmp_path / "repo",
        {"easy": {"train": chats(6), "test": chats(3, 100)}, "hard": {"train": chats(5, 200), "test": chats(2, 300)}},
    )
    want = load(write_jsonl(tmp_path / "hard-test.jsonl", chats(2, 300)), tok)
    assert load(repo, tok, name="hard", split="test") == want
    assert len(load(repo, tok, name="easy")) == 6  # split defaults to train
    with pytest.raises(DataError, match=r"dataset directory '.*repo' \(split 'validation'\) cannot be loaded \("):
        load(repo, tok, name="hard", split="validation")


def _datasets_cache_as_downloaded(tmp_path, repo_id: str, splits: dict[str, list[dict]]) -> None:
    """Lay out HF_DATASETS_CACHE as `load_dataset(repo_id)` leaves it after a download: the prepared Arrow files
    under <org>___<name>/<config>/<version>/<hash>/ (built here from a local repository of the same files)."""
    name = repo_id.split("/")[1]
    repo = _repo(tmp_path / name, {"default": splits})
    builder = datasets.load_dataset_builder(str(repo), cache_dir=str(tmp_path / "build"))
    builder.download_and_prepare()
    (built,) = [p for p in glob.glob(str(tmp_path / "build" / name / "*" / "*" / "*")) if Path(p).is_dir()]
    org = repo_id.split("/")[0]
    dst = tmp_path / "hf-datasets" / f"{org}___{name}" / "default" / "0.0.0" / "0123456789abcdef"
    shutil.copytree(built, dst)
    assert glob.glob(str(dst / f"{name}-*.arrow"))  # the files carry the dataset's name, as a download's do


def test_dataset_id_from_the_datasets_cache_offline(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # as the variable does when set before import
    _datasets_cache_as_downloaded(tmp_path, "someorg/arith", {"train": chats(7), "test": chats(4, 50)})
    monkeypatch.chdir(tmp_path)  # no local someorg/arith: the name is an id
    want = load(write_jsonl(tmp_path / "t.jsonl", chats(4, 50)), tok)
    assert load("someorg/arith", tok, split="test") == want
    assert len(load("someorg/arith", tok)) == 7
    src = open_source(DatasetConfig(path="someorg/arith", split="test"))
    assert src.where(2) == "someorg/arith[test]:row 3"
    # Not cached, downloads off: one line saying so and what to do.
    with pytest.raises(DataError) as e:
        load("someorg/other", tok)
    msg = str(e.value)
    assert "'someorg/other' (split 'train') is not a local file or directory" in msg and "\n" not in msg
    assert "not in the datasets cache" in msg and "HF_DATASETS_OFFLINE" in msg and "give a local file" in msg


def test_test_datasets_replace_the_val_split(tok, tmp_path):
    from hybridtune.config import TrainConfig
    from hybridtune.data.build import prepare

    train = write_jsonl(tmp_path / "train.jsonl", chats(20))
    test = write_jsonl(tmp_path / "test.jsonl", chats(3, 500))
    cfg = TrainConfig(
        datasets=[DatasetConfig(path=str(train))],
        test_datasets=[DatasetConfig(path=str(test))],
        val_set_size=0.5,
        sample_packing=False,
    )
    data = prepare(cfg, tok)
    assert len(data.bins) == 20  # nothing of the training data held out
    assert ids(data.eval_examples) == load(test, tok)
    cfg.test_datasets = []
    assert len(prepare(cfg, tok).bins) == 10


def test_a_second_prepare_is_served_from_the_cache(tok, tmp_path, monkeypatch, caplog):
    import logging

    from hybridtune.data import examples as ex_mod

    path = write_jsonl(tmp_path / "d.jsonl", chats(30))
    ds = DatasetConfig(path=str(path))
    from hybridtune.data import sources

    calls, reads = [], []
    real, real_read = ex_mod.to_example, sources.read_json_file
    monkeypatch.setattr(ex_mod, "to_example", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(sources, "read_json_file", lambda *a: reads.append(1) or real_read(*a))
    with caplog.at_level(logging.INFO, logger="hybridtune"):
        first = load_examples(ds, tok, num_proc=1)
        assert len(calls) == 30 and "tokenised 30 examples in" in caplog.text
        caplog.clear()
        second = load_examples(ds, tok, num_proc=1)
    assert len(calls) == 30, "the second load tokenised again"
    assert len(reads) == 1, "the second load parsed the file again (its hash is all a cache hit needs)"
    assert "tokenised data from cache" in caplog.text and "format 'chat'" in caplog.text and ids(second) == ids(first)
    cached = glob.glob(str(tmp_path / "hf-datasets" / "hybridtune-tokenised" / "*.parquet"))
    assert len(cached) == 1
    # Another setting, other content or another chat template: tokenised again (one more cache file each).
    load_examples(ds, tok, train_on_inputs=True)
    assert len(calls) == 60
    write_jsonl(path, chats(30, 1))
    load_examples(ds, tok)
    assert len(calls) == 90
    import copy

    other = copy.deepcopy(tok)
    other.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ")
    load_examples(ds, other)
    assert len(calls) == 120
    assert len(glob.glob(str(tmp_path / "hf-datasets" / "hybridtune-tokenised" / "*.parquet"))) == 4
    # A damaged cache file is tokenised again and replaced, with a warning.
    open(cached[0], "wb").write(b"not parquet")
    write_jsonl(path, chats(30))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hybridtune"):
        assert ids(load_examples(ds, tok)) == ids(first)
    assert len(calls) == 150 and "is unreadable" in caplog.text
    load_examples(ds, tok)
    assert len(calls) == 150


def test_two_processes_give_the_same_examples_and_the_first_error(tok, tmp_path):
    rows = chats(600)
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    one = load(path, tok, type="chat")
    two = ids(load_examples(DatasetConfig(path=str(path), type="chat"), tok, num_proc=2, cache=False))
    assert one == two and len(one) == 600
    rows[3]["messages"][1]["content"] = None
    rows[500]["messages"][0]["role"] = "wizard"
    write_jsonl(path, rows)
    with pytest.raises(DataError, match=r"d\.jsonl:4: message 1 \(role 'assistant'\), key 'content'.*got null"):
        load_examples(DatasetConfig(path=str(path)), tok, num_proc=2, cache=False)
