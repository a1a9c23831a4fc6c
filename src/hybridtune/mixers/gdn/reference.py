"""Pure-torch references for the GatedDeltaNet ops: the test oracle and the CPU implementation.

Both functions compute in fp32 (fp64 stays fp64, so gradient checks can run in double) and return
their output in the input dtype. Packed inputs (`cu_seqlens`, int32/int64 [N + 1]) need batch size 1;
documents never exchange state: the conv zero-pads at every document start and the delta-rule state
restarts at zero (or at `initial_state[n]`) for every document.

Shapes:
    causal_conv1d_ref:          x [B, T, D], weight [D, W], bias [D]          -> y [B, T, D]
    chunk_gated_delta_rule_ref: q, k [B, T, H, K], v [B, T, HV, V], g, beta [B, T, HV]
                                -> o [B, T, HV, V] (and final state [N, HV, K, V] when asked)
HV must be a multiple of H; value head `j` reads key head `j // (HV // H)` (the `repeat_interleave`
layout transformers and FLA both use).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64
L2NORM_EPS = 1e-6


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_packed(batch: int, cu_seqlens: torch.Tensor | None, seq_len: int) -> None:
    if cu_seqlens is None:
        return
    if batch != 1:
        raise ValueError(
            f"packed input (cu_seqlens given) needs batch size 1, got batch size {batch}; "
            "lay the documents end to end in one row (hybridtune.data.PackedCollator does)"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")


def position_in_document(cu_seqlens: torch.Tensor, seq_len: int, device: torch.device) -> torch.Tensor:
    """int64 [T]: index of each token inside its document (0 at every document start).

    Pure tensor ops (`searchsorted`), no host sync, so it also traces.
    """
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    t = torch.arange(seq_len, device=device, dtype=torch.int64)
    # cu[0] = 0 <= t < T = cu[-1], so doc lies in [0, N - 1]; empty documents (repeated entries) are skipped.
    # No slice of cu: a traced slice would specialise on N == 1 and recompile for single-document packs.
    doc = torch.searchsorted(cu, t, right=True) - 1
    return t - cu[doc]


def _conv_taps(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None, activation: str | None, who: str
) -> tuple[torch.dtype, list[torch.Tensor]]:
    """Checks the conv's arguments; returns the compute dtype and taps[s] = x[t - s] (0 before the start of t's
    document) in it, for s = 0 .. min(W, T) - 1 (a shift of T or more is all zeros)."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"{who}: activation must be 'silu', 'swish' or None, got {activation!r}")
    B, T, D = x.shape
    if weight.dim() != 2 or weight.shape[0] != D:
        raise ValueError(f"weight must be [D={D}, W], got {tuple(weight.shape)}")
    _check_packed(B, cu_seqlens, T)
    dt = _compute_dtype(x, weight)
    xf = x.to(dt)
    pos = position_in_document(cu_seqlens, T, x.device) if cu_seqlens is not None else None
    taps = [xf]
    for s in range(1, min(weight.shape[1], T)):
        shifted = F.pad(xf, (0, 0, s, 0))[:, :T]  # shifted[t] = x[t - s]
        taps.append(shifted * (pos >= s).to(dt)[None, :, None] if pos is not None else shifted)
    return dt, taps


