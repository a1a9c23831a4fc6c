"""The chunked per-token log-probabilities (`ops.loss.linear_log_probs`) against autograd on full logits (fp64):
value and both gradients under an arbitrary per-token incoming gradient, with a trainable and a frozen head."""

from __future__ import annotations

import pytest
import torch

from hybridtune.ops.loss import linear_log_probs


def reference(hidden, weight, targets, ignore_index=-100):
    logp = torch.log_softmax(hidden @ weight.t(), dim=-1)
    valid = targets != ignore_index
    picked = logp.gather(1, torch.where(valid, targets, 0).unsqueeze(1)).squeeze(1)
    return torch.where(valid, picked, 0.0)


def _inputs(n, h, v, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).to(dtype)
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(dtype)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[torch.randperm(n, generator=gen)[: n // 3]] = -100
    # A different incoming gradient per token, as a loss over per-pair sums gives.
    upstream = torch.randn(n, generator=gen, dtype=torch.float64)
    return hidden, weight, targets, upstream


@pytest.mark.parametrize("frozen_weight", [False, True])
@pytest.mark.parametrize(
    "n,h,v,chunk,dtype,tol",
    [
        (63, 24, 101, 16, torch.float32, 1e-5),  # the chunk does not divide N; an odd vocabulary
        (130, 16, 50, None, torch.float32, 1e-5),  # the default chunk: one chunk
        (75, 32, 257, 32, torch.bfloat16, 3e-2),
    ],
)
def test_value_and_gradients_match_autograd_on_full_logits(frozen_weight, n, h, v, chunk, dtype, tol):
    hidden, weight, targets, upstream = _inputs(n, h, v, dtype, seed=n + v)
    hidden.requires_grad_()
    weight.requires_grad_(not frozen_weight)
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_(not frozen_weight)
    ref = reference(h64, w64, targets)
    (ref * upstream).sum().backward()
    got = linear_log_probs(hidden, weight, targets, chunk=chunk)
    assert got.shape == (n,) and got.dtype == torch.float32
    (got * upstream.float()).sum().backward()

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    assert rel(got.detach(), ref.detach()) < tol
    assert bool((got.detach()[targets == -100] == 0).all())
    assert hidden.grad.dtype == dtype and rel(hidden.grad, h64.grad) < tol
    if frozen_weight:
        assert weight.grad is None
    else:
        assert weight.grad.dtype == dtype and rel(weight.grad, w64.grad) < tol


def test_a_sum_per_sequence_has_the_gradient_of_the_sum():
    """The per-sequence sum a preference loss takes: its gradient is the full-logits one (fp32 against fp64)."""
    hidden, weight, targets, _ = _inputs(40, 8, 30, torch.float32, seed=3)
    hidden.requires_grad_()
    weight.requires_grad_()
    doc = torch.tensor([0] * 15 + [1] * 25)
    seq = torch.zeros(2).index_add(0, doc, linear_log_probs(hidden, weight, targets, chunk=16))
    loss = -torch.nn.functional.logsigmoid(0.01 * (seq[0] - seq[1]))
    loss.backward()
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    seq64 = torch.zeros(2, dtype=torch.float64).index_add(0, doc, reference(h64, w64, targets))
    (-torch.nn.functional.logsigmoid(0.01 * (seq64[0] - seq64[1]))).backward()
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-7)


def test_no_grad_and_shape_errors():
    hidden, weight, targets, _ = _inputs(20, 8, 12, torch.float32, seed=1)
    with torch.no_grad():
        got = linear_log_probs(hidden, weight, targets, chunk=8)
    torch.testing.assert_close(got, reference(hidden, weight, targets))
    with pytest.raises(ValueError, match=r"hidden \[N, H\] and weight \[V, H\]"):
        linear_log_probs(torch.randn(4, 8), torch.randn(5, 7), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="targets must be"):
        linear_log_probs(torch.randn(4, 8), torch.randn(5, 8), torch.zeros(3, dtype=torch.long))
