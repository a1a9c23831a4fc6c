"""MoE step-1 loss parity: plain transformers vs hybridtune's patched model, each in fp32 and in bf16.

What it measures. `hybridtune bench` compares the loss of the first step (the forward only: LoRA's B is zero, so
the adapters add exactly nothing) between modes. This script builds the bench's model (the worker's own
`build_model`, same seed, same LoRA) and takes the bench's first pack (`pack_layouts` / `make_batches`, same
seed), and computes that loss four ways:

  hf-fp32   plain transformers, fp32 weights, no autocast: the reference
  hf-bf16   plain transformers, bf16 weights + bf16 autocast, as mode hf-eager runs
  ht-bf16   hybridtune's patched model as mode ht-eager builds it (patched GDN ops, grouped experts, fused
            loss via `sft_loss`; no torch.compile), bf16 weights + bf16 autocast
  ht-fp32   the same patched model in fp32: must equal hf-fp32 to ~1e-5 or better
  ht-bf16-static (with --static) ht-bf16 on the static layout of ht-loop (filler documents appended)
  hf-*-packed    (with --hf_packed) hf on the whole pack as hf-eager runs on a GPU: the delta rule per document
            (FLA takes `cu_seqlens`), the causal conv over the whole pack (transformers passes it no boundaries)

All variants use the same weights: the fp32 model's weights are rounded to bf16 once, so the fp32 variants
compute exactly on the weights the bf16 variants hold (as the bench's bf16 model does). For each variant it
records every router's top-k expert set and every decoder layer's output, and prints, per layer, the share of
tokens whose top-k set differs from hf-fp32's and the relative L2 error of the layer output.

CPU caveat, and why plain transformers runs document by document. On the CPU transformers' Qwen3.5 GDN falls
back to its pure-torch conv and chunked delta rule, which ignore `cu_seq_lens_q`: on a packed batch the
recurrent state (and the conv) would leak from one document into the next, which is not what hf-eager computes
on a GPU (FLA's kernels take the document boundaries). So the hf variants run each document of the pack as its own
sequence (positions from 0) and add up the per-token losses; MoE routing is per token, so this is the same
quantity. Their loss is transformers' (logits in the compute dtype, upcast to fp32, summed cross-entropy over
the trained tokens / num_loss_tokens), computed over row chunks of `lm_head` to bound memory.

Run (CPU; peak RSS measured 11.0 GiB for both commands below, about 4 and 3 minutes on 2 cores):
    . .venv/bin/activate
    python benchmarks/moe_parity.py                                   # qwen3_5-35b-a3b@layers=1, 4096 tokens
    python benchmarks/moe_parity.py --preset 'qwen3_5-35b-a3b@layers=2' --vocab_size 32768 --static
`--vocab_size` shrinks only the embedding and head (the MoE widths stay real) so that 2 layers fit in fp32.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time

import torch
import torch.nn.functional as F

from hybridtune.batch import INPUT_IDS, LABELS, NUM_LOSS_TOKENS, NUM_TOKENS
from hybridtune.bench import worker
from hybridtune.bench.data import make_batches, pack_layouts
from hybridtune.bench.modes import parse_mode
from hybridtune.config import DEFAULT_LORA_TARGETS
from hybridtune.data import IGNORE_INDEX
from hybridtune.models.anatomy import decoder_layers, output_head, text_model, unwrap
from hybridtune.models.presets import preset_config
from hybridtune.runtime.step import model_inputs, shifted_targets
from hybridtune.train.objectives.sft import sft_loss

CPU = torch.device("cpu")


def build(args, mode_name: str):
    """The bench worker's model for `mode_name` (fp32 on the CPU), weights rounded to bf16-representable values."""
    spec = {
        "preset": args.preset,
        "seed": args.seed,
        "adapter": "lora",
        "lora_r": 16,
        "lora_targets": list(DEFAULT_LORA_TARGETS),
        "lora_parameters": ["gate_up_proj", "down_proj"] if args.expert_lora else [],
    }
    if args.vocab_size:  # the worker reads the preset's config through this name
        worker.preset_config = functools.partial(preset_config, vocab_size=args.vocab_size)
    result: dict = {}
    cfg, model = worker.build_model(spec, parse_mode(mode_name), CPU, result)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    print(
        f"  built {mode_name}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params; "
        f"{result.get('experts', '')}",
        flush=True,
    )
    return cfg, model


