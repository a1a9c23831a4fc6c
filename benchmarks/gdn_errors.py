"""Relative errors of the hybridtune GDN ops on CUDA (FLA, bf16 inputs) against the fp32 pure-torch
reference, for the Qwen3.5 0.8B/2B/9B head layouts, on a 4096-token pack of uneven documents.

Metric: ||x - x_ref|| / ||x_ref|| over the whole tensor (fp64 accumulation). Grants the FLA backward for
the measured layouts explicitly (this script is the numeric check) and says so in the JSON.
Usage: python benchmarks/gdn_errors.py --out RESULT.json (benchmarks/kernels.sh errors runs it)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch
import torch.nn.functional as F

# 0.8B and 2B share one head layout, so it is measured once and reported for both.
LAYOUTS = {"qwen3_5-0.8b/2b": (16, 16, 128, 128), "qwen3_5-9b": (16, 32, 128, 128)}
LENS = [700, 13, 1, 1500, 64, 1818]  # 4096 tokens


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import fla
    import triton

    from hybridtune.data.collator import varlen_metadata
    from hybridtune.mixers.gdn import fla_guard
    from hybridtune.mixers.gdn import ops as gdn
    from hybridtune.mixers.gdn.reference import causal_conv1d_ref, chunk_gated_delta_rule_ref

    meta = varlen_metadata(LENS)
    cu, ci = meta["cu_seq_lens_q"].cuda(), meta["gdn_chunk_indices"].cuda()
    T = sum(LENS)
    rows = {}
    for name, (H, HV, K, V) in LAYOUTS.items():
        fla_guard.grant((H, HV, K, V), "benchmarks/gdn_errors.py: explicit grant to measure this layout")
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, T, H, K, device="cuda", generator=gen).bfloat16().requires_grad_()
        k = torch.randn(1, T, H, K, device="cuda", generator=gen).bfloat16().requires_grad_()
        v = torch.randn(1, T, HV, V, device="cuda", generator=gen).bfloat16().requires_grad_()
        a = torch.randn(1, T, HV, device="cuda", generator=gen)
        g = (-torch.rand(HV, device="cuda", generator=gen).mul(8).exp() * F.softplus(a)).requires_grad_()
        beta = torch.rand(1, T, HV, device="cuda", generator=gen).bfloat16().requires_grad_()
        o = gdn.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, chunk_indices=ci)
        do = torch.randn_like(o)
        grads = torch.autograd.grad(o, (q, k, v, g, beta), do)
        ref_in = [t.detach().float().requires_grad_() for t in (q, k, v, g, beta)]
        o_ref = chunk_gated_delta_rule_ref(*ref_in, cu_seqlens=cu)
        grads_ref = torch.autograd.grad(o_ref, ref_in, do.float())
        row = {"o": rel(o, o_ref)}
        row.update({f"d{n}": rel(x, y) for n, x, y in zip(["q", "k", "v", "g", "beta"], grads, grads_ref)})
        D = 2 * H * K + HV * V
        x = torch.randn(1, T, D, device="cuda", generator=gen).bfloat16().requires_grad_()
        w = (torch.randn(D, 4, device="cuda", generator=gen) * 0.5).bfloat16().requires_grad_()
        y = gdn.causal_conv1d(x, w, None, cu_seqlens=cu, chunk_indices=ci)
        dy = torch.randn_like(y)
        gx, gw = torch.autograd.grad(y, (x, w), dy)
        xr, wr = (t.detach().float().requires_grad_() for t in (x, w))
        yr = causal_conv1d_ref(xr, wr, None, cu_seqlens=cu)
        gxr, gwr = torch.autograd.grad(yr, (xr, wr), dy.float())
        row.update(conv_y=rel(y, yr), conv_dx=rel(gx, gxr), conv_dw=rel(gw, gwr))
        rows[name] = {"layout_H_HV_K_V": [H, HV, K, V], **row}
        print(name, " ".join(f"{k}={v:.4f}" for k, v in row.items()), flush=True)
        write(args.out, rows, fla, triton, fla_guard)


def write(path, rows, fla, triton, fla_guard):
    out = {
        "what": "relative error (||x - ref|| / ||ref||) of hybridtune ops on CUDA (FLA, bf16 in) vs fp32 reference",
        "command": " ".join([sys.executable, *sys.argv]),
        "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "device": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "fla": getattr(fla, "__version__", "?")},
        "doc_lengths": LENS,
        "fla_guard_grants": {str(k): v for k, v in fla_guard.granted().items()},
        "rows": rows,
    }
    with open(path, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
