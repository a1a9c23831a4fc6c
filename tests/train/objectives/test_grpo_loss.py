"""The GRPO loss on packed prompt + completion documents against a direct fp64 computation of TRL's formulas on the
unpacked completions (the tiny Qwen3.5 preset in fp32): the loss, every trainable gradient and the metrics, for each
loss_type, LoRA and a full fine-tune, with and without the KL term, with old log-probs (num_iterations > 1, the policy
moved between them and the update so that the ratio clips), dynamic and static layout, fused and plain head.

The reference side runs each completion alone through `model(input_ids=...)` (transformers' forward, full logits,
divided by the temperature) and takes the reference log-probs from a separately loaded, unpatched base model.
"""

from __future__ import annotations

import pytest
import torch
from objective_grads import grads

from hybridtune.config import load_config
from hybridtune.data.collator import StaticLayout
from hybridtune.errors import ConfigError
from hybridtune.models.hub import resolve_source
from hybridtune.models.loading import load_model, tokenizer_for
from hybridtune.runtime.distributed import LossModule
from hybridtune.runtime.model import build_model
from hybridtune.train.objectives import build_objective
from hybridtune.train.objectives.grpo import Completion, CompletionCollator, group_advantages, pack_completions
from hybridtune.train.objectives.spec import check_keys

SEED = 5
G = 4  # num_generations


def build(adapter: str, fused: bool = True, **keys):
    cfg = load_config(
        None,
        {"base_model": "tiny-qwen3_5", "adapter": adapter, "lora_dropout": 0.0, "seed": SEED, "objective": "grpo",
         "num_generations": G, **keys},
    )  # fmt: skip
    tok = tokenizer_for("tiny-qwen3_5")
    torch.manual_seed(SEED)
    model = build_model(cfg, resolve_source(cfg.base_model), tok, torch.device("cpu"), bf16=False).model
    obj = build_objective(cfg, fused, model)
    params = [p for p in model.parameters() if p.requires_grad]
    nudge(params, 11, 0.05 if adapter == "lora" else 0.01)  # off the reference (LoRA's B starts at zero)
    return model, obj, params, tok, cfg


def nudge(params, seed: int, size: float) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) * size)


def make_groups(groups: int = 3, seed: int = 0, vocab: int = 400):
    """(prompt, completion, reward) for `groups` prompts x G completions of odd, random lengths; the last completion
    of the first group has no trained token (a truncated one under mask_truncated_completions)."""
    g = torch.Generator().manual_seed(seed)

    def ints(lo, hi, k=1):
        return torch.randint(lo, hi, (k,), generator=g).tolist()

    rows = []
    for _ in range(groups):
        prompt = ints(0, vocab, ints(3, 12)[0])
        for _ in range(G):
            rows.append((prompt, ints(0, vocab, 2 * ints(0, 5)[0] + 1), float(torch.rand((), generator=g)) * 3))
    return rows


def reference_advantages(rewards: list[float], scale: str) -> list[float]:
    out = []
    r = torch.tensor(rewards, dtype=torch.float64)
    for i, x in enumerate(rewards):
        grp = r[i // G * G : i // G * G + G]
        sd = {"group": float(grp.std()), "batch": float(r.std()), "none": None}[scale]
        a = x - float(grp.mean())
        out.append(a if sd is None else a / (sd + 1e-4))
    return out


def completion_logps(model, prompt, completion, temperature) -> torch.Tensor:
    """Log-probs of the completion's tokens, one document, full logits / temperature, fp64."""
    x = torch.tensor([prompt + completion])
    logits = model(input_ids=x).logits[0, len(prompt) - 1 : -1].double() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def trl_reference(model, base, rows, adv, old, masked, cfg):
    """TRL's GRPO loss and metrics over every completion of the step, in fp64."""
    eps, high = cfg.epsilon, cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon
    loss_type = "dapo" if cfg.loss_type == "auto" else cfg.loss_type
    per_seq, sums, tokens = [], torch.zeros((), dtype=torch.float64), 0
    kl_sum, low, high_n = 0.0, 0.0, 0.0
    for i, (prompt, comp, _) in enumerate(rows):
        logp = completion_logps(model, prompt, comp, cfg.temperature)
        mask = (
            torch.zeros(len(comp), dtype=torch.float64) if i in masked else torch.ones(len(comp), dtype=torch.float64)
        )
        o = old[i] if old is not None else logp.detach()
        ratio = torch.exp(logp - o)
        a = adv[i]
        ptl = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps, 1 + high) * a)
        if cfg.beta > 0:
            with torch.no_grad():
                ref = completion_logps(base, prompt, comp, cfg.temperature)
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            ptl = ptl + cfg.beta * kl
            kl_sum += float((kl.detach() * mask).sum())
        r = ratio.detach()
        low += float((((r < 1 - eps) & (a < 0)).double() * mask).sum())
        high_n += float((((r > 1 + high) & (a > 0)).double() * mask).sum())
        per_seq.append((ptl * mask).sum() / mask.sum().clamp(min=1))
        sums = sums + (ptl * mask).sum()
        tokens += int(mask.sum())
    if loss_type == "grpo":
        loss = torch.stack(per_seq).mean()
    elif loss_type == "dr_grpo":
        loss = sums / (len(rows) * cfg.max_completion_length)
    else:
        loss = sums / tokens
    metrics = {"clip_ratio/low_mean": low / tokens, "clip_ratio/high_mean": high_n / tokens}
    metrics["clip_ratio/region_mean"] = (low + high_n) / tokens
    if cfg.beta > 0:
        metrics["kl"] = kl_sum / tokens
    return loss, metrics


