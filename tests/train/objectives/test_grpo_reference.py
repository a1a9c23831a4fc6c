"""grpo's LoRA-off reference (beta > 0) switches the adapters off as data (`runtime.lora.adapters_off`: each LoRA
layer's scale a zero tensor), as dpo's does, not by peft's `disable_adapter` flag, which a compiled loop guards on and
so compiles a second graph: its log-probabilities equal `disable_adapter`'s, the policy's after it are exactly those
before, and a window's loss and gradients are those of the `disable_adapter` implementation (eager, fp32).
"""

from __future__ import annotations

import torch
from objective_grads import grads
from test_grpo_loss import G, build, make_groups

from hybridtune.runtime import lora
from hybridtune.runtime.distributed import LossModule
from hybridtune.train.objectives.grpo import (
    REF_LOGPS,
    Completion,
    CompletionCollator,
    completion_logps,
    group_advantages,
    pack_completions,
)

TOL = dict(rtol=1e-6, atol=1e-7)  # fp32, the same operations


def batches_of(rows) -> list[dict]:
    adv = group_advantages(torch.tensor([r for *_, r in rows]), G).tolist()
    comps = [Completion(p + c, [0] * len(p) + [1] * len(c), advantage=a) for (p, c, _), a in zip(rows, adv)]
    return [CompletionCollator()(b) for b in pack_completions(comps, 40)]


def window(model, obj, batches) -> torch.Tensor:
    """The reference log-probs taken (`prepare`), then every micro-batch's forward and one backward."""
    for b in batches:
        b.pop(REF_LOGPS, None)
    obj.prepare(model, batches)
    n = obj.window_items(batches)
    engine = LossModule(model, obj)
    total = sum(engine(b, n) for b in batches)
    total.backward()
    return total.detach()


def test_grpo_reference_as_data_equals_peft_disable_adapter(monkeypatch):
    model, obj, params, _, _ = build("lora", beta=0.2)
    scales = lora.live_scales(model)  # tensors from the objective's build on (before any compiled forward)
    assert scales and all(s.owner[s.name] is s.on for s in scales)
    batches = batches_of(make_groups(seed=3))
    assert len(batches) > 1
    with torch.no_grad():
        with model.disable_adapter():
            want = [completion_logps(model, b, obj.fused, obj.temperature) for b in batches]
        policy = [completion_logps(model, b, obj.fused, obj.temperature) for b in batches]
        got = [obj.reference_logps(model, b) for b in batches]
        after = [completion_logps(model, b, obj.fused, obj.temperature) for b in batches]
    for g, w, p, a in zip(got, want, policy, after):
        torch.testing.assert_close(g, w, **TOL)
        torch.testing.assert_close(a, p, rtol=0, atol=0)  # the adapters back on, exactly
        assert (p - w).abs().max() > 1e-3  # the policy is off its reference: the check can see a difference

    loss = window(model, obj, batches)
    got_grads = grads(params)
    with monkeypatch.context() as m:  # the implementation before: peft's flag
        m.setattr(lora, "adapters_off", lambda model: model.disable_adapter())
        want_loss = window(model, obj, batches)
    want_grads = grads(params)
    torch.testing.assert_close(loss, want_loss, **TOL)
    scale = max(float(g.abs().max()) for g in want_grads)
    assert scale > 0
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6 * scale)
