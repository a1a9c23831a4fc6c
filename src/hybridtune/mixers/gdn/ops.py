"""GatedDeltaNet as opaque `torch.library` custom ops: `hybridtune::causal_conv1d` and `hybridtune::gdn_chunk`.

Each op has a fake (meta) implementation and a registered autograd formula whose backward is its own op (`*_bwd`),
so dynamo traces through a GDN layer and AOT autograd traces the backward. Packing metadata (collator, per batch):

    cu_seqlens     int32 [N + 1]  document boundaries in the one packed row (batch size 1)
    chunk_indices  int32 [C, 2]   (document, chunk within document) of every 64-token chunk

so nothing inside the compiled graph calls `nonzero`, `.item()` or `.tolist()`.

Backends, chosen per call from the input device:
    CUDA + flash-linear-attention 0.5.x/0.6.x: FLA's raw Triton forward/backward (`fla_adapter`), or FlashQLA's
    for the delta rule where FLA would dispatch to it and the self-test granted it (`backend.for_op`).
    anything else: the pure-torch reference (`reference.py`), backward by autograd; slow on CUDA, said once.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from hybridtune.mixers.gdn import backend as chunk_backend
from hybridtune.mixers.gdn import fla_adapter, fla_guard
from hybridtune.mixers.gdn.reference import (
    CHUNK_SIZE,
    causal_conv1d_ref,
    causal_conv1d_stacked,
    chunk_gated_delta_rule_ref,
    l2norm,
)

log = logging.getLogger(__name__)
_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


def backend(device: torch.device | str) -> tuple[str, str]:
    """(name, reason) of the implementation the ops use for tensors on `device`."""
    device = torch.device(device)
    if device.type != "cuda":
        return "reference", f"pure-torch reference on {device.type}"
    ok, why = fla_adapter.available()
    if ok:
        return "fla", why
    return "reference", f"pure-torch reference on cuda (slow): {why}"


def _use_fla(t: torch.Tensor) -> bool:
    if t.device.type != "cuda":
        return False
    ok, why = fla_adapter.available()
    if not ok:
        _warn_once(f"hybridtune GDN ops run the slow pure-torch reference on CUDA: {why}")
    return ok


@contextlib.contextmanager
def _autograd_inside_op():
    """Autograd inside a custom op's kernel. The dispatcher runs op kernels below the autograd key
    (`_AutoDispatchBelowAutograd`); the reference backward recomputes the reference under autograd,
    so it takes the autograd keys back out of the thread-local exclude set for its own body."""
    C = torch._C
    exclude = C._dispatch_tls_local_exclude_set()
    for name in ("AutogradFunctionality", "AutogradOther", "AutogradCPU", "AutogradCUDA", "ADInplaceOrView"):
        key = getattr(C.DispatchKey, name, None)
        if key is not None:
            exclude = exclude.remove(key)
    with C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


def _flash_qla_auto_cp(t: torch.Tensor) -> bool:
    """FlashQLA's intra-card split, except under CUDA graph capture: deciding it reads `cu_seqlens` on the host
    (`tolist`), which capture forbids. Forward and backward decide alike (both captured, or neither)."""
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _varlen(cu_seqlens: torch.Tensor | None, chunk_indices: torch.Tensor | None, device: torch.device):
    """Metadata for FLA. Without collator chunk indices they are derived here (one host sync),
    dropping zero-length documents first: FLA gives NaN or faults on empty segments (fla #103)."""
    if cu_seqlens is None:
        return None, None
    if chunk_indices is not None:
        return cu_seqlens.to(device), chunk_indices.to(device)
    cu = torch.unique_consecutive(cu_seqlens.to("cpu", torch.int64))
    lens = (cu[1:] - cu[:-1]).tolist()
    rows = [(d, c) for d, n in enumerate(lens) for c in range(-(-n // CHUNK_SIZE))]
    ci = torch.tensor(rows, dtype=torch.int32).reshape(-1, 2)
    return cu.to(device, torch.int32), ci.to(device)


# ---------------------------------------------------------------------------------------------------
# causal conv: x [B, T, D], weight [D, W], bias [D] -> y [B, T, D]


@torch.library.custom_op("hybridtune::causal_conv1d", mutates_args=())
def causal_conv1d_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    chunk_indices: torch.Tensor | None,
    silu: bool,
) -> torch.Tensor:
    activation = "silu" if silu else None
    if _use_fla(x):
        f = fla_adapter.load()
        cu, ci = _varlen(cu_seqlens, chunk_indices, x.device)
        y, _ = fla_adapter.keywords(
            f.conv_fwd,
            x=x.contiguous(),
            weight=weight.contiguous(),
            bias=bias,
            residual=None,
            initial_state=None,
            output_final_state=False,
            activation=activation,
            cu_seqlens=cu,
            chunk_indices=ci,
        )
        return y
    return causal_conv1d_ref(x, weight, bias, cu_seqlens, activation).contiguous()


@causal_conv1d_op.register_fake
def _(x, weight, bias, cu_seqlens, chunk_indices, silu):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("hybridtune::causal_conv1d_bwd", mutates_args=())
def causal_conv1d_bwd_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    chunk_indices: torch.Tensor | None,
    silu: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx [B, T, D], dweight [D, W], dbias [D]); dbias is zeros when there is no bias."""
    activation = "silu" if silu else None
    if _use_fla(x):
        f = fla_adapter.load()
        cu, ci = _varlen(cu_seqlens, chunk_indices, x.device)
        dx, dw, db, _, _ = fla_adapter.keywords(
            f.conv_bwd,
            x=x.contiguous(),
            dy=dy.contiguous(),
            dht=None,
            weight=weight.contiguous(),
            bias=bias,
            residual=None,
            initial_state=None,
            activation=activation,
            cu_seqlens=cu,
            chunk_indices=ci,
        )
        db = torch.zeros(weight.shape[0], dtype=weight.dtype, device=x.device) if db is None else db.to(weight.dtype)
        return dx.to(x.dtype).contiguous(), dw.to(weight.dtype).contiguous(), db
    with _autograd_inside_op():
        xs = x.detach().requires_grad_()
        ws = weight.detach().requires_grad_()
        bs = bias.detach().requires_grad_() if bias is not None else None
        y = causal_conv1d_ref(xs, ws, bs, cu_seqlens, activation)
        grads = torch.autograd.grad(y, [t for t in (xs, ws, bs) if t is not None], dy)
    db = grads[2] if bias is not None else torch.zeros(weight.shape[0], dtype=weight.dtype, device=x.device)
    return grads[0].contiguous(), grads[1].contiguous(), db.contiguous()


@causal_conv1d_bwd_op.register_fake
def _(dy, x, weight, bias, cu_seqlens, chunk_indices, silu):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape[0])


def _conv_setup(ctx, inputs, output):
    x, weight, bias, cu_seqlens, chunk_indices, silu = inputs
    ctx.save_for_backward(x, weight, bias, cu_seqlens, chunk_indices)
    ctx.silu = silu
    ctx.has_bias = bias is not None


def _conv_backward(ctx, dy):
    x, weight, bias, cu_seqlens, chunk_indices = ctx.saved_tensors
    dx, dw, db = torch.ops.hybridtune.causal_conv1d_bwd(dy, x, weight, bias, cu_seqlens, chunk_indices, ctx.silu)
    return dx, dw, (db if ctx.has_bias else None), None, None, None


causal_conv1d_op.register_autograd(_conv_backward, setup_context=_conv_setup)


# ---------------------------------------------------------------------------------------------------
# chunked gated delta rule: q, k [B, T, H, K], v [B, T, HV, V], g, beta [B, T, HV] -> o [B, T, HV, V]


@torch.library.custom_op("hybridtune::gdn_chunk", mutates_args=())
def gdn_chunk_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor | None,
    chunk_indices: torch.Tensor | None,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (o [B, T, HV, V] in v.dtype, g_cum [B, T, HV] fp32, A [B, T, HV, 64] in k.dtype).

    g_cum and A are what FLA's backward needs (chunk-local cumulative gate, solved WY matrix); they are
    outputs so that autograd saves them like any activation. The reference path returns zeros there."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    if _use_fla(q):
        f = fla_adapter.load()
        cu, ci = _varlen(cu_seqlens, chunk_indices, q.device)
        qc, kc = q.contiguous(), k.contiguous()
        if use_qk_l2norm:
            qc, _ = f.l2norm_fwd(qc)
            kc, _ = f.l2norm_fwd(kc)
        if chunk_backend.for_op((H, HV, K, v.shape[3])).name == chunk_backend.FLASH_QLA:
            g_cum, A, o, *_ = fla_adapter.flash_qla().chunk_gated_delta_rule_fwd(
                q=qc,
                k=kc,
                v=v.contiguous(),
                g=g.float().contiguous(),
                beta=beta.contiguous(),
                scale=scale,
                initial_state=None,
                cu_seqlens=cu,
                output_final_state=False,
                is_train=True,  # the intra-card split must match the backward's (which decides with is_train=True)
                auto_cp=_flash_qla_auto_cp(q),
            )
            return o.to(v.dtype).contiguous(), g_cum.float().contiguous(), A.to(k.dtype).contiguous()
        g_cum, o, A, *_ = fla_adapter.keywords(
            f.gdn_fwd,
            q=qc,
            k=kc,
            v=v.contiguous(),
            g=g.float().contiguous(),
            beta=beta.contiguous(),
            scale=scale,
            initial_state=None,
            output_final_state=False,
            cu_seqlens=cu,
            chunk_indices=ci,
        )
        return o.to(v.dtype).contiguous(), g_cum.float().contiguous(), A.to(k.dtype).contiguous()
    o = chunk_gated_delta_rule_ref(q, k, v, g, beta, scale=scale, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm)
    return o.contiguous(), g.new_zeros(B, T, HV, dtype=torch.float32), k.new_zeros(B, T, HV, CHUNK_SIZE)


@gdn_chunk_op.register_fake
def _(q, k, v, g, beta, scale, cu_seqlens, chunk_indices, use_qk_l2norm):
    B, T, H, K = q.shape
    HV = v.shape[2]
    return (
        v.new_empty(v.shape),
        g.new_empty(B, T, HV, dtype=torch.float32),
        k.new_empty(B, T, HV, CHUNK_SIZE),
    )


@torch.library.custom_op("hybridtune::gdn_chunk_bwd", mutates_args=())
def gdn_chunk_bwd_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    g_cum: torch.Tensor,
    A: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor | None,
    chunk_indices: torch.Tensor | None,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv, dg, dbeta), each shaped and typed like its input."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if _use_fla(q):
        f = fla_adapter.load()
        cu, ci = _varlen(cu_seqlens, chunk_indices, q.device)
        qc, kc = q.contiguous(), k.contiguous()
        if use_qk_l2norm:
            qc, q_rstd = f.l2norm_fwd(qc)
            kc, k_rstd = f.l2norm_fwd(kc)
        if chunk_backend.for_op((H, HV, K, V)).name == chunk_backend.FLASH_QLA:
            dq, dk, dv, db, dg, *_ = fla_adapter.flash_qla().chunk_gated_delta_rule_bwd(
                q=qc,
                k=kc,
                v=v.contiguous(),
                g=g_cum,
                beta=beta.contiguous(),
                A=A,
                do=do.contiguous(),
                dht=None,
                scale=scale,
                initial_state=None,
                cu_seqlens=cu,
                auto_cp=_flash_qla_auto_cp(q),
            )
        else:
            with fla_guard.lifted((H, HV, K, V)):
                dq, dk, dv, db, dg, *_ = fla_adapter.keywords(
                    f.gdn_bwd,
                    q=qc,
                    k=kc,
                    v=v.contiguous(),
                    g=g_cum,
                    beta=beta.contiguous(),
                    A=A,
                    scale=scale,
                    initial_state=None,
                    do=do.contiguous(),
                    dht=None,
                    cu_seqlens=cu,
                    chunk_indices=ci,
                )
        if use_qk_l2norm:
            dq = f.l2norm_bwd(qc, q_rstd, dq)
            dk = f.l2norm_bwd(kc, k_rstd, dk)
        return tuple(d.to(t.dtype).contiguous() for d, t in ((dq, q), (dk, k), (dv, v), (dg, g), (db, beta)))
    with _autograd_inside_op():
        ins = [t.detach().requires_grad_() for t in (q, k, v, g, beta)]
        o = chunk_gated_delta_rule_ref(*ins, scale=scale, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm)
        grads = torch.autograd.grad(o, ins, do)
    return tuple(d.contiguous() for d in grads)


@gdn_chunk_bwd_op.register_fake
def _(do, q, k, v, g, beta, g_cum, A, scale, cu_seqlens, chunk_indices, use_qk_l2norm):
    return tuple(t.new_empty(t.shape) for t in (q, k, v, g, beta))


def _gdn_setup(ctx, inputs, output):
    q, k, v, g, beta, scale, cu_seqlens, chunk_indices, use_qk_l2norm = inputs
    _, g_cum, A = output
    ctx.save_for_backward(q, k, v, g, beta, g_cum, A, cu_seqlens, chunk_indices)
    ctx.scale = scale
    ctx.use_qk_l2norm = use_qk_l2norm


def _gdn_backward(ctx, do, _dg_cum, _dA):
    q, k, v, g, beta, g_cum, A, cu_seqlens, chunk_indices = ctx.saved_tensors
    dq, dk, dv, dg, dbeta = torch.ops.hybridtune.gdn_chunk_bwd(
        do, q, k, v, g, beta, g_cum, A, ctx.scale, cu_seqlens, chunk_indices, ctx.use_qk_l2norm
    )
    return dq, dk, dv, dg, dbeta, None, None, None, None


gdn_chunk_op.register_autograd(_gdn_backward, setup_context=_gdn_setup)


# ---------------------------------------------------------------------------------------------------
# Python entry points (argument checks happen here, on shapes only, so they trace)


def _check_packed(batch: int, cu_seqlens: torch.Tensor | None) -> None:
    if cu_seqlens is not None and batch != 1:
        raise ValueError(
            f"packed input (cu_seq_lens given) needs batch size 1, got batch size {batch}; "
            "hybridtune.data.PackedCollator lays the documents end to end in one [1, T] row"
        )


# Inside a compiled region: "traced" (the reference's tensor code, fused by inductor), "stacked" (the same as
# one product-and-sum over the W taps, `causal_conv1d_stacked`) or "op" (the opaque op: FLA's kernel on CUDA).
# `conv_in_graph(...)` switches it per process; the bench compares them (`conv=` mode option).
CONV_FORMS = {"traced": causal_conv1d_ref, "stacked": causal_conv1d_stacked, "op": None}
_CONV_IN_GRAPH = ["traced"]


def conv_in_graph(mode: str | None = None) -> str:
    """The conv's form inside compiled regions; with `mode` (one of CONV_FORMS), set it first (before compiling)."""
    if mode is not None:
        if mode not in CONV_FORMS:
            raise ValueError(f"conv_in_graph: mode must be one of {', '.join(map(repr, CONV_FORMS))}, got {mode!r}")
        _CONV_IN_GRAPH[0] = mode
    return _CONV_IN_GRAPH[0]


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv, documents kept apart. x [B, T, D], weight [D, W] -> y [B, T, D].

    Inside a compiled region the conv is the reference's plain tensor code (shifted copies masked by
    each token's position in its document, from `cu_seqlens` with `searchsorted`: no host sync), which
    inductor fuses with its neighbours into one pointwise kernel, forward and backward. Eager calls the
    opaque op (FLA's kernel on CUDA): there each launch from Python costs more than the kernel, and
    inside a graph the op's Python launch path was the largest CPU cost of a step (bench profile). Under
    CUDA graphs that launch cost is gone, so `conv_in_graph("op")` keeps the op in the graph instead."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d supports activation 'silu' or None, got {activation!r}")
    _check_packed(x.shape[0], cu_seqlens)
    traced = CONV_FORMS[_CONV_IN_GRAPH[0]]
    if traced is not None and torch.compiler.is_compiling():
        return traced(x, weight, bias, cu_seqlens, activation)
    return torch.ops.hybridtune.causal_conv1d(x, weight, bias, cu_seqlens, chunk_indices, activation is not None)


def qk_l2norm(x: torch.Tensor) -> torch.Tensor:
    """l2norm over the head dim in fp32, returned in x's dtype (what FLA's l2norm_fwd computes)."""
    return l2norm(x.float()).to(x.dtype)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Chunked gated delta rule. q, k [B, T, H, K], v [B, T, HV, V] (HV a multiple of H),
    g (log decay, any float dtype, fp32 recommended) and beta [B, T, HV] -> o [B, T, HV, V]."""
    if q.shape[2] == 0 or v.shape[2] % q.shape[2] != 0:
        raise ValueError(f"value heads ({v.shape[2]}) must be a multiple of key heads ({q.shape[2]})")
    _check_packed(q.shape[0], cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if use_qk_l2norm and torch.compiler.is_compiling():
        # In a graph the q/k l2norm fuses into the kernels that produce q and k (and its backward into
        # theirs), instead of four more Python-launched kernels inside the op. Same math: fp32, eps 1e-6,
        # result in the input dtype, as FLA's l2norm kernel.
        q, k = qk_l2norm(q), qk_l2norm(k)
        use_qk_l2norm = False
    o, _, _ = torch.ops.hybridtune.gdn_chunk(q, k, v, g, beta, scale, cu_seqlens, chunk_indices, use_qk_l2norm)
    return o
