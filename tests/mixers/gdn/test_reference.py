"""The pure-torch references against the token-by-token recurrence and F.conv1d (fp64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridtune.mixers.gdn.reference import (
    causal_conv1d_ref,
    chunk_gated_delta_rule_ref,
    position_in_document,
    recurrent_gated_delta_rule_naive,
)

F64 = torch.float64


def _gdn_inputs(B, T, H, HV, K, V, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    k = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, HV, generator=gen, dtype=dtype) + 2.0)  # log decay in (-inf, 0)
    beta = torch.rand(B, T, HV, generator=gen, dtype=dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("T", [1, 63, 64, 75, 130])
@pytest.mark.parametrize("H,HV", [(2, 2), (2, 4)])
def test_chunked_matches_recurrence(T, H, HV):
    q, k, v, g, beta = _gdn_inputs(2, T, H, HV, 16, 8)
    h0 = torch.randn(2, HV, 16, 8, dtype=F64)
    o, s = chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o2, s2 = recurrent_gated_delta_rule_naive(q, k, v, g, beta, initial_state=h0)
    torch.testing.assert_close(o, o2, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, s2, rtol=1e-10, atol=1e-10)


def test_packed_equals_per_document_and_final_states():
    lens = [1, 63, 64, 75, 9]
    T = sum(lens)
    q, k, v, g, beta = _gdn_inputs(1, T, 2, 4, 16, 8)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    o, s = chunk_gated_delta_rule_ref(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        od, sd = recurrent_gated_delta_rule_naive(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b])
        torch.testing.assert_close(o[:, a:b], od, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(s[n], sd[0], rtol=1e-10, atol=1e-10)


def test_output_dtype_and_no_l2norm():
    q, k, v, g, beta = _gdn_inputs(1, 40, 1, 1, 8, 8, dtype=torch.float32)
    o = chunk_gated_delta_rule_ref(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16())
    assert o.dtype == torch.bfloat16 and o.shape == (1, 40, 1, 8)
    o1 = chunk_gated_delta_rule_ref(
        q.double(), k.double() * 0.1, v.double(), g.double(), beta.double(), use_qk_l2norm=False
    )
    o2, _ = recurrent_gated_delta_rule_naive(
        q.double(), k.double() * 0.1, v.double(), g.double(), beta.double(), use_qk_l2norm=False
    )
    torch.testing.assert_close(o1, o2, rtol=1e-10, atol=1e-10)


def test_packed_batch_gt_1_raises():
    q, k, v, g, beta = _gdn_inputs(2, 20, 1, 1, 8, 8)
    with pytest.raises(ValueError, match="batch size 1"):
        chunk_gated_delta_rule_ref(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5, 20], dtype=torch.int32))
    with pytest.raises(ValueError, match="batch size 1"):
        causal_conv1d_ref(torch.randn(2, 20, 4), torch.randn(4, 4), cu_seqlens=torch.tensor([0, 20]))


@pytest.mark.parametrize("T", [1, 3, 63, 75])
@pytest.mark.parametrize("bias", [False, True])
def test_conv_matches_conv1d(T, bias):
    x = torch.randn(2, T, 12, dtype=F64)
    w = torch.randn(12, 4, dtype=F64)
    b = torch.randn(12, dtype=F64) if bias else None
    want = F.silu(F.conv1d(x.transpose(1, 2), w[:, None], b, padding=3, groups=12)[..., :T]).transpose(1, 2)
    torch.testing.assert_close(causal_conv1d_ref(x, w, b), want, rtol=1e-12, atol=1e-12)
    want_lin = F.conv1d(x.transpose(1, 2), w[:, None], b, padding=3, groups=12)[..., :T].transpose(1, 2)
    torch.testing.assert_close(causal_conv1d_ref(x, w, b, activation=None), want_lin, rtol=1e-12, atol=1e-12)


def test_conv_packed_equals_per_document():
    lens = [1, 2, 3, 60, 9]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(1, sum(lens), 6, dtype=F64)
    w = torch.randn(6, 4, dtype=F64)
    y = causal_conv1d_ref(x, w, None, cu_seqlens=cu)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        torch.testing.assert_close(y[:, a:b], causal_conv1d_ref(x[:, a:b], w), rtol=1e-12, atol=1e-12)


def test_position_in_document():
    cu = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    assert position_in_document(cu, 6, torch.device("cpu")).tolist() == [0, 1, 0, 1, 2, 0]


@pytest.mark.parametrize("T,lens", [(63, [63]), (75, [10, 1, 3, 61]), (1500, [700, 2, 798])])
@pytest.mark.parametrize("bias,act", [(True, "silu"), (False, None)])
def test_stacked_conv_equals_the_reference_output_and_every_gradient(T, lens, bias, act):
    """`causal_conv1d_stacked` (the form inductor can fold into one weight-gradient reduction) computes the
    reference's numbers: output and the gradients of x, weight and bias, in float64, fresh random inputs,
    documents of uneven length (one of a single token)."""
    from hybridtune.mixers.gdn.reference import causal_conv1d_ref, causal_conv1d_stacked

    gen = torch.Generator().manual_seed(T + len(lens))
    D, W = 37, 4
    x = torch.randn(1, T, D, generator=gen, dtype=torch.float64)
    w = torch.randn(D, W, generator=gen, dtype=torch.float64)
    b = torch.randn(D, generator=gen, dtype=torch.float64) if bias else None
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    dy = torch.randn(1, T, D, generator=gen, dtype=torch.float64)
    outs, grads = [], []
    for fn in (causal_conv1d_ref, causal_conv1d_stacked):
        ins = [t.clone().requires_grad_() for t in (x, w) + ((b,) if bias else ())]
        y = fn(ins[0], ins[1], ins[2] if bias else None, cu, act)
        outs.append(y)
        grads.append(torch.autograd.grad(y, ins, dy))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    for g_s, g_r in zip(grads[1], grads[0]):
        torch.testing.assert_close(g_s, g_r, rtol=1e-12, atol=1e-12)
