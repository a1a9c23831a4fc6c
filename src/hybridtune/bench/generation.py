"""Rollout generation speed: the in-process decoder of on-policy training (runtime/rollout.py) beside transformers'
`generate` on the same model and prompts (issue 38's question), one process.

    python -m hybridtune.bench.generation [--base_model qwen3_5-2b] [--adapter lora] [--rows N] [--new_tokens N]
        [--prompt_tokens 64-512] [--output_dir DIR] [--results benchmarks/results.jsonl]

Both sample (temperature 1, no top-p) exactly `new_tokens` tokens per row (no end-of-turn stops: random weights end
turns at random, and both must do the same work), under bf16 autocast as the trainer's rollouts run. Each is run
once to warm up (the decoder's first call compiles its step for this size, so it runs the whole length; generate's
warm-up is 16 tokens: it compiles nothing) and then timed (CUDA synchronised); tokens/s counts the new tokens. The model is the preset's shape with random weights (or a checkpoint), LoRA r=16 as train builds it.
Writes DIR/generation.json and, with --results, one row per decoder to the results table.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import torch

from hybridtune.bench.flags import OneLineParser, file_path, folder, run_script, span, whole
from hybridtune.files import atomic_write_text

logger = logging.getLogger(__name__)
MAX_ROWS, MAX_TOKENS = 4096, 65_536  # the flags' ranges: past them a typo, not a bench


def _prompts(rows: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (rows,), generator=g)
    return [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in lengths]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def left_padded(prompts: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as generate takes a batch: ids [rows, longest] left-padded with `pad`, and their attention mask."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad: int, device: torch.device) -> float:
    """transformers' generate on the left-padded batch, sampling exactly `new_tokens` per row; its seconds."""
    ids, mask = left_padded(prompts, pad, device)
    width = ids.shape[1]
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=True, temperature=1.0, top_p=1.0, top_k=None, pad_token_id=pad)  # fmt: skip
    _sync(device)
    seconds = time.perf_counter() - t0
    assert out.shape[1] == width + new_tokens, out.shape
    return seconds


def ours(model, prompts: list[list[int]], new_tokens: int, pad: int, device: torch.device) -> float:
    from hybridtune.runtime.rollout import sample_groups

    _sync(device)
    t0 = time.perf_counter()
    groups = sample_groups(model, prompts, 1, new_tokens, [], temperature=1.0, seed=3, pad_token_id=pad)
    _sync(device)
    seconds = time.perf_counter() - t0
    assert all(len(g[0].ids) == new_tokens for g in groups)
    return seconds


