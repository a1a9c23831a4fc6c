"""The GatedDeltaNet mixer's registry entry (`SPEC`): its families, cost model, batch metadata, kept core, kernel
package (FLA, the one `kernels.needs` lists), self-test (selftest.py), settings under CUDA graphs, profile patterns
and path report. Torch-free at import; what needs torch is imported where it is called.

Batch metadata: `gdn_chunk_indices` int32 [C, 2], (document, chunk within document) of every 64-token chunk; C
varies per batch (dim 0 dynamic) and is the mixer's `size`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

from hybridtune.batch import CU_SEQ_LENS_Q
from hybridtune.mixers.registry import (
    CUDA_GRAPHS,
    CUDA_GRAPHS_STEP,
    Activations,
    Family,
    KernelPackage,
    LayerFlops,
    MixerSpec,
)

logger = logging.getLogger(__name__)

CHUNK_INDICES = "gdn_chunk_indices"
# The delta rule's chunk length (FLA's kernels and the reference's).
CHUNK_SIZE = 64
# The delta-rule kernels' share of a training step's GPU time for the 2B shape at 4096-token packs, from its
# profile (docs/INTERNALS.md). They work per 64-token chunk, everything else per token, so a static layout's
# filler document is weighted by it (`data.collator.StaticLayout.filler_cost`).
TIME_SHARE = 0.12
LAYER_TYPE = "linear_attention"
# The conv's forms inside compiled graphs (ops.CONV_FORMS): the bench's `conv=` option, "op" under CUDA graphs.
CONV_FORMS = ("traced", "stacked", "op")
# FLA's kernels in a profile: the delta rule's chunked stages, the conv, the l2norm.
PROFILE_PATTERNS = ("chunk_", "gated_delta", "causal_conv1d", "l2norm", "recompute_w_u", "solve_tril", "kkt")


def _turn_off(reason: str | None) -> None:
    from hybridtune.mixers.gdn import fla_adapter  # why here: keeps this spec's import to the registry

    fla_adapter.turn_off(reason)


FLA = KernelPackage(
    name="fla",
    distributions=("flash-linear-attention==0.6.0", "fla-core==0.6.0"),
    check_code="import fla.ops.gated_delta_rule, fla.modules.causal_conv1d",
    accelerates="GatedDeltaNet chunked delta rule (forward and backward), gated RMSNorm, Triton causal conv",
    fallback_cost=(
        "torch reference recurrence: a Python-level loop per chunk instead of fused kernels, far slower "
        "per GDN layer (transformers warns about it too)"
    ),
    fix="pip install --only-binary=:all: flash-linear-attention==0.6.0 fla-core==0.6.0",
    turn_off=_turn_off,
    gates=("is_flash_linear_attention_available",),
    covers=("causal_conv1d",),  # FLA's Triton conv is what hybridtune's conv op runs
)


def chunk_count(doc_lens: Sequence[int]) -> int:
    """C: the 64-token chunks of documents of `doc_lens` (each document starts a chunk)."""
    return sum(-(-int(n) // CHUNK_SIZE) for n in doc_lens)


def _metadata(doc_lens: Sequence[int]) -> dict:
    from hybridtune.mixers.gdn.core import chunk_indices  # why here: torch, imported when a batch is collated

    return {CHUNK_INDICES: chunk_indices(doc_lens, CHUNK_SIZE)}


def _forward(project):
    from hybridtune.mixers.gdn.core import gdn_core  # why here: torch and the ops, loaded with the routing

    def forward(module, hidden_states, attention_mask, kwargs):
        return gdn_core(
            module, hidden_states, attention_mask, project, kwargs.get(CU_SEQ_LENS_Q), kwargs.get(CHUNK_INDICES)
        )

    return forward


def _describe(name: str):
    def describe(m) -> str:
        H, HV, K, V = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
        return (
            f"{name} -> hybridtune::causal_conv1d + hybridtune::gdn_chunk "
            f"(H={H}, HV={HV}, K={K}, V={V}) without cache; upstream with cache"
        )

    return describe


@functools.cache
def _routing() -> tuple[Family, ...]:
    from hybridtune.mixers.gdn import core, qwen3_5, qwen3_next  # why here: torch, loaded when a model is patched

    return tuple(
        Family(a.NAME, a.matches, _forward(a.project), core.core_unsupported, _describe(a.NAME))
        for a in (qwen3_5, qwen3_next)
    )


def _dims(c) -> tuple[int, int, int, int]:
    """(num_k_heads, num_v_heads, key_head_dim, value_head_dim) of the linear-attention layers."""
    return c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim


def _flops(c, layers: int, tokens: float, sq: float) -> LayerFlops:
    """Megatron-LM's `gdn_layer_flops` for the core: 2 * tokens * (num_v_heads * K * V * 4) per layer, forward; the
    depthwise conv over 2 * key_dim + value_dim channels as weights; projections as transformers' modeling code
    has them (Qwen3-Next fuses qkvz and ba)."""
    h = c.hidden_size
    hk, hv, dk, dv = _dims(c)
    key_dim, value_dim = hk * dk, hv * dv
    if c.model_type == "qwen3_next":
        proj = [("linear_attn.in_proj_qkvz", h, 2 * key_dim + 2 * value_dim), ("linear_attn.in_proj_ba", h, 2 * hv)]
    else:
        proj = [
            ("linear_attn.in_proj_qkv", h, 2 * key_dim + value_dim),
            ("linear_attn.in_proj_z", h, value_dim),
            ("linear_attn.in_proj_b", h, hv),
            ("linear_attn.in_proj_a", h, hv),
        ]
    proj.append(("linear_attn.out_proj", value_dim, h))
    core = layers * tokens * 2.0 * 4 * hv * dk * dv
    conv = layers * c.linear_conv_kernel_dim * (2 * key_dim + value_dim)
    return LayerFlops(tuple(proj), core=core, weights=conv)


def _activations(c) -> Activations:
    """Per token: the conv's input and output, normalised q and k, the within-chunk matrix, the output, gate z and
    the gated norm's output; kept core: the delta rule's output, solved WY matrix and fp32 cumulative gate (fp32
    counted as two 16-bit elements); the backward's fp32 chunk states and their gradients."""
    g = lambda name: getattr(c, name, None) or 0  # noqa: E731
    kh, vh, kd, vd = (
        g(n) for n in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    )
    qk, v, state = kh * kd, vh * vd, vh * kd * vd
    conv = 2 * qk + v
    return Activations(
        saved=2 * conv + 2 * qk + CHUNK_SIZE * vh + 3 * v,
        core=v + CHUNK_SIZE * vh + 2 * vh,
        backward_fp32=2 * state // CHUNK_SIZE,
    )