class Recorder:
    """Every router's top-k expert ids (sorted) and every decoder layer's output, concatenated over calls."""

    def __init__(self, model):
        self.topk: dict[int, list] = {}
        self.out: dict[int, list] = {}
        self.handles = []
        for i, layer in enumerate(decoder_layers(model)):
            router = getattr(getattr(layer, "mlp", None), "gate", None)
            if router is not None and type(router).__name__.endswith("TopKRouter"):
                self.handles.append(router.register_forward_hook(self._router_hook(i)))
            self.handles.append(layer.register_forward_hook(self._layer_hook(i)))

    def _router_hook(self, i):
        def hook(_m, _inp, out):
            self.topk.setdefault(i, []).append(out[2].sort(dim=-1).values.to(torch.int16))

        return hook

    def _layer_hook(self, i):
        def hook(_m, _inp, out):
            h = out[0] if isinstance(out, tuple) else out
            self.out.setdefault(i, []).append(h.detach().reshape(-1, h.shape[-1]).float())

        return hook

    def result(self, n_tokens: int) -> dict:
        for h in self.handles:
            h.remove()
        return {
            "topk": {i: torch.cat(v)[:n_tokens] for i, v in self.topk.items()},
            "out": {i: torch.cat(v)[:n_tokens] for i, v in self.out.items()},
        }


@contextlib.contextmanager
def delta_rule_per_document(model):
    """transformers' torch delta rule run per document (`cu_seqlens`), as FLA's kernel runs it on a GPU; its conv
    still runs over the whole pack, as transformers' conv does on a GPU too (it is given no document boundaries)."""
    mod = sys.modules[type(unwrap(model)).__module__]
    orig = mod.torch_chunk_gated_delta_rule

    def per_doc(query, key, value, g, beta, cu_seqlens=None, **kw):
        if cu_seqlens is None:
            return orig(query, key, value, g=g, beta=beta, **kw)
        cu = cu_seqlens.tolist()
        outs = [
            orig(query[:, s:e], key[:, s:e], value[:, s:e], g=g[:, s:e], beta=beta[:, s:e], **kw)[0]
            for s, e in zip(cu[:-1], cu[1:])
        ]
        return torch.cat(outs, dim=1), None

    mod.torch_chunk_gated_delta_rule = per_doc
    try:
        yield
    finally:
        mod.torch_chunk_gated_delta_rule = orig


def hf_loss(model, batch: dict, packed: bool, chunk: int = 512) -> torch.Tensor:
    """Transformers' causal-LM loss of the pack: each document run as its own sequence (see the docstring), or
    (`packed`) the whole pack at once as hf-eager runs it on a GPU (`delta_rule_per_document`)."""
    base = unwrap(model)
    stack, head = text_model(base), output_head(base)
    ids, labels = batch[INPUT_IDS], batch[LABELS]
    if packed:
        with delta_rule_per_document(model):
            hidden = stack(**model_inputs(batch, labels=False), use_cache=False).last_hidden_state[0]
        pieces = [(hidden, shifted_targets(labels))]
    else:
        pieces, start = [], 0
        for n in batch["doc_lens"]:
            pos = torch.arange(n)[None]
            h = stack(input_ids=ids[:, start : start + n], position_ids=pos, use_cache=False).last_hidden_state[0]
            pieces.append((h, shifted_targets(labels[:, start : start + n])))
            start += n
    total = torch.zeros((), dtype=torch.float64)
    for hidden, tgt in pieces:
        for s in range(0, hidden.shape[0], chunk):
            logits = head(hidden[s : s + chunk]).float()  # transformers upcasts the logits before the loss
            total += F.cross_entropy(logits, tgt[s : s + chunk], ignore_index=IGNORE_INDEX, reduction="sum").double()
    return total / max(batch[NUM_LOSS_TOKENS], 1)


def run_variant(name, model, batch, dtype, hf: bool, packed: bool = False) -> dict:
    model.to(dtype)
    rec = Recorder(model)
    t0 = time.perf_counter()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        if hf:
            loss = hf_loss(model, batch, packed)
        else:
            loss = sft_loss(model, batch, batch[NUM_LOSS_TOKENS], fused=True)
    res = rec.result(batch[NUM_TOKENS])
    res.update(name=name, loss=float(loss), seconds=time.perf_counter() - t0)
    print(f"  {name}: loss {res['loss']:.6f} ({res['seconds']:.0f} s)", flush=True)
    return res