def greedy_agreement(model, prompts: list[list[int]], new_tokens: int, pad: int, device: torch.device) -> dict:
    """Both decoders greedy on the same prompts: how many rows give the same tokens, and where each other row first
    differs (with random weights a near-tie can flip under another kernel order; the row says where)."""
    from hybridtune.runtime.rollout import sample_rows

    ids, mask = left_padded(prompts, pad, device)
    width = ids.shape[1]
    with torch.no_grad():
        hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)[:, width:].tolist()  # fmt: skip
    got = [r.ids for r in sample_rows(model, prompts, [None] * len(prompts), new_tokens, [], 0.0, 1.0, pad)]
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(hf, got)]
    return {
        "rows": len(prompts),
        "tokens": new_tokens,
        "equal": sum(f is None for f in first),
        "first_difference": first,
    }


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m hybridtune.bench.generation", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base_model", default="qwen3_5-2b")
    ap.add_argument("--adapter", default="lora", choices=["lora", "full"])
    ap.add_argument("--rows", type=whole(1, MAX_ROWS), default=64)
    ap.add_argument("--new_tokens", type=whole(1, MAX_TOKENS), default=512)
    ap.add_argument(
        "--prompt_tokens", type=span(1, MAX_TOKENS), default="64-512", help="LOW-HIGH: each prompt's length, uniform"
    )
    ap.add_argument("--output_dir", type=folder, default="outputs/bench-generation")
    ap.add_argument("--results", type=file_path, default=None, help="append one row per decoder to this results table")
    ap.add_argument("--only", choices=["hf", "ours"], default=None, help="run one decoder")
    ap.add_argument("--greedy_rows", type=whole(0, MAX_ROWS), default=8, help="rows of the greedy check (0: none)")
    ap.add_argument("--greedy_tokens", type=whole(1, MAX_TOKENS), default=128, help="new tokens of the greedy check")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from hybridtune.bench import results
    from hybridtune.config import load_config
    from hybridtune.models.hub import resolve_source
    from hybridtune.models.loading import tokenizer_for
    from hybridtune.runtime.model import build_model

    if a.results:
        results.read(a.results)  # a damaged table is said now, not after the run
    low, high = a.prompt_tokens
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = device.type == "cuda"
    cfg = load_config(None, {"base_model": a.base_model, "adapter": a.adapter, "lora_r": 16, "seed": 0})
    source = resolve_source(a.base_model)  # (a name that is no model: one line, before the tokenizer)
    tok = tokenizer_for(a.base_model)
    model = build_model(cfg, source, tok, device, bf16=bf16).model
    model.eval()
    vocab = min(len(tok), model.get_input_embeddings().weight.shape[0])
    prompts = _prompts(a.rows, low, high, vocab, seed=1)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    doc = {"base_model": a.base_model, "adapter": a.adapter, "rows": a.rows, "new_tokens": a.new_tokens,
           "prompt_tokens": [low, high], "device": torch.cuda.get_device_name(0) if bf16 else "cpu", "decoders": {}}  # fmt: skip
    for name, fn in (("hf-generate", hf_generate), ("ht-rollout", ours)):
        if a.only and name != {"hf": "hf-generate", "ours": "ht-rollout"}[a.only]:
            continue
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with amp:
            # warm: ours compiles its step for this size (so the whole length); generate only autotunes (16 tokens)
            first = fn(model, prompts, a.new_tokens if name == "ht-rollout" else 16, pad, device)
            timed = fn(model, prompts, a.new_tokens, pad, device)
        tps = a.rows * a.new_tokens / timed
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        how = getattr(getattr(model, "_hybridtune_decoder", None), "how", None) if name == "ht-rollout" else "generate"
        doc["decoders"][name] = {"first_s": first, "seconds": timed, "tokens_per_s": tps, "peak_gib": peak, "how": how}
        print(f"{name}: {tps:,.0f} new tokens/s ({timed:.2f} s timed, first call {first:.2f} s, {how})", flush=True)
    d = doc["decoders"]
    if a.greedy_rows and not a.only:  # after the timed runs: its decoder is of another size
        with amp:
            g = greedy_agreement(model, prompts[: a.greedy_rows], a.greedy_tokens, pad, device)
        doc["greedy"] = g
        print(f"greedy: {g['equal']} of {g['rows']} rows equal to generate's over {g['tokens']} new tokens "
              f"(first difference per row: {g['first_difference']})", flush=True)  # fmt: skip
    if len(d) == 2:
        doc["speedup"] = d["ht-rollout"]["tokens_per_s"] / d["hf-generate"]["tokens_per_s"]
        print(f"speedup: {doc['speedup']:.2f}x", flush=True)
    out = Path(a.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "generation.json", json.dumps(doc, indent=1) + "\n")
    if a.results:
        prov = results.provenance_here(doc["device"])
        command = "python -m hybridtune.bench.generation " + " ".join(argv if argv is not None else sys.argv[1:])
        rows = []
        for name, r in d.items():
            rows.append(prov | {
                "command": command, "tool": "bench-generation", "shape": a.base_model, "seq_len": high + a.new_tokens,
                "mode": name, "adapter": "lora r=16" if a.adapter == "lora" else "full", "gpus": 1,
                "tokens_per_s": r["tokens_per_s"], "step_ms": None, "peak_gib": r["peak_gib"], "mfu": None,
                "hfu": None, "loss_step1": None, "loss_last10": None, "first_step_s": r["first_s"], "status": "ok",
                "source": str(out / "generation.json"),
                "note": f"{a.rows} rows x {a.new_tokens} new tokens sampled, prompts {low}-{high} tokens; {r['how']}"
                + (f"; greedy: {doc['greedy']['equal']} of {doc['greedy']['rows']} rows equal to generate's over "
                   f"{doc['greedy']['tokens']} tokens" if "greedy" in doc else ""),
            })  # fmt: skip
        results.append(rows, a.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
