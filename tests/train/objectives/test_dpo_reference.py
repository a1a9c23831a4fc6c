"""The preference objectives on packed pairs against a direct implementation of TRL's formulas on the unpacked pairs
(fp32, the tiny Qwen3.5 preset): loss, every trainable gradient and the metrics, under LoRA and a full fine-tune,
packed and one pair a pack, dynamic and static layout, through the engine (`LossModule`) with gradient accumulation.

The reference side runs each document alone through `model(input_ids=...)` (transformers' forward, full logits) and
takes the reference model's log-probabilities from a separately loaded, unpatched base model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from objective_grads import grads

from hybridtune.config import load_config
from hybridtune.data.collator import StaticLayout
from hybridtune.data.pairs import Pair, PairCollator, pack_pairs
from hybridtune.models.hub import resolve_source
from hybridtune.models.loading import load_model, tokenizer_for
from hybridtune.runtime.distributed import LossModule
from hybridtune.runtime.model import build_model
from hybridtune.train.objectives import build_objective
from hybridtune.train.objectives.preference import pair_logps, reference_logps

SEED = 3


def make_pairs(n: int = 6, seed: int = 0, vocab: int = 400) -> list[Pair]:
    """Pairs of random tokens: a shared untrained prompt, then a trained reply of its own length per side."""
    g = torch.Generator().manual_seed(seed)

    def ints(lo, hi, k=None):
        return torch.randint(lo, hi, (k,) if k else (1,), generator=g).tolist()

    pairs = []
    for _ in range(n):
        prompt = ints(0, vocab, ints(3, 12)[0])
        chosen, rejected = ints(0, vocab, ints(2, 9)[0]), ints(0, vocab, ints(2, 9)[0])
        c, r = prompt + chosen, prompt + rejected
        mask = [0] * len(prompt)
        pairs.append(
            Pair(input_ids=c + r, loss_mask=mask + [1] * len(chosen) + mask + [1] * len(rejected), split=len(c))
        )
    return pairs


def build(adapter: str, objective: str, fused: bool = True, **keys):
    """(policy, objective, trainable parameters, tokenizer): the run's model as `train` builds it, the objective
    built from it (a full fine-tune's dpo copies it as its reference), then the policy moved off its start."""
    cfg = load_config(
        None,
        {"base_model": "tiny-qwen3_5", "adapter": adapter, "lora_dropout": 0.0, "seed": SEED, "objective": objective,
         **keys},
    )  # fmt: skip
    tok = tokenizer_for("tiny-qwen3_5")
    torch.manual_seed(SEED)  # (peft draws LoRA's A from the global generator)
    model = build_model(cfg, resolve_source(cfg.base_model), tok, torch.device("cpu"), bf16=False).model
    obj = build_objective(cfg, fused, model)
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in params:  # LoRA's B starts at zero: the policy would equal its reference
            p.add_(torch.randn(p.shape, generator=g) * (0.05 if adapter == "lora" else 0.01))
    return model, obj, params, tok


def doc_logps(model, ids: list[int], mask: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probability of a document's trained tokens and their count: one document, full logits."""
    x = torch.tensor([ids])
    logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), dim=-1)
    picked = logp.gather(1, x[0, 1:, None])[:, 0]
    m = torch.tensor(mask[1:], dtype=torch.float32)
    return (picked * m).sum(), m.sum()


def trl_reference(model, base, pairs, kind, beta=0.1, loss_type="sigmoid", ls=0.0, rpo_alpha=None, gamma=0.5):
    """TRL's loss and metrics for these pairs, written from the DPO / IPO / cDPO / SimPO / ORPO formulas."""
    pc, pr, lc, lr, rc, rr = ([] for _ in range(6))
    for p in pairs:
        c, r = p.docs()
        for (lp, n), out, count in ((doc_logps(model, c.input_ids, c.loss_mask), pc, lc),
                                    (doc_logps(model, r.input_ids, r.loss_mask), pr, lr)):  # fmt: skip
            out.append(lp)
            count.append(n)
        if kind == "dpo":
            with torch.no_grad():
                rc.append(doc_logps(base, c.input_ids, c.loss_mask)[0])
                rr.append(doc_logps(base, r.input_ids, r.loss_mask)[0])
    pc, pr, lc, lr = map(torch.stack, (pc, pr, lc, lr))
    nll = -pc.sum() / lc.sum()  # the chosen replies' token-mean NLL
    averaged = kind in ("simpo", "orpo") or loss_type == "ipo"
    if averaged:
        pc, pr = pc / lc, pr / lr
    metrics = {}
    if kind == "dpo":
        rc, rr = torch.stack(rc), torch.stack(rr)
        if averaged:
            rc, rr = rc / lc, rr / lr
        logits = (pc - pr) - (rc - rr)
        if loss_type == "sigmoid":
            losses = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
        elif loss_type == "robust":
            losses = (-F.logsigmoid(beta * logits) * (1 - ls) + F.logsigmoid(-beta * logits) * ls) / (1 - 2 * ls)
        elif loss_type == "hinge":
            losses = torch.relu(1 - beta * logits)
        else:  # ipo
            losses = (logits - 1 / (2 * beta)) ** 2
        chosen_r, rejected_r = beta * (pc - rc), beta * (pr - rr)
        loss = losses.mean()
    elif kind == "simpo":
        logits = (pc - pr) - gamma / beta
        losses = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
        chosen_r, rejected_r = beta * pc, beta * pr
        loss = losses.mean()
    else:  # orpo
        log_odds = (pc - pr) - (torch.log1p(-torch.exp(pc)) - torch.log1p(-torch.exp(pr)))
        ratio = F.logsigmoid(log_odds)
        chosen_r, rejected_r = beta * pc, beta * pr
        loss = nll - (beta * ratio).mean()
        metrics |= {"log_odds_ratio": ratio.mean(), "log_odds_chosen": log_odds.mean(), "nll_loss": nll}
    if rpo_alpha is not None:
        loss = loss + rpo_alpha * nll
        metrics["nll_loss"] = nll
    chosen_r, rejected_r = chosen_r.detach(), rejected_r.detach()
    metrics |= {
        "rewards/chosen": chosen_r.mean(),
        "rewards/rejected": rejected_r.mean(),
        "rewards/accuracies": (chosen_r > rejected_r).float().mean(),
        "rewards/margins": (chosen_r - rejected_r).mean(),
        "logps/chosen": pc.detach().mean(),
        "logps/rejected": pr.detach().mean(),
    }
    return loss, {k: float(v.detach()) for k, v in metrics.items()}


