"""Device self-test: run the selected fast kernels forward and backward against the fp32 reference.

Before the first training step on a GPU, each kernel the run will use runs on a small packed input with the model's
own head layout (three documents, 63, 75 and 130 tokens; q, k [1, T, H, K], v [1, T, HV, V], g [1, T, HV]; the conv
x [1, T, D]): hybridtune's custom ops (`mixers.gdn.ops`) against `mixers.gdn.reference` in fp32, by FLA's relative
RMS ||ref - out|| / ||ref|| of the output and every gradient. The trial grants its layout to `mixers.gdn.fla_guard`
for its duration; a pass keeps the grant, a failure revokes it and names the fix. Verdicts are cached per device,
capability, torch/triton/FLA/tilelang versions, kernel and head layout in `$HYBRIDTUNE_CACHE_DIR` (default
`$XDG_CACHE_HOME/hybridtune`, else `~/.cache/hybridtune`).

`python -m hybridtune.kernels.selftest --preset qwen3_5-9b [--layout H,HV,K,V] [--no-cache] [--json FILE]`
prints the verdict table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridtune.files import atomic_write_text
from hybridtune.kernels import tuned
from hybridtune.kernels.environment import cache_dir, dist_version, environment
from hybridtune.kernels.needs import read_config
from hybridtune.mixers.gdn import fla_guard
from hybridtune.models.anatomy import text_config
from hybridtune.models.presets import preset_config

logger = logging.getLogger(__name__)

SELFTEST_VERSION = 1
TOLERANCE = 0.02  # relative RMS vs fp32; what the bf16 kernels reach is recorded in docs/FINDINGS.md
DOC_LENGTHS = (63, 75, 130)
FIX_HOPPER = (
    "upgrade Triton to >= 3.7.1 (pip install 'triton>=3.7.1') or install tilelang (pip install tilelang); "
    "until then this head layout runs the slow torch reference backward"
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


@dataclass
class Verdict:
    kernel: str  # "gdn_chunk" (forward + backward) or "causal_conv1d"
    layout: Layout
    passed: bool | None  # None: not run (reason says why)
    errors: dict[str, float] = field(default_factory=dict)
    tolerance: float = TOLERANCE
    backend: str = ""
    device: str = ""
    fingerprint: str = ""
    cached: bool = False
    granted: bool = False
    guard_active: bool = False
    seconds: float = 0.0
    reason: str = ""

    @property
    def verdict(self) -> str:
        if self.passed is None:
            return f"not run: {self.reason}"
        worst = max(self.errors.values(), default=0.0)
        word = "pass" if self.passed else "FAIL"
        return f"{word} (max rel err {worst:.4f} <= {self.tolerance})" if self.passed else f"{word}: {self.reason}"

    @property
    def fix(self) -> str | None:
        if self.passed is not False:
            return None
        return FIX_HOPPER if self.guard_active else "report the failing layout; the torch reference path stays in use"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kernel": self.kernel,
            "layout": str(self.layout),
            "key": list(self.layout.key),
            "passed": self.passed,
            "verdict": self.verdict,
            "errors": {k: round(v, 6) for k, v in self.errors.items()},
            "tolerance": self.tolerance,
            "backend": self.backend,
            "device": self.device,
            "cached": self.cached,
            "granted": self.granted,
            "guard_active": self.guard_active,
            "seconds": round(self.seconds, 3),
            "reason": self.reason,
            "fix": self.fix,
        }


# ----------------------------------------------------------------------------------------------------------
# Layouts from a config


def layouts_from_config(obj: Any) -> list[Layout]:
    """The GDN head layouts of a config (or a checkpoint directory); empty when it has no GDN mixer."""
    if isinstance(obj, (str, os.PathLike)):
        if not os.path.exists(obj):
            return []  # a bare model_type has no head dims
        obj = read_config(Path(obj))
    if hasattr(obj, "config") and not hasattr(obj, "model_type"):
        obj = obj.config
    text = text_config(obj)
    dims = [getattr(text, a, None) for a in ("linear_num_key_heads", "linear_num_value_heads")]
    dims += [getattr(text, a, None) for a in ("linear_key_head_dim", "linear_value_head_dim")]
    if any(not isinstance(d, int) or d <= 0 for d in dims):
        return []
    conv = getattr(text, "linear_conv_kernel_dim", 4) or 4
    return [Layout(*dims, conv_kernel=int(conv))]


# ----------------------------------------------------------------------------------------------------------
# Cache


def _cache_path() -> Path:
    return cache_dir() / f"selftest-v{SELFTEST_VERSION}.json"


def _load_cache() -> dict[str, Any]:
    try:
        data = json.loads(_cache_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _store(fingerprint: str, verdict: Verdict) -> None:
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load_cache()
        data[fingerprint] = {"passed": verdict.passed, "errors": verdict.errors, "reason": verdict.reason}
        atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True))
    except OSError as e:
        logger.warning("could not write the self-test cache %s: %s", path, e)


def fingerprint(kernel: str, layout: Layout, device_index: int = 0) -> str:
    import torch

    name = torch.cuda.get_device_name(device_index)
    cap = ".".join(map(str, torch.cuda.get_device_capability(device_index)))
    # tilelang is in the key because FLA dispatches the guarded backward to it when installed.
    triton, fla, tilelang = (dist_version(d) or "none" for d in ("triton", "fla-core", "tilelang"))
    versions = f"torch {torch.__version__}|triton {triton}|fla {fla}|tilelang {tilelang}"
    shape = f"{layout.key}" if kernel == "gdn_chunk" else f"D={layout.conv_dim} W={layout.conv_kernel}"
    # The shipped autotuning table picks the kernels' configs: a verdict holds for the table it ran under.
    return f"v{SELFTEST_VERSION}|{name}|sm{cap}|{versions}|{kernel}|{shape}|bf16|configs {tuned.digest(name)}"


# ----------------------------------------------------------------------------------------------------------
# The checks


def rel_rms(ref, out) -> float:
    """FLA's error ratio: RMS of the difference over RMS of the reference (inf when `out` is not finite)."""
    import torch

    ref, out = ref.detach().double(), out.detach().double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((ref - out).square().mean().sqrt() / (ref.square().mean().sqrt() + 1e-12)).item()


