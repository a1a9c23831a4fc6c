"""How long the fused loss's per-chunk softmax work takes (ops/loss.py `_chunk_loss_and_grad`, compiled) against a
form written as log_softmax, on one [chunk, vocab] bf16 logits chunk of the 2B shape's vocabulary, CUDA events,
median of 50 after 5 warm-up calls; both checked against an fp64 reference of the same chunk.

    python benchmarks/loss_chunk.py [CHUNK] [VOCAB]
"""

import statistics
import sys

import torch

from hybridtune.ops import loss as L


def log_softmax_form(logits, tgt, valid, acc):
    lsm = torch.log_softmax(logits.to(acc), dim=-1)
    loss = torch.where(valid, -lsm.gather(1, tgt).squeeze(1), 0.0).sum()
    cols = torch.arange(logits.shape[1], device=logits.device)
    g = torch.exp(lsm) - (cols == tgt).to(acc)
    return loss, (g * valid.unsqueeze(1)).to(logits.dtype)


def timed(fn, *args):
    for _ in range(5):
        fn(*args)
    times = []
    for _ in range(50):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    chunk = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    vocab = int(sys.argv[2]) if len(sys.argv) > 2 else 248320
    torch.manual_seed(0)
    logits = (torch.randn(chunk, vocab, device="cuda") * 3).to(torch.bfloat16)
    tc = torch.randint(0, vocab, (chunk,), device="cuda")
    tc[::7] = -100
    valid = tc != -100
    tgt = torch.where(valid, tc, 0).unsqueeze(1)
    ref_loss, ref_g = L._chunk_loss_and_grad(logits.double(), tgt, valid, torch.float64)
    gib = logits.numel() * logits.element_size() / 2**30
    print(f"chunk {chunk} x vocab {vocab}: {gib:.2f} GiB of bf16 logits")
    for name, fn in (
        ("ops.loss (compiled)", L._chunk_loss_and_grad_compiled()),
        ("log_softmax form (compiled)", torch.compile(log_softmax_form)),
    ):
        loss, g = fn(logits, tgt, valid, torch.float32)
        lerr = abs(loss.double() - ref_loss).item() / abs(ref_loss).item()
        gerr = (g.double() - ref_g).abs().max().item()
        ms = timed(fn, logits, tgt, valid, torch.float32)
        print(
            f"{name:30s} {ms:7.3f} ms  {3 * gib / (ms / 1e3):6.0f} GiB/s at 3 passes  "
            f"loss rel err {lerr:.2e}  grad max abs err {gerr:.2e}"
        )


if __name__ == "__main__":
    main()
