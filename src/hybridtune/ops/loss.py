"""Fused linear cross-entropy: the loss of `hidden @ weight.T` without keeping `[N, vocab]` logits.

`linear_cross_entropy(hidden [N, H], weight [V, H], targets [N])` returns the *sum* of the per-token cross-entropy
over tokens whose target is not `ignore_index` (an fp32 scalar; fp64 for fp64 inputs). It walks the tokens in chunks;
for each chunk it forms the logits, takes their log-sum-exp in fp32 and, when gradients are wanted, turns the same
buffer into d(loss)/d(logits) = softmax - one_hot at once, folded into d(hidden) (`g @ W`) and d(weight) (`g.T @ h`,
accumulated in fp32): the forward runs the GEMMs a plain loss's backward would, the backward only scales them. Peak
extra memory: one chunk of logits and its gradient (about 1 GiB in fp32 by default) plus `d(hidden)`. On CUDA the
per-chunk softmax, loss and gradient run as one compiled (inductor) kernel pair.

`linear_log_probs` is the same walk returning each token's log-probability `[N]` (0 at ignored tokens), for losses
over per-sequence sums (preference tuning); its incoming gradient is per token, so its backward forms each chunk's
logits again (with a frozen weight it scales a `d(hidden)` basis kept from the forward instead).
Matmuls run in the autocast dtype when autocast is on (what `lm_head` would run in), else in `hidden`'s dtype; the
gradients come back in each input's own dtype.
"""

from __future__ import annotations

import functools

import torch

# Elements of one fp32 logits chunk: 2**28 = 1 GiB (1081 tokens at a 248k vocabulary, rounded to 1024).
CHUNK_ELEMENTS = 2**28