def _packed_lengths(device, lengths=DOC_LENGTHS):
    import torch

    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return bounds[-1], torch.tensor(bounds, dtype=torch.int32, device=device)


def _check_gdn(layout: Layout, device, lengths: tuple[int, ...] = DOC_LENGTHS) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    from hybridtune.mixers.gdn import ops as gdn  # why here: ops import torch; this module must not
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
    import torch

    from hybridtune.mixers.gdn import ops as gdn  # why here: ops import torch; this module must not
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


def _guard_active() -> bool:
    return fla_guard.guard_active()


def verify(layouts: Iterable[Layout], *, use_cache: bool = True, device_index: int | None = None) -> list[Verdict]:
    """Self-test the GDN op and the conv op for each layout on CUDA device `device_index` (default: the current
    device, so each rank of a multi-GPU run tests its own GPU).

    A GDN layout that passes is granted to `hybridtune.mixers.gdn.fla_guard` (its backward may then bypass FLA's Hopper
    guard); one that fails is revoked. Never raises for a kernel failure: the verdict carries it.
    """
    layouts = sorted(set(layouts))
    try:
        import torch
    except ImportError:
        return [Verdict("gdn_chunk", lay, None, reason="torch is not importable") for lay in layouts]
    if not torch.cuda.is_available():
        return [Verdict("gdn_chunk", lay, None, reason="no CUDA device") for lay in layouts]
    try:
        from hybridtune.mixers.gdn import ops as gdn  # why here: imports torch (checked above) and registers the ops
    except ImportError as e:
        return [Verdict("gdn_chunk", lay, None, reason=f"hybridtune.ops unavailable ({e})") for lay in layouts]
    if device_index is None:
        device_index = torch.cuda.current_device()
    device = torch.device("cuda", device_index)
    backend, why = gdn.backend(device)
    dev_name = torch.cuda.get_device_name(device_index)
    guard = _guard_active()
    cache = _load_cache() if use_cache else {}
    out: list[Verdict] = []
    for kernel, check in (("gdn_chunk", _check_gdn), ("causal_conv1d", _check_conv)):
        for lay in layouts:
            v = Verdict(
                kernel, lay, None, backend=backend, device=dev_name, guard_active=guard and kernel == "gdn_chunk"
            )
            if backend != "fla":
                v.reason = f"the ops run the torch reference here ({why}); nothing fast to verify"
                out.append(v)
                continue
            v.fingerprint = fingerprint(kernel, lay, device_index)
            hit = cache.get(v.fingerprint)
            if hit is not None:
                v.passed, v.errors, v.reason, v.cached = (
                    hit.get("passed"),
                    hit.get("errors", {}),
                    hit.get("reason", ""),
                    True,
                )
            else:
                if kernel == "gdn_chunk":  # the trial itself needs the guard lifted for this layout
                    fla_guard.grant(lay.key, f"kernels.selftest: trial on {dev_name}")
                t0 = time.perf_counter()
                try:
                    v.errors = check(lay, device)
                    bad = {n: e for n, e in v.errors.items() if not e <= TOLERANCE}
                    v.passed = not bad
                    v.reason = (
                        ""
                        if v.passed
                        else "rel err over tolerance: " + ", ".join(f"{n} {e:.4g}" for n, e in bad.items())
                    )
                except Exception as e:  # a kernel that raises is a failed kernel, not a crashed run
                    v.passed, v.reason = False, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                v.seconds = time.perf_counter() - t0
                if v.errors or v.passed is not None:
                    _store(v.fingerprint, v)
            if kernel == "gdn_chunk":
                if v.passed:
                    worst = max(v.errors.values(), default=0.0)
                    fla_guard.grant(lay.key, f"kernels.selftest: max rel err {worst:.4f} on {dev_name}")
                    v.granted = True
                else:
                    fla_guard.revoke(lay.key)
            if v.passed is False:
                logger.error(
                    "kernel self-test FAILED: %s %s on %s: %s. Fix: %s", kernel, lay, dev_name, v.reason, v.fix
                )
            out.append(v)
    return out