def flips(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of tokens whose top-k expert set differs."""
    return (a != b).any(dim=-1).float().mean().item()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3_5-35b-a3b@layers=1")
    ap.add_argument("--seq_len", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab_size", type=int, default=None, help="override the vocabulary (embedding and head only)")
    ap.add_argument("--expert_lora", action="store_true", help="LoRA on the experts' 3-D weights too (more memory)")
    ap.add_argument("--static", action="store_true", help="also run ht-bf16 on ht-loop's static layout (filler)")
    ap.add_argument("--hf_packed", action="store_true", help="also run hf on the whole pack, as on a GPU")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    vocab = args.vocab_size or preset_config(args.preset).vocab_size
    layouts = pack_layouts(args.seq_len, 8, args.seed)  # the bench's default 8 layouts; step 1 takes the first
    batch = make_batches(layouts, vocab, args.seed)[0]
    static = make_batches(layouts, vocab, args.seed, static=True)[0] if args.static else None
    print(
        f"{args.preset}, vocab {vocab}, pack of {batch[NUM_TOKENS]} tokens in {len(layouts[0])} documents, "
        f"{batch[NUM_LOSS_TOKENS]} trained",
        flush=True,
    )

    runs = []
    cfg, model = build(args, "hf-eager")
    runs.append(run_variant("hf-fp32", model, batch, torch.float32, hf=True))
    runs.append(run_variant("hf-bf16", model, batch, torch.bfloat16, hf=True))
    if args.hf_packed:
        runs.append(run_variant("hf-bf16-packed", model, batch, torch.bfloat16, hf=True, packed=True))
        runs.append(run_variant("hf-fp32-packed", model, batch, torch.float32, hf=True, packed=True))
    check = [p.float().sum().item() for p in list(model.parameters())[:4]]
    del model

    cfg, model = build(args, "ht-eager")
    assert [p.float().sum().item() for p in list(model.parameters())[:4]] == check, "weights differ between builds"
    runs.append(run_variant("ht-fp32", model, batch, torch.float32, hf=False))
    runs.append(run_variant("ht-bf16", model, batch, torch.bfloat16, hf=False))
    if static is not None:
        assert static[NUM_LOSS_TOKENS] == batch[NUM_LOSS_TOKENS] and static[NUM_TOKENS] == batch[NUM_TOKENS]
        print(
            f"  static layout: {static[INPUT_IDS].shape[-1]} tokens ({static[INPUT_IDS].shape[-1] - batch[NUM_TOKENS]} filler)"
        )
        runs.append(run_variant("ht-bf16-static", model, static, torch.bfloat16, hf=False))
    del model

    ref = runs[0]
    layers = sorted(ref["out"])
    moe = sorted(ref["topk"])
    print(f"\n{args.preset}, seq_len {args.seq_len}, seed {args.seed}, vocab {vocab}; reference hf-fp32")
    head = f"{'variant':<16}{'loss':>12}{'rel. diff':>12}"
    head += "".join(f"{f'flip L{i}':>9}" for i in moe) + "".join(f"{f'err L{i}':>10}" for i in layers)
    print(head)
    for r in runs:
        row = f"{r['name']:<16}{r['loss']:>12.6f}{(r['loss'] - ref['loss']) / ref['loss']:>12.2e}"
        row += "".join(f"{flips(r['topk'][i], ref['topk'][i]):>9.2%}" for i in moe)
        row += "".join(f"{rel_err(r['out'][i], ref['out'][i]):>10.2e}" for i in layers)
        print(row)
    by = {r["name"]: r for r in runs}
    a, b = by["hf-bf16"], by["ht-bf16"]
    print(
        f"\nhf-bf16 vs ht-bf16: rel. loss diff {(b['loss'] - a['loss']) / a['loss']:.2e}; flips "
        + ", ".join(f"L{i} {flips(a['topk'][i], b['topk'][i]):.2%}" for i in moe)
    )
    print(
        "flip L<i>: share of tokens whose top-k expert set differs from hf-fp32's at layer i's router; "
        "err L<i>: relative L2 error of layer i's output vs hf-fp32"
    )
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
