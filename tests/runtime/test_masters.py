"""fp32 master weights in the optimizer (runtime/masters.py): the update is an fp32 AdamW's, gradients accumulated in
fp32, and a DCP save/load restores the masters themselves (not their bf16 copies)."""

from __future__ import annotations

import torch

from hybridtune.runtime.masters import MASTER, MasterAdamW, merged, split

SHAPES = [(7, 13), (33,), (5, 3, 11)]  # odd shapes: nothing lines up with a vector width


def _model(seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Module()
    for i, s in enumerate(SHAPES):
        m.register_parameter(f"w{i}", torch.nn.Parameter(torch.randn(*s, generator=g)))
    return m


def _grads(step: int, micro: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return [torch.randn(*s, generator=g) for s in SHAPES]


def test_update_equals_fp32_adamw_with_fp32_accumulation():
    """Over 5 steps of 3 micro-batches each (fresh random gradients, each micro-batch's bf16 gradient through
    autograd): the masters equal an fp32 AdamW's parameters run on the same bf16 gradients summed in fp32, bit for
    bit (the same fp32 kernel on the same inputs); the model's weights are the masters rounded to
    bf16 (exactly); every gradient is accumulated (not only the last micro-batch's)."""
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    model = _model()
    assert split(model) == len(SHAPES)
    params = list(model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in params)
    opt = MasterAdamW(params, lr=1e-2, weight_decay=0.1)
    masters = opt.grad_tensors()
    assert all(m.dtype == torch.float32 for m in masters)
    for p_ref, m in zip(ref.parameters(), masters):
        assert torch.equal(p_ref.detach(), m)  # the loaded fp32 values, not a bf16 round trip
    for step in range(5):
        total = [torch.zeros(s) for s in SHAPES]
        for micro in range(3):
            gs = _grads(step, micro)
            # the bf16 gradient autograd delivers for d(sum(p * g))/dp = g, rounded to bf16
            sum((p * g.to(torch.bfloat16)).sum() for p, g in zip(params, gs)).backward()
            assert all(p.grad is None for p in params)  # moved into the fp32 master gradient at once
            for t, g in zip(total, gs):
                t.add_(g.to(torch.bfloat16).float())
        for m, t in zip(masters, total):
            assert torch.equal(m.grad, t)  # fp32 sums of the bf16 micro-batch gradients
        for p_ref, t in zip(ref.parameters(), total):
            p_ref.grad = t.clone()
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        for p_ref, m, p in zip(ref.parameters(), masters, params):
            assert torch.equal(m, p_ref.detach())  # the same fp32 kernel on the same inputs
            assert torch.equal(p.detach(), m.to(torch.bfloat16))
    merged(model, opt)
    assert all(p.dtype == torch.float32 and torch.equal(p.detach(), m) for p, m in zip(model.parameters(), masters))


def test_dcp_round_trip_restores_the_masters(tmp_path):
    """The masters and moments come back from a DCP checkpoint bit-exact in fp32 (torch's load would cast them to
    the parameters' bf16), and the model's weights are re-derived from them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def trained(seed):
        model = _model(seed)
        split(model)
        opt = MasterAdamW(list(model.parameters()), lr=1e-2, weight_decay=0.0)
        for step in range(2):
            sum((p * g.to(torch.bfloat16)).sum() for p, g in zip(model.parameters(), _grads(step, seed))).backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    model, opt = trained(0)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
    other, other_opt = trained(1)  # different values everywhere
    msd2, osd2 = get_state_dict(other, other_opt)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=str(tmp_path))
    set_state_dict(other, other_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for p, q in zip(model.parameters(), other.parameters()):
        a, b = opt.state[p], other_opt.state[q]
        for key in (MASTER, "exp_avg", "exp_avg_sq", "step"):
            assert b[key].dtype == a[key].dtype and torch.equal(a[key], b[key]), key
        assert torch.equal(p.detach(), q.detach())
    # the hooks still feed the restored masters
    sum(p.float().sum() for p in other.parameters()).backward()
    assert all(m.grad is not None for m in other_opt.grad_tensors())