CASES = [
    # (adapter, fused, static, keys)
    ("lora", True, False, {"loss_type": "grpo", "beta": 0.04}),
    ("lora", True, False, {"loss_type": "dr_grpo", "num_iterations": 2, "epsilon": 0.05, "max_completion_length": 13}),
    ("lora", True, True, {"num_iterations": 2, "epsilon": 0.05, "epsilon_high": 0.1, "beta": 0.2, "temperature": 0.7}),
    ("full", True, False, {"loss_type": "grpo", "num_iterations": 2, "epsilon": 0.03, "beta": 0.04}),
    ("full", True, False, {"loss_type": "dapo", "scale_rewards": "batch"}),
    ("full", False, False, {"loss_type": "dr_grpo", "beta": 0.1, "scale_rewards": "none", "temperature": 1.3}),
]


@pytest.mark.parametrize("adapter,fused,static,keys", CASES)
def test_grpo_loss_gradients_and_metrics_equal_trls_formulas_on_unpacked_completions(adapter, fused, static, keys):
    model, obj, params, tok, cfg = build(adapter, fused, **keys)
    base = load_model("tiny-qwen3_5", tok, seed=SEED).model  # separately loaded, unpatched: the reference
    rows = make_groups(seed=len(keys) + (adapter == "full"))
    masked = {G - 1}
    adv = group_advantages(torch.tensor([r for *_, r in rows]), G, cfg.scale_rewards).tolist()
    want_adv = reference_advantages([r for *_, r in rows], cfg.scale_rewards)
    assert adv == pytest.approx(want_adv, rel=1e-5, abs=1e-6)
    comps = [
        Completion(p + c, [0] * len(p) + [0 if i in masked else 1] * len(c), advantage=a)
        for i, ((p, c, _), a) in enumerate(zip(rows, adv))
    ]
    bins = pack_completions(comps, 40)
    assert len(bins) > 1 and max(len(b) for b in bins) > 2  # a window of several packs of several completions
    layout = StaticLayout.fit([[len(d) for d in b] for b in bins]) if static else None
    batches = [CompletionCollator(layout=layout)(b) for b in bins]
    old = None
    if cfg.num_iterations > 1:  # old log-probs from the policy that sampled; then the policy moves (clipping)
        obj.prepare(model, batches)
        with torch.no_grad():
            old = [completion_logps(model, p, c, cfg.temperature) for p, c, _ in rows]
        nudge(params, 12, 0.1 if adapter == "lora" else 0.02)
    else:
        obj.prepare(model, batches)
    n = obj.window_items(batches)
    engine = LossModule(model, obj)
    got = sum(engine(b, n) for b in batches)
    got.backward()
    got_grads = grads(params)
    got_metrics = obj.step_metrics()
    want, want_metrics = trl_reference(model, base, rows, want_adv, old, masked, cfg)
    want.backward()
    want_grads = grads(params)
    torch.testing.assert_close(got.detach().double(), want.detach(), rtol=1e-5, atol=1e-6)
    assert set(got_metrics) == set(want_metrics)
    for k, v in want_metrics.items():
        assert got_metrics[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    if cfg.num_iterations > 1:
        assert want_metrics["clip_ratio/region_mean"] > 0  # the clipped branch is exercised
    scale = max(float(g.abs().max()) for g in want_grads)
    assert scale > 0
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w.to(g.dtype), rtol=1e-4, atol=1e-5 * scale)


def test_a_loss_type_of_another_objective_is_one_line():
    with pytest.raises(ConfigError, match="'loss_type' = 'sigmoid' is not a loss of objective 'grpo'"):
        build_objective(load_config(None, {"objective": "grpo", "loss_type": "sigmoid"}), True)
    with pytest.raises(ConfigError, match="'beta' = -0.1 must be > 0"):
        load_config(None, {"objective": "grpo", "beta": -0.1})
    assert build_objective(load_config(None, {"objective": "grpo", "beta": 0}), True).needs_reference is False
    assert build_objective(load_config(None, {"objective": "dpo"}), True).loss_type == "sigmoid"
    with pytest.raises(ConfigError, match="'num_generations' is set but means nothing for objective 'sft'"):
        check_keys(load_config(None, {"num_generations": 4}))
