"""hybridtune:: custom ops: opcheck, output and every gradient against the reference, odd shapes,
grouped values (HV = 2H), uneven packed documents, the B > 1 packed error; on CUDA, FLA against the
fp32 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridtune.mixers.gdn import fla_guard
from hybridtune.mixers.gdn import ops as gdn
from hybridtune.mixers.gdn.reference import causal_conv1d_ref, chunk_gated_delta_rule_ref


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _chunks(lens):
    from hybridtune.mixers.gdn.spec import CHUNK_INDICES, SPEC

    return SPEC.metadata(lens)[CHUNK_INDICES]  # what the collator adds for the mixer


def _gdn_inputs(T, H, HV, K, V, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn(1, T, HV, generator=gen) + 2.0)  # fp32 log decay, as the models compute it
    beta = torch.rand(1, T, HV, generator=gen)
    qkvb = [t.to(device, dtype).requires_grad_() for t in (q, k, v, beta)]
    g = g.to(device, torch.float32 if dtype != torch.float64 else dtype).requires_grad_()
    q, k, v, beta = qkvb
    return q, k, v, g, beta


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64 (FLA's test metric)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


CASES = [  # (doc lengths, H, HV, K, V)
    ([63], 2, 2, 16, 16),
    ([75], 2, 4, 16, 8),
    ([10, 53, 1, 75, 2], 2, 4, 16, 8),
    ([1500], 1, 2, 8, 8),
    ([300, 13, 187], 1, 2, 8, 8),
]


@pytest.mark.parametrize("lens,H,HV,K,V", CASES)
def test_gdn_op_matches_reference_fp64(lens, H, HV, K, V):
    T = sum(lens)
    packed = len(lens) > 1
    cu, ci = (_cu(lens), _chunks(lens)) if packed else (None, None)
    q, k, v, g, beta = _gdn_inputs(T, H, HV, K, V, torch.float64)
    o = gdn.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, chunk_indices=ci)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v, g, beta), do)
    o_ref = chunk_gated_delta_rule_ref(q, k, v, g, beta, cu_seqlens=cu)
    grads_ref = torch.autograd.grad(o_ref, (q, k, v, g, beta), do)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    for name, a, b in zip("q k v g beta".split(), grads, grads_ref):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=f"d{name}")


def test_gdn_op_gradcheck_packed():
    lens = [2, 3]
    q, k, v, g, beta = _gdn_inputs(sum(lens), 1, 2, 2, 2, torch.float64)
    cu = _cu(lens)
    fn = lambda *a: gdn.chunk_gated_delta_rule(*a, cu_seqlens=cu)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v, g, beta), eps=1e-6, atol=1e-6, fast_mode=True)


@pytest.mark.parametrize("lens", [[63], [75], [10, 1, 64, 2], [1500]])
@pytest.mark.parametrize("bias", [False, True])
def test_conv_op_matches_reference_fp64(lens, bias):
    T, D, W = sum(lens), 24, 4
    cu, ci = (_cu(lens), _chunks(lens)) if len(lens) > 1 else (None, None)
    x = torch.randn(1, T, D, dtype=torch.float64, requires_grad=True)
    w = torch.randn(D, W, dtype=torch.float64, requires_grad=True)
    b = torch.randn(D, dtype=torch.float64, requires_grad=True) if bias else None
    inputs = [t for t in (x, w, b) if t is not None]
    y = gdn.causal_conv1d(x, w, b, cu_seqlens=cu, chunk_indices=ci)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, inputs, dy)
    y_ref = causal_conv1d_ref(x, w, b, cu_seqlens=cu)
    grads_ref = torch.autograd.grad(y_ref, inputs, dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for a, r in zip(grads, grads_ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


def test_opcheck_all_ops():
    lens = [10, 53, 12]
    T = sum(lens)
    cu, ci = _cu(lens), _chunks(lens)
    q, k, v, g, beta = _gdn_inputs(T, 2, 4, 16, 8, torch.float32)
    for args in [(q, k, v, g, beta, 0.25, cu, ci, True), (q, k, v, g, beta, 0.25, None, None, False)]:
        torch.library.opcheck(torch.ops.hybridtune.gdn_chunk.default, args)
    # Backward ops are not differentiable themselves (no double backward): check them on detached inputs.
    qd, kd, vd, gd, bd = (t.detach() for t in (q, k, v, g, beta))
    o, g_cum, A = torch.ops.hybridtune.gdn_chunk(qd, kd, vd, gd, bd, 0.25, cu, ci, True)
    do = torch.randn_like(o)
    torch.library.opcheck(
        torch.ops.hybridtune.gdn_chunk_bwd.default, (do, qd, kd, vd, gd, bd, g_cum, A, 0.25, cu, ci, True)
    )
    x = torch.randn(1, T, 24, requires_grad=True)
    w = torch.randn(24, 4, requires_grad=True)
    b = torch.randn(24, requires_grad=True)
    for args in [(x, w, b, cu, ci, True), (x, w, None, None, None, False)]:
        torch.library.opcheck(torch.ops.hybridtune.causal_conv1d.default, args)
        detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
        torch.library.opcheck(torch.ops.hybridtune.causal_conv1d_bwd.default, (torch.randn(1, T, 24), *detached))


def test_packed_batch_gt_1_raises():
    q, k, v, g, beta = _gdn_inputs(20, 1, 1, 8, 8, torch.float32)
    q2, k2, v2, g2, b2 = (torch.cat([t, t]) for t in (q, k, v, g, beta))
    cu = _cu([5, 15])
    with pytest.raises(ValueError, match="batch size 1"):
        gdn.chunk_gated_delta_rule(q2, k2, v2, g2, b2, cu_seqlens=cu)
    with pytest.raises(ValueError, match="batch size 1"):
        gdn.causal_conv1d(torch.randn(2, 20, 4), torch.randn(4, 4), cu_seqlens=cu)


def test_zero_length_documents_are_dropped_before_a_kernel():
    from hybridtune.mixers.gdn.ops import _varlen

    cu, ci = _varlen(torch.tensor([0, 5, 5, 70], dtype=torch.int32), None, torch.device("cpu"))
    assert cu.tolist() == [0, 5, 70]
    assert ci.tolist() == [[0, 0], [1, 0], [1, 1]]


def test_fla_guard_grants():
    key = (3, 6, 64, 64)
    assert not fla_guard.is_granted(key)
    with pytest.raises(ValueError):
        fla_guard.grant(key, "")
    fla_guard.grant(key, "test: explicit")
    try:
        assert fla_guard.is_granted(key) and fla_guard.granted()[key] == "test: explicit"
    finally:
        fla_guard.revoke(key)
    assert not fla_guard.is_granted(key)


# ---------------------------------------------------------------- CUDA: FLA against the fp32 reference

LAYOUTS = {  # (H, HV, K, V) of the Qwen3.5 checkpoints
    "0.8b/2b": (16, 16, 128, 128),
    "9b": (16, 32, 128, 128),
    "tiny": (2, 4, 32, 32),
}


@pytest.mark.cuda
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("lens", [[63], [75], [10, 53, 1, 75, 2], [1500], [700, 13, 787]])
def test_fla_gdn_matches_fp32_reference(layout, lens, fla_selftest):
    """The device self-test first (a pass grants the layout's backward past FLA's Hopper guard; a failure
    fails here with its reason), then FLA against the fp32 reference on more packings than it tries."""
    H, HV, K, V = LAYOUTS[layout]
    fla_selftest.require((H, HV, K, V))
    T = sum(lens)
    cu, ci = (_cu(lens).cuda(), _chunks(lens).cuda()) if len(lens) > 1 else (None, None)
    q, k, v, g, beta = _gdn_inputs(T, H, HV, K, V, torch.bfloat16, device="cuda")
    o = gdn.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, chunk_indices=ci)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v, g, beta), do)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v, g, beta)]
    o_ref = chunk_gated_delta_rule_ref(*ref_in, cu_seqlens=cu)
    grads_ref = torch.autograd.grad(o_ref, ref_in, do.float())
    assert rel_rms(o, o_ref) < 0.01
    for name, a, b in zip("q k v g beta".split(), grads, grads_ref):
        assert rel_rms(a, b) < 0.02, (name, rel_rms(a, b))


@pytest.mark.cuda
@pytest.mark.parametrize("lens", [[63], [10, 1, 64, 2, 700]])
def test_fla_conv_matches_fp32_reference(lens, fla_selftest):
    fla_selftest.conv(LAYOUTS["tiny"])  # its conv has these 256 channels
    T, D = sum(lens), 256
    cu, ci = (_cu(lens).cuda(), _chunks(lens).cuda()) if len(lens) > 1 else (None, None)
    x = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(D, 4, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = gdn.causal_conv1d(x, w, None, cu_seqlens=cu, chunk_indices=ci)
    dy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    xr, wr = (t.detach().float().requires_grad_() for t in (x, w))
    yr = causal_conv1d_ref(xr, wr, None, cu_seqlens=cu)
    gxr, gwr = torch.autograd.grad(yr, (xr, wr), dy.float())
    assert rel_rms(y, yr) < 0.01 and rel_rms(gx, gxr) < 0.01 and rel_rms(gw, gwr) < 0.01


def _verdict(kernel, key, passed, reason=""):
    from hybridtune.kernels.selftest import Verdict
    from hybridtune.mixers.gdn.selftest import Layout

    return Verdict(kernel, Layout(*key), passed, errors={"o": 0.001}, reason=reason, guard_active=True)


def test_selftest_gate_runs_once_grants_and_fails_on_a_failing_kernel(fla_selftest_class):
    """What a CUDA test does with the self-test's verdict (a fake self-test on the CPU): a pass with its grant
    runs the test, a failure or a verdict not run FAILS it with the reason (never a skip), once per layout."""
    ok, bad, unrun = (3, 6, 64, 64), (3, 6, 64, 32), (3, 6, 32, 32)
    calls = []

    def fake_verify(layouts, use_cache=True):
        (lay,) = layouts
        calls.append((lay.key, use_cache))
        if lay.key == ok:
            fla_guard.grant(ok, "test: fake self-test pass")
            return [_verdict("gdn_chunk", ok, True), _verdict("causal_conv1d", ok, True)]
        if lay.key == bad:
            why = "rel err over tolerance: dk 0.31"
            return [_verdict("gdn_chunk", bad, False, why), _verdict("causal_conv1d", bad, True)]
        return [_verdict("gdn_chunk", unrun, None, "no CUDA device")]

    gate = fla_selftest_class(fake_verify, "Fake H200")
    try:
        assert gate.require(ok).passed and gate.conv(ok).passed
        gate.require(ok)
        assert calls == [(ok, False)]  # once per layout, never from a cached verdict
        with pytest.raises(pytest.fail.Exception, match=r"self-test FAILED .*\(3, 6, 64, 32\).*dk 0.31.*Fix: upgrade"):
            gate.require(bad)
        assert gate.conv(bad).passed  # the conv verdict of that layout is its own
        with pytest.raises(pytest.fail.Exception, match="did not run.*no CUDA device"):
            gate.require(unrun)
        with pytest.raises(pytest.fail.Exception, match="no causal_conv1d verdict"):
            gate.conv(unrun)
        fla_guard.revoke(ok)  # a pass that left no grant is a failure too
        with pytest.raises(pytest.fail.Exception, match="no fla_guard grant"):
            gate.require(ok)
    finally:
        fla_guard.revoke(ok)


def test_fla_tensor_cache_switch(monkeypatch):
    """disable_tensor_cache flips the attribute FLA reads at call time, and is a no-op without FLA."""
    import sys
    import types

    from hybridtune.mixers.gdn import fla_adapter

    monkeypatch.setitem(sys.modules, "fla.utils", None)  # import fails: FLA absent
    assert fla_adapter.disable_tensor_cache() is False
    fake = types.ModuleType("fla.utils")
    fake.FLA_DISABLE_TENSOR_CACHE = False
    monkeypatch.setitem(sys.modules, "fla.utils", fake)
    assert fla_adapter.disable_tensor_cache() is True and fake.FLA_DISABLE_TENSOR_CACHE is True
    monkeypatch.setitem(sys.modules, "fla.utils", types.ModuleType("fla.utils"))  # a release without the switch
    assert fla_adapter.disable_tensor_cache() is False