def _core_ops():
    import torch  # why here: the registry is torch-free

    import hybridtune.mixers.gdn.ops  # noqa: F401  (defines torch.ops.hybridtune.gdn_chunk)

    return {torch.ops.hybridtune.gdn_chunk.default}


def _path(module) -> tuple[str, bool]:
    from hybridtune.mixers.gdn.paths import op_path  # why here: importing the ops registers them (torch)

    return op_path(module)


def _backend(device: str) -> str:
    from hybridtune.mixers.gdn import ops  # why here: importing the ops registers them (torch)

    return ops.backend(device)[1]


def _selftest():
    from hybridtune.mixers.gdn.selftest import SUITE  # why here: loaded when the self-test runs

    return SUITE


def _graph_setup(what: str) -> Callable[[], None] | None:
    """Under CUDA graphs FLA's tensor cache is off (it would keep tensors of the graphs' pool alive across replays);
    a training step under them keeps the conv as the op (its launch cost is gone there); `conv=FORM` sets the form."""
    from hybridtune.mixers.gdn import fla_adapter, ops  # why here: torch and the ops, loaded before a compile

    if what in (CUDA_GRAPHS, CUDA_GRAPHS_STEP) and fla_adapter.disable_tensor_cache():
        logger.info("cuda graphs: FLA's tensor cache switched off")
    form = "op" if what == CUDA_GRAPHS_STEP else what.removeprefix("conv=") if what.startswith("conv=") else None
    if form is None:
        return None
    previous = ops.conv_in_graph()
    ops.conv_in_graph(form)
    return lambda: ops.conv_in_graph(previous)


SPEC = MixerSpec(
    kind="gdn",
    layer_types=(LAYER_TYPE,),
    routing=_routing,
    flops=_flops,
    core_kept=True,
    core_names=("gdn_core", "gdn_conv"),
    activations=_activations,
    batch_keys=(CHUNK_INDICES,),
    dynamic_keys=(CHUNK_INDICES,),
    metadata=_metadata,
    size=chunk_count,
    size_name="GDN chunk",
    time_share=TIME_SHARE,
    core_ops=_core_ops,
    kernels=(FLA,),
    selftest=_selftest,
    graph_setup=_graph_setup,
    graph_forms={"conv": CONV_FORMS},
    profile_patterns=("gdn (fla)", PROFILE_PATTERNS),
    path=_path,
    backend=_backend,
)
