"""A GRPO step, hybridtune beside TRL's GRPOTrainer (no vLLM), on the same model, prompts and reward.

    python -m hybridtune.bench.grpo_pair [--base_model qwen3_5-2b] [--steps 5] [--prompts 8] [--num_generations 8]
        [--max_completion_length 512] [--prompt_tokens 64-256] [--output_dir DIR] [--results T] [--only ht|trl]

hybridtune runs `hybridtune train --objective grpo` in its own process (metrics.jsonl's `step_s` and
`time/generation_s`); TRL runs in another on the preset's same weights with hybridtune's LoRA (r=16), timed by a
callback with transformers' `generate` timed inside. Both: prompts x num_generations completions per step at
temperature 1, beta 0 and loss_type dapo (TRL's defaults), bf16, gradient checkpointing, one optimizer step per
batch of completions, one reward both import from one file. The figure: the median step after the first two.
Writes DIR/grpo_pair.json and, with --results, one row per tool (docs/CONFIG.md, objective grpo, has the method).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybridtune.bench.flags import OneLineParser, file_path, folder, run_script, span, whole
from hybridtune.files import atomic_write_text

# The flags' ranges: past them a typo, not a bench. The hybridtune side's prompts get 1,024 tokens (a word is one or
# more), and grpo needs a group of two completions or more.
MAX_STEPS, MAX_PROMPTS, MAX_GENERATIONS, MAX_COMPLETION, MAX_PROMPT_WORDS = 10_000, 4096, 1024, 65_536, 1024

REWARD = '''def digits(completions, **kwargs):
    """The share of digits in each completion (text, or chat messages)."""
    out = []
    for c in completions:
        text = c if isinstance(c, str) else "".join(m.get("content") or "" for m in c)
        out.append(sum(ch.isdigit() for ch in text) / max(len(text), 1))
    return out
'''


def write_data(root: Path, n: int, low: int, high: int, seed: int) -> Path:
    """`n` prompts of low..high words (numbers and words, seeded), as `prompt` rows."""
    import random

    rng = random.Random(seed)
    words = ["alpha", "beta", "sum", "of", "the", "numbers", "count", "list", "and", "then", "answer", "is"]
    rows = []
    for _ in range(n):
        k = rng.randint(low, high)
        rows.append({"prompt": " ".join(rng.choice(words) if rng.random() < 0.5 else str(rng.randrange(1000))
                                        for _ in range(k))})  # fmt: skip
    path = root / "prompts.jsonl"
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    atomic_write_text(root / "reward_digits.py", REWARD)
    return path


def last_error(text: str, default: str) -> str:
    """The last line of a log that names an error (a progress bar's line is not one), else its last line."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    named = [x for x in lines if "Error" in x or x.lower().startswith("error")]
    return ((named or lines or [default])[-1])[:300]


def ht_command(a, work: Path, data: Path, out: Path) -> list[str]:
    """The hybridtune side's `hybridtune train --objective grpo`, its run in `out`."""
    return [sys.executable, "-m", "hybridtune", "train", "--base_model", a.base_model, "--adapter", "lora",
           "--lora_r", "16", "--lora_dropout", "0", "--objective", "grpo", "--dataset", str(data),
           "--num_generations", str(a.num_generations), "--max_completion_length", str(a.max_completion_length),
           "--max_prompt_length", "1024", "--micro_batch_size", str(a.prompts), "--gradient_accumulation_steps", "1",
           "--beta", "0", "--loss_type", "dapo", "--temperature", "1.0", "--max_steps", str(a.steps),
           "--logging_steps", "1", "--eval_steps", "0", "--val_set_size", "0", "--warmup_steps", "0",
           "--reward_funcs", f"{work / 'reward_digits.py'}:digits", "--output_dir", str(out), "--seed", "0",
           "--sequence_len", str(1024 + a.max_completion_length)]  # fmt: skip


def trl_command(a, work: Path) -> list[str]:
    """The TRL side: this module again, `--only trl` in `work` (run_trl in a fresh process)."""
    return [sys.executable, "-m", "hybridtune.bench.grpo_pair", "--only", "trl", "--work", str(work),
            "--base_model", a.base_model, "--steps", str(a.steps), "--prompts", str(a.prompts),
            "--num_generations", str(a.num_generations), "--max_completion_length", str(a.max_completion_length)]  # fmt: skip


def run_ht(a, root: Path, work: Path, data: Path) -> dict:
    """`hybridtune train` in its own process; its run (and the final model it saves) in the private `work`."""
    out = work / "ht"
    cmd = ht_command(a, work, data, out)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    atomic_write_text(root / "ht.log", proc.stdout + proc.stderr)
    res = {"command": " ".join(cmd[1:]), "rc": proc.returncode, "wall_s": wall}
    metrics = out / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    rows = [r for r in rows if r.get("type") == "train"]
    if proc.returncode or not rows:
        res["error"] = last_error(proc.stderr, "no metrics")
        return res
    res["steps"] = [{"step": r["step"], "step_s": r.get("step_s"), "generation_s": r.get("time/generation_s"),
                     "loss": r.get("step_loss", r.get("loss")), "mem_gib": r.get("mem_gib"),
                     "completion_length": r.get("completions/mean_length"), "reward": r.get("reward")}
                    for r in rows]  # fmt: skip
    return res


def run_trl(a, root: Path, data: Path) -> dict:
    """TRL in this process (the caller runs it as `--only trl` in a fresh one)."""
    import torch
    import transformers
    from datasets import Dataset
    from transformers import TrainerCallback

    try:
        import trl
    except ImportError:
        return {"error": "trl is not installed: pip install trl==1.16.0"}
    from hybridtune.config import load_config
    from hybridtune.models.hub import resolve_source
    from hybridtune.models.loading import load_model, tokenizer_for
    from hybridtune.runtime.lora import lora_from_config

    sys.path.insert(0, str(root))  # (the private work folder the parent made: its reward file)
    from reward_digits import digits  # noqa: E402 - the file written beside the data

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bypassed = []
    if device.type == "cuda":  # plain transformers can only bypass FLA's Hopper guard (as the bench's hf modes do)
        from hybridtune.mixers import registry

        bypassed = [n for n in (s.bypass() for s in registry.selftests()) if n]
    cfg = load_config(None, {"base_model": a.base_model, "adapter": "lora", "lora_r": 16, "lora_dropout": 0.0,
                             "seed": 0})  # fmt: skip
    tok = tokenizer_for(a.base_model)
    torch.manual_seed(0)
    loaded = load_model(resolve_source(a.base_model), tok, seed=0, dtype=torch.bfloat16 if device.type == "cuda"
                        else torch.float32)  # fmt: skip
    model = loaded.model.to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = lora_from_config(model, cfg)
    gen = {"s": 0.0}
    original = transformers.generation.utils.GenerationMixin.generate

    def timed_generate(self, *args, **kwargs):
        torch.cuda.synchronize() if device.type == "cuda" else None
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.cuda.synchronize() if device.type == "cuda" else None
            gen["s"] += time.perf_counter() - t0

    transformers.generation.utils.GenerationMixin.generate = timed_generate
    steps: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            torch.cuda.synchronize() if device.type == "cuda" else None
            self.t0, gen["s"] = time.perf_counter(), 0.0

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize() if device.type == "cuda" else None
            mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
            steps.append({"step": state.global_step, "step_s": time.perf_counter() - self.t0,
                          "generation_s": gen["s"], "mem_gib": mem})  # fmt: skip

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and steps and "loss" in logs:
                steps[-1].update(loss=logs.get("loss"), reward=logs.get("reward"),
                                 completion_length=logs.get("completions/mean_length"))  # fmt: skip

    rows = [json.loads(x) for x in data.read_text().splitlines()]
    args = trl.GRPOConfig(
        output_dir=str(root / "trl-out"), per_device_train_batch_size=a.prompts * a.num_generations,
        gradient_accumulation_steps=1, num_generations=a.num_generations, max_completion_length=a.max_completion_length,
        temperature=1.0, beta=0.0, loss_type="dapo", learning_rate=1e-5, max_steps=a.steps, logging_steps=1,
        bf16=device.type == "cuda", gradient_checkpointing=True, report_to="none", save_strategy="no", seed=0,
        shuffle_dataset=False, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[digits], args=args, train_dataset=Dataset.from_list(rows),
                              processing_class=tok, callbacks=[Timer()])  # fmt: skip
    trainer.train()
    return {"trl": trl.__version__, "steps": steps, "kernel_guard": bypassed}


def median_after(steps: list[dict], key: str, skip: int = 2) -> float | None:
    vals = [s[key] for s in steps[skip:] if s.get(key) is not None] or [s[key] for s in steps if s.get(key)]
    return statistics.median(vals) if vals else None


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m hybridtune.bench.grpo_pair", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base_model", default="qwen3_5-2b")
    ap.add_argument("--steps", type=whole(1, MAX_STEPS), default=5)
    ap.add_argument("--prompts", type=whole(1, MAX_PROMPTS), default=8)
    ap.add_argument("--num_generations", type=whole(2, MAX_GENERATIONS), default=8)
    ap.add_argument("--max_completion_length", type=whole(1, MAX_COMPLETION), default=512)
    ap.add_argument(
        "--prompt_tokens", type=span(1, MAX_PROMPT_WORDS), default="64-256", help="LOW-HIGH words per prompt"
    )
    ap.add_argument("--output_dir", type=folder, default="outputs/bench-grpo")
    ap.add_argument("--results", type=file_path, default=None)
    ap.add_argument("--only", choices=["ht", "trl"], default=None)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)  # (the TRL child: the parent's work folder)
    a = ap.parse_args(argv)
    if a.only == "trl" and a.work:  # the child: data, reward and its result in the parent's private folder
        work = Path(a.work)
        res = run_trl(a, work, work / "prompts.jsonl")
        atomic_write_text(work / "trl.json", json.dumps(res, indent=1) + "\n")
        return 0
    _check_model(a.base_model)
    if a.results:
        from hybridtune.bench import results

        results.read(a.results)  # a damaged table is said now, not after both runs
    root = Path(a.output_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    low, high = a.prompt_tokens
    # The data, the reward file both tools import, the runs and TRL's result live in a private folder made now
    # (0700): nothing a previous run or another user left can be read as this run's, and none of it is a path
    # someone could plant a link at; the figures and logs go to output_dir through atomic writes.
    with tempfile.TemporaryDirectory(prefix="hybridtune-grpo-pair-", ignore_cleanup_errors=True) as work:
        return _pair(a, argv, root, Path(work), low, high)


def _check_model(name: str) -> None:
    """--base_model is a preset, a checkpoint folder or a hub id (each side downloads one itself), said here in one
    line rather than as both sides' failures."""
    from hybridtune.models.hub import looks_like_hub_id, resolve_source
    from hybridtune.models.presets import PRESETS

    if name in PRESETS:
        PRESETS[name]  # a bad NAME@layers=N is said now
    elif Path(name).expanduser().exists() or not looks_like_hub_id(name):
        resolve_source(name)  # (its ModelError names base_model and what it is not)


def _pair(a, argv, root: Path, work: Path, low: int, high: int) -> int:
    data = write_data(work, a.prompts * max(a.steps, 1), low, high, seed=1)
    doc = {"base_model": a.base_model, "prompts": a.prompts, "num_generations": a.num_generations,
           "max_completion_length": a.max_completion_length, "steps": a.steps, "tools": {}}  # fmt: skip
    if a.only in (None, "ht"):
        doc["tools"]["hybridtune"] = run_ht(a, root, work, data)
    if a.only in (None, "trl"):  # TRL in a fresh process (its own CUDA memory, nothing of hybridtune's patches)
        proc = subprocess.run(trl_command(a, work), capture_output=True, text=True, env=os.environ)
        atomic_write_text(root / "trl.log", proc.stdout + proc.stderr)
        result = work / "trl.json"
        got = json.loads(result.read_text()) if result.is_file() else {}
        if proc.returncode or not got.get("steps"):
            got.setdefault("error", last_error(proc.stderr, "no steps"))
            got["rc"] = proc.returncode
        doc["tools"]["trl"] = got
    for name, r in doc["tools"].items():
        if r.get("steps"):
            r["median_step_s"] = median_after(r["steps"], "step_s")
            r["median_generation_s"] = median_after(r["steps"], "generation_s")
            share = (r["median_generation_s"] or 0) / r["median_step_s"] if r["median_step_s"] else None
            r["generation_share"] = share
            print(f"{name}: {r['median_step_s']:.2f} s/step, generation {r['median_generation_s'] or 0:.2f} s "
                  f"({(share or 0):.0%})", flush=True)  # fmt: skip
        else:
            print(f"{name}: {r.get('error')}", flush=True)
    t = doc["tools"]
    if all(t.get(k, {}).get("median_step_s") for k in ("hybridtune", "trl")):
        doc["speedup"] = t["trl"]["median_step_s"] / t["hybridtune"]["median_step_s"]
        print(f"speedup: {doc['speedup']:.2f}x per step", flush=True)
    atomic_write_text(root / "grpo_pair.json", json.dumps(doc, indent=1) + "\n")
    if a.results:
        from hybridtune.bench import results

        prov = results.provenance_here()
        command = "python -m hybridtune.bench.grpo_pair " + " ".join(argv if argv is not None else sys.argv[1:])
        rows = []
        for name, r in t.items():
            n_tok = a.prompts * a.num_generations * a.max_completion_length
            rows.append(prov | {
                "command": command, "tool": "bench-grpo", "shape": a.base_model,
                "seq_len": a.max_completion_length, "mode": "grpo " + name, "adapter": "lora r=16", "gpus": 1,
                "tokens_per_s": n_tok / r["median_step_s"] if r.get("median_step_s") else None,
                "step_ms": 1000 * r["median_step_s"] if r.get("median_step_s") else None,
                "peak_gib": max((s.get("mem_gib") or 0) for s in r.get("steps", [{}])) or None, "mfu": None,
                "hfu": None, "loss_step1": (r.get("steps") or [{}])[0].get("loss"), "loss_last10": None,
                "first_step_s": (r.get("steps") or [{}])[0].get("step_s"),
                "status": "ok" if r.get("median_step_s") else (r.get("error") or "no steps")[:200],
                "source": str(root / "grpo_pair.json"),
                "note": f"{a.prompts} prompts x {a.num_generations} completions of up to {a.max_completion_length} "
                f"tokens per step; generation {r.get('median_generation_s')} s of the median step; tokens_per_s "
                "counts the completions' token budget per second",
            })  # fmt: skip
        results.append(rows, a.results)
    return _failed(doc["tools"], root)


LOGS = {"hybridtune": "ht.log", "trl": "trl.log"}


def _failed(tools: dict, root: Path) -> int:
    """0 when every side ran its steps; else 1, and one line on stderr naming each side that failed and its log."""
    failed = []
    for name, r in tools.items():
        if r.get("error") or not r.get("steps"):
            code = f"exit {r['rc']}: " if r.get("rc") else ""
            failed.append(
                f"the {name} side failed ({code}{r.get('error') or 'no steps'}); its log: {root / LOGS[name]}"
            )
    if failed:
        print(f"error: grpo_pair: {'; '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
