"""The attention mixer's registry entry (`SPEC`): full-attention layers' cost model and the SDPA kernels whose
outputs a checkpoint may keep. Its routing is model-wide (the `hybridtune_varlen` implementation, varlen.py, set
by models/patching.py), not per module. Torch-free at import."""

from __future__ import annotations

from hybridtune.mixers.registry import Activations, LayerFlops, MixerSpec

# SDPA's attention kernels (FlashAttention, memory-efficient, cuDNN, the CPU flash form): ops a checkpoint keeps.
# Not kept (yet): torch's varlen attention, what varlen.py runs on packed CUDA batches. It is a custom op of its own
# (`torch_attn::_varlen_attn`), opaque to the policy, so its flash kernel is recomputed; keeping it is one entry
# here, not yet checked on a GPU.
SDPA_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)


def _head_dim(c) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _flops(c, layers: int, tokens: float, sq: float) -> LayerFlops:
    """Projections (q with its output gate, k, v, o); causal attention forward per layer, (Q K^T + P V) =
    2 * (2 L^2 d H) / 2 per document, summed over documents as sum L^2 (`sq`)."""
    h, d, nq, nkv = c.hidden_size, _head_dim(c), c.num_attention_heads, c.num_key_value_heads
    proj = (
        ("self_attn.q_proj", h, nq * d * 2),  # query and its output gate
        ("self_attn.k_proj", h, nkv * d),
        ("self_attn.v_proj", h, nkv * d),
        ("self_attn.o_proj", nq * d, h),
    )
    return LayerFlops(proj, core=layers * 2.0 * sq * d * nq)


def _activations(c) -> Activations:
    """Per token: q with its output gate, k, v; rotated q and k; the output and the gated one; fp32 lse. Kept core:
    the output and the fp32 log-sum-exp (fp32 counted as two 16-bit elements)."""
    g = lambda name, default=0: getattr(c, name, None) or default  # noqa: E731
    hidden, heads = g("hidden_size"), g("num_attention_heads", 1)
    head_dim = g("head_dim", hidden // max(heads, 1))
    q, kv = heads * head_dim, g("num_key_value_heads", heads) * head_dim
    return Activations(saved=5 * q + 3 * kv + 2 * heads, core=q + 2 * heads)


def _core_ops():
    import torch  # why here: the registry is torch-free

    aten = torch.ops.aten
    return {getattr(aten, n).default for n in SDPA_OPS if hasattr(aten, n)}


SPEC = MixerSpec(
    kind="attention",
    layer_types=("full_attention",),
    flops=_flops,
    core_kept=False,  # varlen attention is recomputed on packed CUDA batches; the FLOP count charges it
    core_names=("attention", ""),
    activations=_activations,
    core_ops=_core_ops,
)
