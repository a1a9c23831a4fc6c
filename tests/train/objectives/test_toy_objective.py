"""An objective is a unit: a toy objective with its own data shape, defined and registered in this file alone
(nothing in src/ names it), trains with `hybridtune train`, previews with `hybridtune data`, resumes exactly and
benches through the bench worker, on the CPU and the tiny preset.

The toy is pointwise and KTO-like: each row is a text with a good/bad label (`{"text": ..., "label": true}`), each
text its own document; a document's loss is -log sigmoid(beta * s * (its mean token log-probability - kappa)), s = +1
for a good text and -1 for a bad one, kappa the log-probability of a uniform guess; the window's loss is the mean
over its labelled documents, which its collator counts in a field of its own (`num_labelled`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from hybridtune.batch import CU_SEQ_LENS_Q, LABELS
from hybridtune.bench import worker
from hybridtune.bench.modes import parse_mode
from hybridtune.cli import main
from hybridtune.config import ObjectiveTraits, load_config
from hybridtune.data import IGNORE_INDEX, PackedCollator
from hybridtune.data.build import PreparedData
from hybridtune.data.packing import Example, PackStats, pack
from hybridtune.data.sources import open_source
from hybridtune.errors import ConfigError, DataError
from hybridtune.runtime import distributed
from hybridtune.runtime.step import model_inputs, shifted_targets
from hybridtune.train.objectives import ObjectiveSpec, check_keys, register_objective
from train_runs import make_cfg, metrics_rows, run

SIGN = "toy_sign"  # float [N]: +1 a good document, -1 a bad one, 0 a static layout's filler
NUM_LABELLED = "num_labelled"  # int: the pack's labelled documents


@dataclasses.dataclass
class Labelled(Example):
    good: bool = True
    where: str = ""
    text: str = ""


class LabelCollator(PackedCollator):
    def __call__(self, docs):
        batch = super().__call__(docs)
        n = batch[CU_SEQ_LENS_Q].numel() - 1
        batch[SIGN] = torch.tensor([1.0 if d.good else -1.0 for d in docs] + [0.0] * (n - len(docs)))
        batch[NUM_LABELLED] = len(docs)
        return batch


@dataclasses.dataclass
class PointwiseKTO:
    beta: float = 1.0
    name: str = "toy"
    batch_keys: frozenset = frozenset({LABELS, SIGN, NUM_LABELLED})
    needs_reference: bool = False
    needs_generation: bool = False
    sums: dict = dataclasses.field(default_factory=dict)

    def window_items(self, batches):
        self.sums = {}
        return sum(b[NUM_LABELLED] for b in batches)

    def loss(self, model, batch, num_items):
        kwargs = model_inputs(batch)
        targets = shifted_targets(kwargs.pop(LABELS))
        logits = model(**kwargs).logits.float()
        logp = torch.log_softmax(logits.reshape(-1, logits.shape[-1]), dim=-1)
        valid = targets != IGNORE_INDEX
        tok = torch.where(valid, logp.gather(1, targets.clamp(min=0)[:, None])[:, 0], 0.0)
        cu = batch[CU_SEQ_LENS_Q]
        doc = torch.searchsorted(cu[1:].long(), torch.arange(tok.shape[0], device=tok.device), right=True)
        n = cu.numel() - 1
        mean = tok.new_zeros(n).index_add(0, doc, tok) / tok.new_zeros(n).index_add(0, doc, valid.float()).clamp(min=1)
        sign = batch[SIGN].to(mean)
        per_doc = -F.logsigmoid(self.beta * sign * (mean + math.log(logits.shape[-1]))) * (sign != 0)
        good = (sign > 0).to(mean)
        for key, value in (("good_logp", (mean * good).sum()), ("good", good.sum()),
                           ("bad_logp", (mean * (sign < 0)).sum()), ("bad", (sign < 0).sum())):  # fmt: skip
            self.sums[key] = self.sums.get(key, 0) + value.detach().double()
        return per_doc.sum() / max(num_items, 1)

    def step_metrics(self, d=distributed.ONE):
        if not self.sums:
            return {}
        names = list(self.sums)
        got = dict(zip(names, distributed.all_sum_(torch.stack([self.sums[k] for k in names]), d).tolist()))
        self.sums = {}
        means = {"logps/good": ("good_logp", "good"), "logps/bad": ("bad_logp", "bad")}
        return {name: got[s] / got[n] for name, (s, n) in means.items() if got[n]}  # (a step may hold one kind)


@dataclasses.dataclass
class LabelledRows:
    docs: list[Labelled]

    def train_lengths(self):
        return [len(d) for d in self.docs]


def load_labelled(cfg, tokenizer, vision=None) -> LabelledRows:
    docs = []
    for ds in cfg.resolved_datasets():
        for where, row in open_source(ds).rows():
            if not isinstance(row.get("label"), bool):
                raise DataError(f"{where}: objective toy reads a 'text' and a true/false 'label'")
            ids = tokenizer(row["text"])["input_ids"]
            docs.append(Labelled(ids, [1] * len(ids), good=row["label"], where=where, text=row["text"]))
    return LabelledRows(docs)


def prepare_labelled(cfg, tokenizer, loaded: LabelledRows) -> PreparedData:
    seq_len = cfg.sequence_len
    docs = [
        dataclasses.replace(d, input_ids=d.input_ids[:seq_len], loss_mask=d.loss_mask[:seq_len]) for d in loaded.docs
    ]
    bins = [[docs[i] for i in b] for b in pack(docs, seq_len)]
    n, tokens = len(docs), sum(map(len, docs))
    stats = PackStats(examples_in=n, examples_packed=n, bins=len(bins), tokens=tokens, capacity=len(bins) * seq_len)
    return PreparedData(bins, [], stats, [], [], seq_len)


def preview_labelled(cfg, tokenizer, vision, rows, out) -> PreparedData:
    loaded = load_labelled(cfg, tokenizer, vision)
    print(f"labelled rows for {cfg.base_model}'s tokenizer (objective toy)", file=out)
    for d in loaded.docs[:rows]:
        print(f"--- {d.where}: {'good' if d.good else 'bad'}, {len(d)} tokens\n{d.text}", file=out)
    good = sum(d.good for d in loaded.docs)
    print(f"rows: {len(loaded.docs)} ({good} good, {len(loaded.docs) - good} bad)", file=out)
    return prepare_labelled(cfg, tokenizer, loaded)


def bench_labelled(seq_len, layouts, vocab_size, seed):
    rng = random.Random(seed)
    return [[Labelled([rng.randrange(1, vocab_size) for _ in range(n)], [1] * n, good=rng.random() < 0.5)
             for n in lens] for lens in layouts]  # fmt: skip


TOY = register_objective(
    ObjectiveSpec(
        ObjectiveTraits("toy", keys=("beta",)), lambda cfg, fused, model=None: PointwiseKTO(beta=cfg.beta),
        load=load_labelled, prepare=prepare_labelled, collator=lambda data: LabelCollator, preview=preview_labelled,
        bench_packs=bench_labelled,
    )
)  # fmt: skip


@pytest.fixture(scope="module")
def labelled(tmp_path_factory) -> str:
    """Numbers called fine (good) or awful (bad): what a good text looks like is learnable."""
    rng = random.Random(3)
    rows = [{"text": f"{rng.randrange(100)} is {'fine' if i % 2 == 0 else 'awful'}", "label": i % 2 == 0}
            for i in range(64)]  # fmt: skip
    path = tmp_path_factory.mktemp("toy") / "labelled.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def toy_cfg(out, data, **kw):
    keys = dict(objective="toy", val_set_size=0, sequence_len=64, lora_dropout=0.1, gradient_accumulation_steps=2)
    return make_cfg(out, data, **{**keys, **kw})


def test_the_toy_trains_with_hybridtune_train(tmp_path, labelled, capsys):
    out = tmp_path / "run"
    argv = ["train", "--objective", "toy", "--dataset", labelled, "--output_dir", str(out), "--max_steps", "16",
            "--sequence_len", "64", "--val_set_size", "0", "--logging_steps", "1", "--adapter", "full",
            "--learning_rate", "3e-3", "--gradient_accumulation_steps", "1", "--beta", "2.0"]  # fmt: skip
    assert main(argv) == 0
    rows = metrics_rows(out, "train")
    losses = [r["loss"] for r in rows]
    assert len(losses) == 16 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses  # falling
    good, bad = ([r[k] for r in rows if k in r] for k in ("logps/good", "logps/bad"))  # its own metrics
    assert len(good) > 2 and len(bad) > 2 and good[-1] > good[0] and bad[-1] < bad[0], (good, bad)
    assert (out / "final").is_dir()


def test_the_toy_previews_with_hybridtune_data(labelled, capsys):
    assert main(["data", "--objective", "toy", "--dataset", labelled, "--rows", "2", "--sequence_len", "64"]) == 0
    shown = capsys.readouterr().out
    assert "labelled rows for" in shown and "rows: 64 (32 good, 32 bad)" in shown
    assert "labelled.jsonl:1: good" in shown and "labelled.jsonl:2: bad" in shown and "labelled.jsonl:3" not in shown


def test_the_toy_resumes_equal_to_an_uninterrupted_run(tmp_path, labelled):
    torch.use_deterministic_algorithms(True)
    try:
        full = run(toy_cfg(tmp_path / "a", labelled))
        part = run(toy_cfg(tmp_path / "b", labelled), stop_after=3)
        assert part.interrupted and part.steps == 3
        rest = run(toy_cfg(tmp_path / "b", labelled, resume_from_checkpoint="latest"))
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(full.losses) == 8 and len(rest.losses) == 5
    assert max(abs(a - b) for a, b in zip(full.losses, part.losses + rest.losses)) < 1e-6
    a, b = (load_file(f"{r.final_dir}/model.safetensors") for r in (full, rest))  # (a preset: merged)
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_the_toy_benches_through_the_bench_worker():
    assert parse_mode("ht-eager:objective=toy").objective == "toy"
    spec = {"kind": "mode", "mode": "ht-eager:objective=toy", "preset": "tiny-qwen3_5", "seq_len": 64, "layouts": 2,
            "seed": 0, "warmup": 1, "steps": 2, "adapter": "lora", "lora_r": 4, "lr": 1e-3,
            "lora_targets": ["q_proj", "v_proj"]}  # fmt: skip
    result = worker.run_mode(spec)
    assert len(result["losses"]) == 3 and all(math.isfinite(x) for x in result["losses"])
    assert result["median_step_s"] > 0 and "reference_flops_per_step" not in result  # (no reference: none charged)


def test_the_toy_owns_its_config_keys():
    with pytest.raises(ConfigError, match="'num_generations' is set but means nothing for objective 'toy'"):
        check_keys(load_config(None, {"objective": "toy", "num_generations": 4}))
    with pytest.raises(ConfigError, match=r"'beta' is set but means nothing for objective 'sft' \(it is for .* toy\)"):
        check_keys(load_config(None, {"beta": 0.5}))
    with pytest.raises(ConfigError, match="config key 'objective' = 'tyo' must be one of: .*toy. Did you mean 'toy'"):
        load_config(None, {"objective": "tyo"})
