"""The GatedDeltaNet mixer's device self-test suite (`SUITE`, behind `MixerSpec.selftest`; kernels/selftest.py runs it).

Per head layout of a config (`Layout`): hybridtune's custom ops (`ops`) against `reference` in fp32 on a small packed
input of three documents (63, 75 and 130 tokens; q, k [1, T, H, K], v [1, T, HV, V], g [1, T, HV]; the conv x
[1, T, D]), forward and every gradient, each as FLA's relative RMS ||ref - out|| / ||ref||. The delta rule's trial
holds a grant of `fla_guard` for its layout; a pass keeps it, a failure revokes it. Torch and the ops are imported
when a check runs.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from typing import Any

from hybridtune.mixers.gdn import backend as chunk_backend
from hybridtune.mixers.gdn import fla_adapter, fla_guard, tuned
from hybridtune.models.anatomy import text_config

log = logging.getLogger(__name__)

DOC_LENGTHS = (63, 75, 130)
CHUNK, CONV = "gdn_chunk", "causal_conv1d"  # the verdicts' kernel names: the delta rule (guarded) and the conv
FIX_HOPPER = (
    "upgrade Triton to >= 3.7.1 (pip install 'triton>=3.7.1') or install tilelang (pip install tilelang); "
    "until then this head layout runs the slow torch reference backward"
)
GUARD_NOTE = "FLA Hopper guard: active (GDN backward refused until a layout passes the self-test)"
HF_GUARD_NOTE = (
    "FLA's Hopper guard (fla #640) bypassed for this whole process (fla.ops.common.chunk_o.IS_NVIDIA_HOPPER = "
    "False): plain transformers has no per-shape hook, and without the bypass its GDN backward refuses to run"
)


@dataclass(frozen=True, order=True)
class Layout:
    """A GatedDeltaNet head layout: H key heads, HV value heads (a multiple of H), head dims K and V."""

    H: int
    HV: int
    K: int
    V: int
    conv_kernel: int = 4

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.H, self.HV, self.K, self.V)

    @property
    def conv_dim(self) -> int:
        return 2 * self.H * self.K + self.HV * self.V  # channels of the conv over [q | k | v]

    def __str__(self) -> str:
        return f"H={self.H} HV={self.HV} K={self.K} V={self.V}"


def layouts(config: Any) -> list[Layout]:
    """The GDN head layouts of a transformers config (its text config's); empty when it has no GDN mixer."""
    text = text_config(config)
    dims = [getattr(text, a, None) for a in ("linear_num_key_heads", "linear_num_value_heads")]
    dims += [getattr(text, a, None) for a in ("linear_key_head_dim", "linear_value_head_dim")]
    if any(not isinstance(d, int) or d <= 0 for d in dims):
        return []
    conv = getattr(text, "linear_conv_kernel_dim", 4) or 4
    return [Layout(*dims, conv_kernel=int(conv))]


def parse_layout(text: str) -> Layout:
    """`H,HV,K,V[,W]` (or with x) -> Layout; ValueError otherwise."""
    parts = [int(p) for p in text.replace("x", ",").split(",")]
    if len(parts) not in (4, 5):
        raise ValueError(f"layout '{text}' must be H,HV,K,V[,W]")
    return Layout(*parts)


def rel_rms(ref, out) -> float:
    """FLA's error ratio: RMS of the difference over RMS of the reference (inf when `out` is not finite)."""
    import torch  # why here: the suite is read (layouts, names) where torch need not load

    ref, out = ref.detach().double(), out.detach().double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((ref - out).square().mean().sqrt() / (ref.square().mean().sqrt() + 1e-12)).item()


def _packed_lengths(device, lengths=DOC_LENGTHS):
    import torch  # why here: as in rel_rms

    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return bounds[-1], torch.tensor(bounds, dtype=torch.int32, device=device)


def _check_gdn(layout: Layout, device, lengths: tuple[int, ...] = DOC_LENGTHS) -> dict[str, float]:
    import torch  # why here: as in rel_rms; the ops register custom ops on import
    import torch.nn.functional as F

    from hybridtune.mixers.gdn import ops as gdn
    from hybridtune.mixers.gdn import reference

    T, cu = _packed_lengths(device, lengths)
    gen = torch.Generator().manual_seed(0)
    H, HV, K, V = layout.key
    bf16 = torch.bfloat16
    q = torch.randn(1, T, H, K, generator=gen).to(device, bf16)
    k = torch.randn(1, T, H, K, generator=gen).to(device, bf16)
    v = torch.randn(1, T, HV, V, generator=gen).to(device, bf16)
    g = F.logsigmoid(torch.randn(1, T, HV, generator=gen)).to(device, torch.float32)  # log decay, fp32 as in Qwen3.5
    beta = torch.rand(1, T, HV, generator=gen).to(device, bf16)
    do = torch.randn(1, T, HV, V, generator=gen).to(device, bf16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    o = gdn.chunk_gated_delta_rule(*leaves, cu_seqlens=cu, use_qk_l2norm=True)
    grads = torch.autograd.grad(o, leaves, do)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v, g, beta)]
    o_ref = reference.chunk_gated_delta_rule_ref(*ref_leaves, cu_seqlens=cu, use_qk_l2norm=True)
    grads_ref = torch.autograd.grad(o_ref, ref_leaves, do.float())
    names = ("dq", "dk", "dv", "dg", "dbeta")
    return {"o": rel_rms(o_ref, o), **{n: rel_rms(r, x) for n, r, x in zip(names, grads_ref, grads)}}


