"""Attention for packed batches: the collator's varlen kwargs straight into a varlen kernel.

Registered with transformers as the attention implementation `hybridtune_varlen`:
    - packed CUDA batch (`cu_seq_lens_q/k` given): torch's `torch.nn.attention.varlen.varlen_attn`
      (causal via `window_size=(-1, 0)`; grouped k/v repeated where the installed torch lacks
      `enable_gqa`). `max_length_q/k` are not read: the row length T bounds every document and is
      already a dynamic size, so a new longest document never recompiles the loop.
    - anything else: transformers' SDPA path; a packed row (`cu_seq_lens_q` given, no cache) with the causal
      document mask from those boundaries, never from position ids; otherwise the mask it was given, or with no
      mask and restarting `position_ids` (a packed row without varlen kwargs) a causal document mask from them.
Its mask function is transformers' flash-attention one on CUDA (no [T, T] mask for packed batches) and the SDPA
one elsewhere. flash-attn, when installed and chosen (`flash_attention_2`), reads the same kwargs; `patch_model`
keeps it.
"""

from __future__ import annotations

import inspect
import logging

import torch

from hybridtune.batch import CU_SEQ_LENS_K, CU_SEQ_LENS_Q, POSITION_IDS

IMPLEMENTATION = "hybridtune_varlen"

logger = logging.getLogger(__name__)


def _resolve_varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


# Resolved at import, not inside the traced attention call.
_VARLEN_ATTN, _VARLEN_GQA = _resolve_varlen_attn()


def varlen_available() -> tuple[bool, str]:
    if _VARLEN_ATTN is None:
        return False, f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    return True, "torch.nn.attention.varlen.varlen_attn"


def _document_mask(cu: torch.Tensor, T: int, device) -> torch.Tensor:
    """bool [1, 1, T, T]: causal within each document of a packed row (`cu`: its cumulative lengths)."""
    # (all of `cu`, not cu[1:]: a slice's layout check guards its length, and a one-document row recompiled)
    doc = torch.searchsorted(cu.to(device=device, dtype=torch.int64), torch.arange(T, device=device), right=True) - 1
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return (causal & (doc[:, None] == doc[None, :]))[None, None]


def _sdpa_fallback(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get(POSITION_IDS)
    cu_q = kwargs.get(CU_SEQ_LENS_Q)
    T = query.shape[-2]
    if cu_q is not None and query.shape[0] == 1 and T > 1 and key.shape[-2] == T and getattr(module, "is_causal", True):
        # A packed row: its documents from the collator's boundaries, never from position ids (a vision-language
        # model's rows are its own M-RoPE positions, and the mask transformers built from them is ignored).
        attention_mask = _document_mask(cu_q, T, query.device)
    elif attention_mask is None and position_ids is not None and query.shape[-2] > 1:
        # Never let packed documents see each other: document id = number of position restarts so far.
        pos = position_ids.reshape(-1, position_ids.shape[-1])
        doc = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)  # [B, T]
        T = query.shape[-2]
        causal = torch.ones(T, T, dtype=torch.bool, device=query.device).tril()
        attention_mask = (causal[None] & (doc[:, :, None] == doc[:, None, :]))[:, None]
    elif attention_mask is not None and attention_mask.dim() == 2:
        # flash-style 2-D padding mask [B, L] over the L tokens so far (past and these T): a boolean causal & padding
        # mask [B, 1, T, S] over the S keys. A static cache's keys run past L (its unwritten slots: never seen).
        T, S, L = query.shape[-2], key.shape[-2], attention_mask.shape[-1]
        seen = attention_mask.bool()
        seen = torch.nn.functional.pad(seen, (0, S - L), value=False) if L < S else seen[:, L - S :]
        at = torch.arange(T, device=query.device) + (L - T)  # each query's position among the L tokens
        causal = torch.arange(S, device=query.device)[None, :] <= at[:, None]
        attention_mask = causal[None, None] & seen[:, None, None, :]
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


_warned_fp32 = False


def _half_dtype(query: torch.Tensor, value: torch.Tensor) -> torch.dtype | None:
    """The 16-bit dtype the varlen kernel should run in, or None (fp32 without autocast).

    Under autocast, v is a projection's output and already 16-bit; q and k pass through fp32 norms and
    rotary. Reading v's dtype (not the autocast state) keeps this traceable in a fullgraph region.
    """
    for t in (query, value):
        if t.dtype in (torch.float16, torch.bfloat16):
            return t.dtype
    return None


def _warn_fp32_once() -> None:
    global _warned_fp32
    if not _warned_fp32 and not torch.compiler.is_compiling():
        _warned_fp32 = True
        logger.warning(
            "packed attention in fp32 without autocast: the varlen kernel needs fp16/bf16, so SDPA with a "
            "[T, T] document mask runs instead (slower, more memory); train with bf16 for the fast path"
        )


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    """query [B, H, T, D], key/value [B, Hkv, T, D] -> (out [B, T, H, D], None)."""
    cu_q = kwargs.get(CU_SEQ_LENS_Q)
    fn, has_gqa = _VARLEN_ATTN, _VARLEN_GQA
    if cu_q is None or fn is None or not query.is_cuda:
        return _sdpa_fallback(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    half = _half_dtype(query, value)
    if half is None:
        _warn_fp32_once()
        return _sdpa_fallback(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    # q/k come out of fp32 norms and rotary even under autocast; the flash kernel takes fp16/bf16 only,
    # so cast to the autocast dtype as autocast itself would for a matmul.
    query, key, value = query.to(half), key.to(half), value.to(half)
    if dropout:
        raise ValueError(f"{IMPLEMENTATION} attention has no dropout; got attention dropout {dropout}")
    B, H, T, D = query.shape
    if B != 1:
        raise ValueError(
            f"packed batch (cu_seq_lens_q given) must have batch size 1, got query of shape {tuple(query.shape)}"
        )
    cu_k = kwargs.get(CU_SEQ_LENS_K)
    cu_k = cu_q if cu_k is None else cu_k
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    extra = {}
    if k.shape[1] != H:
        if has_gqa:
            extra["enable_gqa"] = True
        else:
            k = k.repeat_interleave(H // k.shape[1], dim=1)
            v = v.repeat_interleave(H // v.shape[1], dim=1)
    out = fn(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), T, T, scale=scaling, window_size=(-1, 0), **extra)
    return out[None], None


def varlen_mask(*args, device: torch.device | str = "cpu", **kwargs):
    """transformers mask function: flash-style (None or the 2-D padding mask) where the varlen kernel
    runs (CUDA), SDPA's boolean mask elsewhere."""
    from transformers.masking_utils import flash_attention_mask, sdpa_mask

    if torch.device(device).type == "cuda" and _VARLEN_ATTN is not None:
        return flash_attention_mask(*args, **kwargs)
    return sdpa_mask(*args, device=device, **kwargs)


def register() -> str:
    """Register `hybridtune_varlen` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, varlen_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, varlen_mask)
    return IMPLEMENTATION