def ours(model, obj, pairs, packed: bool, static: bool = False, seq_len: int = 64):
    """The objective's window over the packs of `pairs` through the engine: (loss, step metrics)."""
    bins = pack_pairs(pairs, seq_len, packing=packed)
    assert len(bins) > 1  # a window of several micro-batches
    if packed:
        assert max(len(b) for b in bins) > 2  # several pairs in a pack
    layout = StaticLayout.fit([[len(d) for d in b] for b in bins]) if static else None
    collate = PairCollator(layout=layout)
    batches = [collate(b) for b in bins]
    n = obj.window_items(batches)
    assert n == len(pairs)
    engine = LossModule(model, obj)
    total = sum(engine(b, n) for b in batches)
    return total, obj.step_metrics()


CASES = [
    # (adapter, packed, static, objective, keys)
    ("lora", True, False, "dpo", {}),
    ("lora", False, False, "dpo", {}),
    ("full", True, False, "dpo", {}),
    ("full", False, False, "dpo", {}),
    ("lora", True, True, "dpo", {}),
    ("lora", True, False, "dpo", {"loss_type": "ipo", "beta": 0.5}),
    ("lora", True, False, "dpo", {"loss_type": "hinge", "beta": 2.0}),
    ("lora", True, False, "dpo", {"loss_type": "robust", "label_smoothing": 0.2}),
    ("lora", True, False, "dpo", {"label_smoothing": 0.1, "rpo_alpha": 0.7}),
    ("full", True, False, "simpo", {"beta": 2.0, "simpo_gamma": 0.8, "rpo_alpha": 0.3}),
    ("lora", True, False, "orpo", {"beta": 0.25}),
]


@pytest.mark.parametrize("adapter,packed,static,objective,keys", CASES)
def test_loss_gradients_and_metrics_equal_trls_formulas_on_unpacked_pairs(adapter, packed, static, objective, keys):
    model, obj, params, tok = build(adapter, objective, **keys)
    base = load_model("tiny-qwen3_5", tok, seed=SEED).model  # separately loaded, unpatched
    pairs = make_pairs()
    got, got_metrics = ours(model, obj, pairs, packed, static)
    got.backward()
    got_grads = grads(params)
    spec = {"beta": keys.get("beta", 0.1), "loss_type": keys.get("loss_type", "sigmoid")}
    spec |= {"ls": keys.get("label_smoothing", 0.0), "rpo_alpha": keys.get("rpo_alpha")}
    want, want_metrics = trl_reference(model, base, pairs, objective, gamma=keys.get("simpo_gamma", 0.5), **spec)
    want.backward()
    want_grads = grads(params)
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    assert set(got_metrics) == set(want_metrics)
    for k, v in want_metrics.items():
        assert got_metrics[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k
    assert 0 < want_metrics["rewards/accuracies"] < 1 or objective != "dpo"  # the policy is off its reference
    scale = max(float(g.abs().max()) for g in want_grads)
    assert scale > 0
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6 * scale)


def test_the_plain_loss_path_gives_the_same_numbers():
    """`loss: plain` (the model's own [tokens, vocab] logits) and the chunked head agree."""
    pairs = make_pairs(seed=1)
    results = []
    for fused in (True, False):
        model, obj, params, _ = build("lora", "dpo", fused=fused)
        loss, metrics = ours(model, obj, pairs, packed=True)
        loss.backward()
        results.append((loss.detach(), metrics, grads(params)))
    (a, ma, ga), (b, mb, gb) = results
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert ma == pytest.approx(mb, rel=1e-5, abs=1e-6)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-7)


def test_the_lora_off_reference_is_a_separately_loaded_base_models_log_probs():
    model, _, _, tok = build("lora", "dpo")
    base = load_model("tiny-qwen3_5", tok, seed=SEED).model
    pairs = make_pairs(seed=2)
    (pack,) = pack_pairs(pairs, 512)
    order = [d.pair for d in pack[::2]]  # the pack's pairs in order of appearance (chosen, then rejected)
    batch = PairCollator()(pack)
    with torch.no_grad():
        want = torch.stack(
            [torch.stack([doc_logps(base, d.input_ids, d.loss_mask)[0] for d in pairs[i].docs()]) for i in order]
        )
        before, _ = pair_logps(model, batch, True)
        ref, counts = reference_logps(model, None, batch, True)
        after, _ = pair_logps(model, batch, True)
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)
    assert counts.tolist() == [[sum(d.loss_mask[1:]) for d in pairs[i].docs()] for i in order]
    assert (before - want).abs().max() > 1e-2  # the adapters move the policy ...
    torch.testing.assert_close(after, before, rtol=0, atol=0)  # ... and are on again after the reference's forward