def default_chunk(vocab: int) -> int:
    return max(64, (CHUNK_ELEMENTS // max(vocab, 1)) // 64 * 64)


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return hidden.dtype


def _chunk_loss(logits: torch.Tensor, tgt: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, tgt).squeeze(1)
    return torch.where(valid, lse - picked, 0.0).sum()


def _chunk_loss_and_grad(logits: torch.Tensor, tgt: torch.Tensor, valid: torch.Tensor, acc: torch.dtype):
    """Summed loss of one chunk and d(loss)/d(logits) = (softmax - one_hot) at valid rows, in the logits' dtype."""
    x = logits.to(acc)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    picked = x.gather(1, tgt)
    loss = torch.where(valid, (lse - picked).squeeze(1), 0.0).sum()
    cols = torch.arange(x.shape[1], device=x.device)
    g = torch.exp(x - lse) - (cols == tgt).to(acc)
    return loss, (g * valid.unsqueeze(1)).to(logits.dtype)


@functools.cache
def _chunk_loss_and_grad_compiled():
    """On CUDA the chunk's elementwise work is one fused pass (inductor): it reads the 16-bit logits once for
    the log-sum-exp and once for the gradient, instead of six fp32 passes over [chunk, vocab]."""
    return torch.compile(_chunk_loss_and_grad)  # a second chunk length (the last chunk) makes it dynamic


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk, dtype):
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.to(dtype)
            w = weight.to(dtype)
            acc = torch.promote_types(dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
            total = torch.zeros((), dtype=acc, device=hidden.device)
            dh = torch.empty_like(h) if need_dh else None
            dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_dw else None
            for s in range(0, h.shape[0], chunk):
                hc, tc = h[s : s + chunk], targets[s : s + chunk]
                valid = tc != ignore_index
                tgt = torch.where(valid, tc, 0).unsqueeze(1)
                logits = hc @ w.t()
                if not (need_dh or need_dw):
                    total += _chunk_loss(logits.to(acc), tgt, valid)
                    continue
                step = _chunk_loss_and_grad_compiled() if logits.is_cuda else _chunk_loss_and_grad
                loss, g = step(logits, tgt, valid, acc)
                total += loss
                if need_dh:
                    dh[s : s + chunk] = g @ w
                if need_dw:
                    if dtype == acc:
                        dw.addmm_(g.t(), hc)
                    else:
                        dw.add_(g.t() @ hc)
        ctx.save_for_backward(*(t for t in (dh, dw) if t is not None))
        ctx.has = (need_dh, need_dw)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        saved = list(ctx.saved_tensors)
        dh = saved.pop(0) if ctx.has[0] else None
        dw = saved.pop(0) if ctx.has[1] else None
        if dh is not None:
            dh = (dh * grad_out.to(dh.dtype)).to(ctx.dtypes[0])
        if dw is not None:
            dw = (dw * grad_out).to(ctx.dtypes[1])
        return dh, dw, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk: int | None = None,
) -> torch.Tensor:
    """Sum over non-ignored tokens of cross_entropy(hidden @ weight.T, targets); see the module docstring."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: hidden [N, H] and weight [V, H] expected, got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"linear_cross_entropy: targets must be [N] = {hidden.shape[0]}, got {tuple(targets.shape)}")
    chunk = chunk or default_chunk(weight.shape[0])
    return _LinearCrossEntropy.apply(hidden, weight, targets, ignore_index, chunk, _compute_dtype(hidden))


def _chunk_log_probs(logits: torch.Tensor, tgt: torch.Tensor, valid: torch.Tensor):
    """(log-probability of each row's target, 0 at invalid rows; each row's log-sum-exp) of an fp32/fp64 chunk."""
    lse = torch.logsumexp(logits, dim=-1)
    return torch.where(valid, logits.gather(1, tgt).squeeze(1) - lse, 0.0), lse


def _chunk_logp_grad(logits: torch.Tensor, lse: torch.Tensor, tgt: torch.Tensor, scale: torch.Tensor):
    """d(sum_t scale_t * logp_t)/d(logits) = scale_t * (one_hot - softmax), in the chunk's fp32/fp64."""
    cols = torch.arange(logits.shape[1], device=logits.device)
    return ((cols == tgt).to(logits.dtype) - torch.exp(logits - lse.unsqueeze(1))) * scale.unsqueeze(1)


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk, dtype):
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        basis = need_dh and not need_dw  # a frozen weight: d(hidden) is a per-token multiple of a kept basis
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            acc = torch.promote_types(dtype, torch.float32)
            out = torch.empty(h.shape[0], dtype=acc, device=hidden.device)
            lse = torch.empty_like(out)
            dh = torch.empty_like(h) if basis else None
            for s in range(0, h.shape[0], chunk):
                tc = targets[s : s + chunk]
                valid = tc != ignore_index
                tgt = torch.where(valid, tc, 0).unsqueeze(1)
                x = (h[s : s + chunk] @ w.t()).to(acc)
                out[s : s + chunk], lse[s : s + chunk] = _chunk_log_probs(x, tgt, valid)
                if basis:
                    dh[s : s + chunk] = _chunk_logp_grad(x, lse[s : s + chunk], tgt, valid.to(acc)).to(dtype) @ w
        if basis:
            ctx.save_for_backward(dh)
        elif need_dw:
            ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.has, ctx.basis = (need_dh, need_dw), basis
        ctx.meta = (ignore_index, chunk, dtype, hidden.dtype, weight.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        ignore_index, chunk, dtype, h_dtype, w_dtype = ctx.meta
        if ctx.basis:
            (dh,) = ctx.saved_tensors
            return (dh * grad_out.unsqueeze(1).to(dh.dtype)).to(h_dtype), None, None, None, None, None
        if not any(ctx.has):
            return None, None, None, None, None, None
        hidden, weight, targets, lse = ctx.saved_tensors
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            acc = lse.dtype
            dh = torch.empty_like(h) if ctx.has[0] else None
            dw = torch.zeros(weight.shape, dtype=acc, device=weight.device)
            for s in range(0, h.shape[0], chunk):
                hc, tc = h[s : s + chunk], targets[s : s + chunk]
                valid = tc != ignore_index
                tgt = torch.where(valid, tc, 0).unsqueeze(1)
                x = (hc @ w.t()).to(acc)
                scale = torch.where(valid, grad_out[s : s + chunk].to(acc), 0.0)
                g = _chunk_logp_grad(x, lse[s : s + chunk], tgt, scale).to(dtype)
                if dh is not None:
                    dh[s : s + chunk] = g @ w
                dw.add_((g.t() @ hc).to(acc))
        return (None if dh is None else dh.to(h_dtype)), dw.to(w_dtype), None, None, None, None


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk: int | None = None,
) -> torch.Tensor:
    """log_softmax(hidden @ weight.T)[t, targets[t]] for every token `[N]` (0 where the target is `ignore_index`),
    without `[N, vocab]` logits; see the module docstring."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear_log_probs: hidden [N, H] and weight [V, H] expected, got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"linear_log_probs: targets must be [N] = {hidden.shape[0]}, got {tuple(targets.shape)}")
    chunk = chunk or default_chunk(weight.shape[0])
    return _LinearLogProbs.apply(hidden, weight, targets, ignore_index, chunk, _compute_dtype(hidden))