def _conv_out(y: torch.Tensor, bias: torch.Tensor | None, activation: str | None, out_dtype: torch.dtype):
    if bias is not None:
        y = y + bias.to(y.dtype)
    if activation is not None:
        y = F.silu(y)
    return y.to(out_dtype)


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv over time, documents kept apart.

    x [B, T, D] (time-major), weight [D, W], bias [D] or None, cu_seqlens [N + 1] or None.
    y[t] = act(bias + sum_w weight[:, w] * x[t - (W - 1) + w]), with x taken as 0 before the start
    of t's document. activation: "silu"/"swish" or None. Returns y [B, T, D] in x.dtype.
    """
    dt, taps = _conv_taps(x, weight, cu_seqlens, activation, "causal_conv1d_ref")
    w = weight.to(dt)
    W = w.shape[1]
    y = taps[0] * w[:, W - 1]
    for s in range(1, len(taps)):
        y = y + taps[s] * w[:, W - 1 - s]
    return _conv_out(y, bias, activation, x.dtype)


def causal_conv1d_stacked(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """`causal_conv1d_ref` written as one product-and-sum over a [B, T, D, W] stack of the masked shifted copies
    (same arguments, same numbers up to the order of the W-term sum). For compilers: the weight gradient is then
    one reduction over T of that stack, which inductor can fuse with the stack's producers, where the tap-by-tap
    form gives one [T, D] product per tap, each reduced on its own."""
    dt, taps = _conv_taps(x, weight, cu_seqlens, activation, "causal_conv1d_stacked")
    W = weight.shape[1]
    # weight[:, k] multiplies x[t - s] with s = W - 1 - k; shifts of T or more contribute zeros
    stack = torch.stack([taps[W - 1 - k] if W - 1 - k < len(taps) else torch.zeros_like(taps[0]) for k in range(W)], -1)
    return _conv_out((stack * weight.to(dt)).sum(-1), bias, activation, x.dtype)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as FLA's kernel computes it."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _gdn_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h0: torch.Tensor | None,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent sequences of one length L, chunked WY form, any leading dims `*S`:
    q, k [*S, L, K] (normalised, scaled q), v [*S, L, V], g, beta [*S, L]; h0 [*S, K, V] or None.
    Returns o [*S, L, V] and the final state [*S, K, V]. Rows past a sequence's end must carry
    k = v = beta = g = 0: they then change neither the state nor the earlier outputs."""
    *lead, L, K = k.shape
    V = v.shape[-1]
    pad = (-L) % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (L + pad) // chunk
    q, k, v = (t.reshape(*lead, n, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(*lead, n, chunk), beta.reshape(*lead, n, chunk)

    gc = g.cumsum(-1)  # [*S, n, C] log decay from the chunk start
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # exp(gc_i - gc_j) for j <= i; masked to -inf first so that exp never overflows above the diagonal.
    diff = gc[..., :, None] - gc[..., None, :]
    decay = torch.where(causal, diff, torch.full_like(diff, float("-inf"))).exp()
    k_beta = k * beta[..., None]
    strict = torch.tril((k_beta @ k.transpose(-1, -2)) * decay, -1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    # WY representation: T = (I + strictly-lower(beta k k^T decay))^-1
    tri = torch.linalg.solve_triangular(eye + strict, eye.expand_as(strict), upper=False, unitriangular=True)
    u = tri @ (v * beta[..., None])  # [*S, n, C, V]
    w = tri @ (k_beta * gc.exp()[..., None])  # [*S, n, C, K]
    qk = (q @ k.transpose(-1, -2)) * decay  # causal mask already in decay (zeros above diagonal)
    q_decay = q * gc.exp()[..., None]
    last = gc[..., -1]  # [*S, n]
    k_to_end = k * (last[..., None] - gc).exp()[..., None]

    state = h0 if h0 is not None else q.new_zeros(*lead, K, V)
    outs = []
    for i in range(n):
        v_new = u[..., i, :, :] - w[..., i, :, :] @ state
        outs.append(q_decay[..., i, :, :] @ state + qk[..., i, :, :] @ v_new)
        state = state * last[..., i].exp()[..., None, None] + k_to_end[..., i, :, :].transpose(-1, -2) @ v_new
    o = torch.stack(outs, -3).reshape(*lead, n * chunk, V)[..., :L, :]
    return o, state


def chunk_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = CHUNK_SIZE,
):
    """Gated delta rule, chunked; the documents of a packed row run side by side (padded to the longest).

    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV] (log decay, <= 0); beta [B, T, HV];
    scale defaults to K ** -0.5; cu_seqlens [N + 1] (needs B == 1); initial_state [N, HV, K, V]
    (N = B when not packed). Recurrence per value head, token t:
        S = exp(g_t) S;  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (scale q_t)
    with q, k l2-normalised first when `use_qk_l2norm`. Returns o [B, T, HV, V] in v.dtype, and
    with `output_final_state` also the final state [N, HV, K, V] in the compute dtype (an empty
    document's final state is its initial state).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if k.shape != q.shape:
        raise ValueError(f"q and k must have the same shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    if HV % H != 0:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({H})")
    if g.shape != (B, T, HV) or beta.shape != (B, T, HV):
        raise ValueError(f"g and beta must be [B, T, HV] = {(B, T, HV)}, got {tuple(g.shape)}, {tuple(beta.shape)}")
    _check_packed(B, cu_seqlens, T)
    dt = _compute_dtype(q, k, v, g, beta)
    scale = K**-0.5 if scale is None else scale
    qf, kf = q.to(dt), k.to(dt)
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    if HV != H:
        qf = qf.repeat_interleave(HV // H, dim=2)
        kf = kf.repeat_interleave(HV // H, dim=2)
    qf = qf * scale
    vf, gf, bf = v.to(dt), g.to(dt), beta.to(dt)
    n_states = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (n_states, HV, K, V):
        raise ValueError(f"initial_state must be {(n_states, HV, K, V)}, got {tuple(initial_state.shape)}")
    h0 = initial_state.to(dt) if initial_state is not None else None

    if cu_seqlens is None:
        # [B, HV, T, .]: every row is one sequence
        o, final = _gdn_chunked(*(t.transpose(1, 2) for t in (qf, kf, vf, gf, bf)), h0, min(chunk_size, max(T, 1)))
        o = o.transpose(1, 2)
    else:
        bounds = cu_seqlens.tolist()  # opaque op / eager only: the host copy is fine here
        if bounds[0] != 0 or bounds[-1] != T:
            raise ValueError(f"cu_seqlens must start at 0 and end at T={T}, got {bounds[0]}..{bounds[-1]}")
        docs = [n for n in range(n_states) if bounds[n + 1] > bounds[n]]
        lens = torch.tensor([bounds[n + 1] - bounds[n] for n in docs], device=q.device)
        starts = torch.tensor([bounds[n] for n in docs], device=q.device)
        L = int(lens.max())
        ar = torch.arange(L, device=q.device)
        valid = ar[None] < lens[:, None]  # [N', L]
        idx = (starts[:, None] + ar[None]).clamp_max(T - 1)  # [N', L] token index of (document, position)

        def gather(t):  # [1, T, HV, ...] -> [N', HV, L, ...], zero past each document's end
            x = t[0][idx]  # [N', L, HV, ...]
            m = valid.reshape(*valid.shape, *([1] * (x.dim() - 2))).to(x.dtype)
            return (x * m).transpose(1, 2)

        h0_docs = h0[docs] if h0 is not None else None
        o_pad, final_docs = _gdn_chunked(
            gather(qf), gather(kf), gather(vf), gather(gf), gather(bf), h0_docs, min(chunk_size, L)
        )
        # back to the packed row: token t sits at (its document, its position in it)
        doc_of = torch.searchsorted(starts, torch.arange(T, device=q.device), right=True) - 1
        pos = torch.arange(T, device=q.device) - starts[doc_of]
        o = o_pad[doc_of, :, pos][None]  # [1, T, HV, V]
        final = h0.clone() if h0 is not None else qf.new_zeros(n_states, HV, K, V)
        final = final.index_copy(0, torch.tensor(docs, device=q.device), final_docs)
    o = o.to(v.dtype)
    if not output_final_state:
        return o
    return o, final


def recurrent_gated_delta_rule_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    initial_state: torch.Tensor | None = None,
):
    """Token-by-token recurrence (slow; for tests on short sequences). Unpacked only.
    Shapes as `chunk_gated_delta_rule_ref`; returns (o [B, T, HV, V] in v.dtype, state [B, HV, K, V])."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dt = _compute_dtype(q, k, v, g, beta)
    scale = K**-0.5 if scale is None else scale
    qf, kf = q.to(dt), k.to(dt)
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    qf = qf.repeat_interleave(HV // H, dim=2) * scale
    kf = kf.repeat_interleave(HV // H, dim=2)
    vf, gf, bf = v.to(dt), g.to(dt), beta.to(dt)
    state = initial_state.to(dt) if initial_state is not None else qf.new_zeros(B, HV, K, V)
    outs = []
    for t in range(T):
        state = state * gf[:, t].exp()[..., None, None]
        kv = (state * kf[:, t, :, :, None]).sum(-2)  # S^T k  [B, HV, V]
        delta = (vf[:, t] - kv) * bf[:, t, :, None]
        state = state + kf[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((state * qf[:, t, :, :, None]).sum(-2))
    return torch.stack(outs, 1).to(v.dtype), state