# ----------------------------------------------------------------------------------------------------------
# Command line (used by benchmarks/kernels.sh)


def _parse_layout(text: str) -> Layout:
    parts = [int(p) for p in text.replace("x", ",").split(",")]
    if len(parts) not in (4, 5):
        raise argparse.ArgumentTypeError(f"layout '{text}' must be H,HV,K,V[,W]")
    return Layout(*parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridtune.kernels.selftest", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", action="append", default=[], help="preset name whose head layout to test")
    ap.add_argument("--layout", action="append", default=[], type=_parse_layout, help="H,HV,K,V[,W]")
    ap.add_argument("--no-cache", action="store_true", help="run even when a cached verdict exists")
    ap.add_argument("--json", metavar="FILE", help="write the verdicts (with versions and device) as JSON")
    args = ap.parse_args(argv)
    by_layout: dict[Layout, list[str]] = {}
    for name in args.preset:
        for lay in layouts_from_config(preset_config(name, vocab_size=256)):
            by_layout.setdefault(lay, []).append(name)
    for lay in args.layout:
        by_layout.setdefault(lay, []).append("--layout")
    if not by_layout:
        ap.error("give at least one --preset or --layout")
    verdicts = verify(by_layout, use_cache=not args.no_cache)
    print(f"{'kernel':<14} {'layout':<26} {'presets':<34} {'verdict':<44} {'s':>7}")
    for v in verdicts:
        presets = ",".join(by_layout.get(v.layout, []))
        print(f"{v.kernel:<14} {str(v.layout):<26} {presets:<34} {v.verdict[:44]:<44} {v.seconds:7.2f}")
    if args.json:
        rows = [{**v.to_dict(), "presets": by_layout.get(v.layout, [])} for v in verdicts]
        Path(args.json).write_text(json.dumps({"environment": environment(), "verdicts": rows}, indent=1) + "\n")
    return 0 if all(v.passed is not False for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