def _check_conv(layout: Layout, device, lengths: tuple[int, ...] = DOC_LENGTHS) -> dict[str, float]:
    import torch  # why here: as in _check_gdn

    from hybridtune.mixers.gdn import ops as gdn
    from hybridtune.mixers.gdn import reference

    T, cu = _packed_lengths(device, lengths)
    gen = torch.Generator().manual_seed(1)
    D, W = layout.conv_dim, layout.conv_kernel
    x = torch.randn(1, T, D, generator=gen).to(device, torch.bfloat16)
    w = (torch.randn(D, W, generator=gen) * W**-0.5).to(device, torch.bfloat16)
    dy = torch.randn(1, T, D, generator=gen).to(device, torch.bfloat16)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = gdn.causal_conv1d(xs, ws, None, cu_seqlens=cu, activation="silu")
    dx, dw = torch.autograd.grad(y, [xs, ws], dy)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
    yr = reference.causal_conv1d_ref(xr, wr, None, cu, "silu")
    dxr, dwr = torch.autograd.grad(yr, [xr, wr], dy.float())
    return {"y": rel_rms(yr, y), "dx": rel_rms(dxr, dx), "dweight": rel_rms(dwr, dw)}


class Suite:
    """The suite kernels/selftest.py runs (the protocol: `mixers.registry.SelfTestSuite`). Its methods read this
    module's functions when called, so a test may replace one."""

    package = "fla"
    kernels = (CHUNK, CONV)
    layout_type = Layout
    # (label, distribution) of a verdict's cache key after torch; tilelang because FLA dispatches the guarded
    # backward to it when installed.
    versions = (("triton", "triton"), ("fla", "fla-core"), ("tilelang", "tilelang"))
    guard_key = "fla_hopper_guard_active"  # doctor's JSON key for `guard_active()`
    guard_note = GUARD_NOTE
    guard_fix = FIX_HOPPER
    report_key = "fla_guard"  # the bench result's key for the grants or the bypass
    option = chunk_backend.OPTION  # `gdn_backend`: FLA's Triton kernels or FlashQLA for the delta rule

    def layouts(self, config: Any) -> list[Layout]:
        return layouts(config)

    def parse_layout(self, text: str) -> Layout:
        return parse_layout(text)

    def backend(self, device) -> tuple[str, str]:
        """(backend, why) of the ops on `device`: "fla" when the fast kernels run there."""
        from hybridtune.mixers.gdn import ops  # why here: importing the ops registers them (torch)

        return ops.backend(device)

    def shape(self, kernel: str, layout: Layout) -> str:
        """What of the layout a kernel's verdict depends on (part of its cache key)."""
        return f"{layout.key}" if kernel == CHUNK else f"D={layout.conv_dim} W={layout.conv_kernel}"

    def variants(self, kernel: str, layout: Layout, device) -> list[tuple[str | None, str]]:
        """[(backend, label)] to test for a kernel, preferred first: the delta rule on the backend FLA would use
        (`backend.decide_cached`) and, when that is FlashQLA, FLA's Triton kernels too (the loud fallback's
        kernels must be verified as well); the conv has one (None)."""
        if kernel != CHUNK:
            return [(None, "fla-triton")]
        choice = chunk_backend.decide_cached(layout.key)
        triton = (chunk_backend.TRITON, chunk_backend.TRITON)
        return [(chunk_backend.FLASH_QLA, choice.label), triton] if choice.name == chunk_backend.FLASH_QLA else [triton]

    def variant_versions(self, variant: str | None) -> str | None:
        """What a verdict of `variant` holds for instead of the Triton autotuning table (None: the table)."""
        if variant == chunk_backend.FLASH_QLA:
            return f"flash-qla {chunk_backend.version() or 'none'}"
        return None

    def variant_fix(self, variant: str | None) -> str:
        """What runs when `variant` fails ("" for FLA's Triton kernels: the guard's fix applies)."""
        if variant != chunk_backend.FLASH_QLA:
            return ""
        return (
            "FLA's Triton kernels run this head layout instead (gdn_backend: fla-triton pins them and silences this); "
            "report the layout and errors to FlashQLA (github.com/QwenLM/FlashQLA)"
        )

    def check(self, kernel: str, layout: Layout, device, variant: str | None = None) -> dict[str, float]:
        with chunk_backend.forced(variant):
            return (_check_gdn if kernel == CHUNK else _check_conv)(layout, device)

    def guarded(self, kernel: str) -> bool:
        """Whether the kernel runs behind FLA's Hopper guard (a trial needs a grant; a verdict grants or revokes)."""
        return kernel == CHUNK

    def guard_active(self) -> bool:
        return fla_guard.guard_active()

    def grant(self, layout: Layout, source: str, variant: str | None = None) -> None:
        fla_guard.grant(layout.key, source, variant or fla_guard.TRITON)

    def revoke(self, layout: Layout, variant: str | None = None) -> None:
        fla_guard.revoke(layout.key, variant or fla_guard.TRITON)

    def granted(self) -> dict[str, str]:
        out = {str(k): v for k, v in fla_guard.granted().items()}
        out.update({f"{k} {chunk_backend.FLASH_QLA}": v for k, v in fla_guard.granted(chunk_backend.FLASH_QLA).items()})
        return out

    def bypass(self) -> str | None:
        """For plain transformers (no per-shape hook): switch the guard off for the whole process; the note, or
        None when no guard is active."""
        if not fla_guard.guard_active():
            return None
        setattr(importlib.import_module(fla_guard.GUARD_MODULE), fla_guard.GUARD_FLAG, False)
        return HF_GUARD_NOTE

    def pin(self, choice: str | None, where: str = chunk_backend.OPTION.key) -> str:
        """Pin the delta rule's backend (`backend.pin`: FLA's switch set before FLA's import; ConfigError if bad)."""
        return chunk_backend.pin(choice, where)

    def configs_key(self, variant: str | None, device: str) -> str:
        """What a verdict holds for besides the versions: the shipped autotuning table of `device`'s kind (it picks
        FLA's Triton kernels' configs), or FlashQLA's own version for a verdict on FlashQLA."""
        own = self.variant_versions(variant)
        return f"configs {tuned.digest(device)}" if own is None else f"{variant}|{own}"

    def backend_lines(self, layouts: list[Layout]) -> list[str]:
        """The report's lines: the pin and flash-qla's presence, then per layout what FLA dispatches to and what
        the ops run (FlashQLA only once the self-test granted it)."""
        ver = chunk_backend.version()
        lines = [
            f"GDN chunk backend: gdn_backend {chunk_backend.pinned()}, flash-qla "
            f"{ver + ' installed' if ver else 'not installed'}, {chunk_backend.ENV}="
            f"{os.environ.get(chunk_backend.ENV, 'unset')}"
        ]
        fla_ok, fla_why = fla_adapter.available()
        for lay in layouts:
            fla_choice, ops = chunk_backend.decide_cached(lay.key), chunk_backend.for_op(lay.key)
            if not fla_ok:
                lines.append(f"  {lay}: FLA dispatches to {fla_choice.label}; hybridtune's ops run the torch reference")
                lines[-1] += f" ({fla_why})"
                continue
            lines.append(
                f"  {lay}: FLA dispatches to {fla_choice.label} ({fla_choice.why}); hybridtune's ops run "
                f"{ops.label}" + ("" if ops.name == fla_choice.name else f" ({ops.why})")
            )
        return lines

    def prepare(self) -> None:
        """Import FLA's kernel modules (their autotuners exist then, for `seed_tuning` to seed)."""
        fla_adapter.load()

    def seed_tuning(self, device: str) -> str:
        """FLA's autotuning choices for GPU kind `device` from the shipped table (tuned.py), before the self-test's
        first kernel call; the line says what was taken. A failure here only leaves FLA to autotune as usual."""
        try:
            self.prepare()  # the kernel modules, so that their autotuners exist
            return tuned.seed(device)
        except Exception as e:
            log.info("kernel configs not seeded (%s: %s): FLA autotunes its kernels", type(e).__name__, e)
            return f"kernel configs: not seeded ({type(e).__name__}); FLA autotunes its kernels"

    def save_tuning(self, path, device: str) -> int:
        """What FLA's autotuners of this process chose, added to the table at `path` (tuned.save): its entries."""
        return tuned.save(path, device)


SUITE = Suite()
