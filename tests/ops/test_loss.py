"""Fused linear cross-entropy against the plain loss (fp64 reference): value and every gradient."""

from __future__ import annotations

import pytest
import torch

from hybridtune.ops.loss import default_chunk, linear_cross_entropy


def reference(hidden, weight, targets, ignore_index=-100):
    logits = hidden.double() @ weight.double().t()
    return torch.nn.functional.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")


@pytest.mark.parametrize(
    "n,h,v,chunk,dtype,tol",
    [
        (63, 24, 101, 16, torch.float32, 1e-5),  # chunk does not divide N; odd vocab
        (75, 32, 257, 64, torch.float32, 1e-5),
        (130, 16, 50, None, torch.float32, 1e-5),  # default chunk (> N): one chunk
        (75, 32, 257, 32, torch.bfloat16, 2e-2),
    ],
)
def test_value_and_gradients_match_reference(n, h, v, chunk, dtype, tol):
    gen = torch.Generator().manual_seed(n * 7 + v)
    hidden = torch.randn(n, h, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[torch.randperm(n, generator=gen)[: n // 4]] = -100  # ignored tokens spread through the chunks
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref = reference(h64, w64, targets)
    ref.backward(torch.tensor(0.37, dtype=torch.float64))
    got = linear_cross_entropy(hidden, weight, targets, chunk=chunk)
    assert got.dtype == torch.float32
    (got * 0.37).backward()
    assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    assert abs(float(got.detach()) - float(ref)) / abs(float(ref)) < tol
    assert rel(hidden.grad, h64.grad) < tol
    assert rel(weight.grad, w64.grad) < tol


def test_frozen_weight_and_no_grad():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(40, 8, generator=gen, requires_grad=True)
    weight = torch.randn(30, 8, generator=gen)  # frozen, as lm_head under LoRA
    targets = torch.randint(0, 30, (40,), generator=gen)
    linear_cross_entropy(hidden, weight, targets, chunk=16).backward()
    assert weight.grad is None and hidden.grad is not None
    with torch.no_grad():
        val = linear_cross_entropy(hidden, weight, targets, chunk=16)
    assert torch.allclose(val, reference(hidden.detach(), weight, targets).float(), rtol=1e-5)


def test_all_ignored_is_zero_with_zero_gradient():
    hidden = torch.randn(10, 8, requires_grad=True)
    weight = torch.randn(12, 8, requires_grad=True)
    targets = torch.full((10,), -100)
    loss = linear_cross_entropy(hidden, weight, targets, chunk=4)
    loss.backward()
    assert float(loss) == 0.0 and hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match=r"hidden \[N, H\] and weight \[V, H\]"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(5, 7), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="targets must be"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(5, 8), torch.zeros(3, dtype=torch.long))


def test_default_chunk_keeps_a_qwen_vocab_chunk_near_one_gib():
    c = default_chunk(248320)
    assert c % 64 == 0 and 0.5 < c * 248320 * 4 / 2**30 <= 1.0


@pytest.mark.cuda
@pytest.mark.parametrize("n,chunk", [(1500, 512), (75, 32)])
def test_cuda_compiled_chunks_match_reference(n, chunk):
    """The CUDA path (inductor-fused chunk kernel, bf16 autocast as in training) against fp64."""
    gen = torch.Generator(device="cuda").manual_seed(n)
    h, v = 64, 1003
    hidden = torch.randn(n, h, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=gen) / h**0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    targets[::5] = -100
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref = reference(h64, w64, targets)
    ref.backward()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = linear_cross_entropy(hidden, weight, targets, chunk=chunk)
    got.backward()
    assert abs(float(got.detach()) - float(ref)) / abs(float(ref)) < 1e-2
    for a, b in ((hidden.grad, h64.grad), (weight.grad, w64.grad)):
        assert float((a.double() - b).norm() / b.norm()) < 2e-2
