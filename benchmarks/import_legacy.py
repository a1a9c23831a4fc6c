"""One-off: the H200 figures of benchmarks/results/ (bench JSONs, train metrics, one log) as rows of results.jsonl."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

from hybridtune.bench import results, table

R = Path("benchmarks/results")
OLD = "bench/results"  # the path in git history (before the rename)
OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results.jsonl")
V_S3 = {"torch": "2.11.0+cu130", "transformers": "5.17.0", "peft": "0.21.0", "fla": "0.6.0", "triton": "3.6.0"}


def sha(c: str) -> str:
    return subprocess.check_output(["git", "rev-parse", c.split()[0] + "^{commit}"], text=True).strip()


def src(p: Path) -> str:
    return f"git show 3c7b598:{OLD}/{p.relative_to(R)}"


rows: list[dict] = []

# name, how it was launched, labels by mode, note
BENCH = [
    (
        "2026-11-29-gpu-run1/bench-gpu0.json",
        "HYBRIDTUNE_GIT_COMMIT=6c2ef5d T0=530 bash bench/gpu/session2.sh, GPU 0 of nvidia-h200-x2",
        {},
        "GPU 1 ran the CUDA tests and compiles at the same time (no CPU split); cold Triton cache; "
        "MFU/HFU are means over the timed steps (the bench then)",
    ),
    (
        "2026-11-29-gpu-run1/bench-gpu1.json",
        "HYBRIDTUNE_GIT_COMMIT=6c2ef5d T0=530 bash bench/gpu/session2.sh, GPU 1 of nvidia-h200-x2",
        {"ht-modules": "ht-modules (dynamic layout then)"},
        "after the CUDA tests on the same GPU; MFU/HFU are means over the timed steps (the bench then)",
    ),
    (
        "2026-11-29-gpu-run2/bench-gpu0.json",
        "HYBRIDTUNE_GIT_COMMIT=e751cdd T0=470 SAVE_CACHE=0 MODES0=... bash bench/gpu/session2.sh, GPU 0",
        {"ht-loop": "ht-loop, fused loss compiled"},
        "caches of the previous run carried (warm first step); GPU 1 compiled on the same 32 cores at the same "
        "time; MFU/HFU are means over the timed steps",
    ),
    (
        "2026-11-29-gpu-run2/bench-gpu1-hf-compile.json",
        "HYBRIDTUNE_GIT_COMMIT=e751cdd ... MODES1=hf-compile bash bench/gpu/session2.sh, GPU 1",
        {},
        "",
    ),
    (
        "2026-11-29-gpu-run3/bench-2b-16k.json",
        "HYBRIDTUNE_GIT_COMMIT=1f0893e T0=525 bash bench/gpu/session2-final.sh, GPU 0 (cores 0-15)",
        {"ht-loop": "ht-loop, conv + l2norm traced"},
        "inductor cache filled by the 4096-token compile just before; MFU/HFU are means over the timed steps",
    ),
    (
        "2026-11-29-gpu-run3/bench-2b-4k-partial.json",
        "HYBRIDTUNE_GIT_COMMIT=1f0893e T0=525 bash bench/gpu/session2-final.sh, GPU 0 (cores 0-15)",
        {},
        "partial run: ht-loop cut by the call's limit in its cold compile; hf-eager under the 16-core split "
        "with GPU 1 compiling",
    ),
    (
        "2026-11-29-gpu-run3/bench-0.8b-4k-partial.json",
        "HYBRIDTUNE_GIT_COMMIT=1f0893e T0=525 bash bench/gpu/session2-final.sh, GPU 1 (cores 16-31)",
        {},
        "partial run: ht-loop cut by the call's limit",
    ),
    (
        "2026-11-30-gpu-session3/callA/bench-2b-4k-partial.json",
        "HYBRIDTUNE_GIT_COMMIT=f3bdf5f T0=525 bash bench/gpu/session3-a.sh, GPU 0 (cores 0-19) of nvidia-h200-x2",
        {"ht-loop": "ht-loop, conv + l2norm traced"},
        "GPU 1 ran the CUDA tests (Triton compiles) on the other 12 cores at the same time, which slowed the "
        "host-bound modes (hf-eager's steps 308-514 ms); ht-loop:cg=on had no first step before the call's limit; "
        "MFU/HFU are means over the timed steps",
    ),
    (
        "2026-11-30-gpu-session4/callA/b2b-4k/bench.json",
        "HYBRIDTUNE_GIT_COMMIT=f262f76 T0=545 bash bench/gpu/session4-a.sh, nvidia-h200 (cores 0-10)",
        {"ht-loop": "ht-loop, static layout (7.3% filler)", "ht-loop:cg=on": "ht-loop:cg=on (conv traced)"},
        "the CUDA loop tests ran on cores 11-15 of the same GPU during the first mode's compile; "
        "static layout of that code: 7.3% filler",
    ),
    (
        "2026-11-30-gpu-session4/callC/b2b-4k/bench.json",
        "HYBRIDTUNE_GIT_COMMIT=7bbe5e9 T0=555 bash bench/gpu/session4-c.sh, GPU 0 (cores 0-15) of nvidia-h200-x2",
        {"ht-loop:cg=on": "ht-loop:cg=on (conv traced)"},
        "ht-loop:cg=on's timed steps overlapped the last second of a full fine-tune on GPU 1; hf-eager ran alone",
    ),
    (
        "2026-11-30-gpu-session4/callD/b08-4k/bench.json",
        "HYBRIDTUNE_GIT_COMMIT=7c11723 T0=300 bash bench/gpu/session4-d.sh, GPU 0 (cores 0-15) of nvidia-h200-x2",
        {"ht-loop:cg=on": "ht-loop:cg=on (conv traced)"},
        "the 9B shape compiled on GPU 1 at the same time",
    ),
    (
        "2026-11-30-gpu-session4/callD/b9-4k/bench.json",
        "HYBRIDTUNE_GIT_COMMIT=7c11723 T0=300 bash bench/gpu/session4-d.sh, GPU 1 (cores 16-31) of nvidia-h200-x2",
        {},
        "cold compile of 32 layers within the call's last 215 s",
    ),
    (
        "2026-11-30-gpu-session5/callA/b2b-4k-gpu0/bench.json",
        "HYBRIDTUNE_GIT_COMMIT=f36c819 T0=545 bash bench/gpu/next-a.sh, GPU 0 (cores 0-15) of nvidia-h200-x2",
        {"ht-loop:cg=on": "ht-loop:cg=on (conv traced)"},
        "the other GPU ran the conv=op bench at the same time",
    ),
    (
        "2026-11-30-gpu-session5/callA/b2b-4k-gpu1/bench.json",
        "HYBRIDTUNE_GIT_COMMIT=f36c819 T0=545 bash bench/gpu/next-a.sh, GPU 1 (cores 16-31) of nvidia-h200-x2",
        {},
        "this code stretched the warm-up of the CUDA-graph mode only (16 steps against hf-eager's 3), so "
        "loss_last10 is the mean of steps 14-23, which both modes ran (the JSON's own last-10 compares steps "
        "27-36 against 14-23)",
    ),
    (
        "2026-11-30-gpu-session5/callB/b2b-4k-nocg/bench.json",
        "HYBRIDTUNE_GIT_COMMIT=fe69bc0 T0=530 bash bench/gpu/session5-b.sh, GPU 1 (cores 16-31) of nvidia-h200-x2",
        {"ht-loop": "ht-loop (no CUDA graphs, conv traced)", "ht-loop:conv=op": "ht-loop:conv=op (no CUDA graphs)"},
        "the 9B bench ran on GPU 0 at the same time",
    ),
    (
        "2026-11-30-gpu-session5/callB/b9-4k/bench.json",
        "HYBRIDTUNE_GIT_COMMIT=fe69bc0 T0=530 bash bench/gpu/session5-b.sh, GPU 0 (cores 0-15) of nvidia-h200-x2",
        {"ht-loop:cg=on": "ht-loop:cg=on (conv op)"},
        "4 layouts, 8 warm-up + 12 timed steps; hf-eager's record was lost (see its own row)",
    ),
]

for name, launched, labels, note in BENCH:
    p = R / name
    doc = json.loads(p.read_text())
    doc["git_commit"] = sha(doc["git_commit"])
    for row in results.bench_rows(doc, source=src(p), note=f"launched by {launched}" + (f"; {note}" if note else "")):
        if row["mode"] in labels:
            row["label"] = labels[row["mode"]]
        rows.append(row)

# The 9B hf-eager of session 5 call B: its worker's record was lost at the call's limit; its log has the steps.
log = R / "2026-11-30-gpu-session5/callB/b9-4k/logs/hf-eager.log"
steps = [
    (float(m[1]), float(m[2])) for m in re.finditer(r"^step \d+/\d+ ([\d.]+) ms loss ([\d.]+)", log.read_text(), re.M)
]
b9 = next(r for r in rows if r["shape"] == "qwen3_5-9b" and r["commit"].startswith("fe69bc0"))
timed = [t for t, _ in steps[8:20]]
rows.append(
    {
        **{k: b9[k] for k in ("date", "commit", "device", "versions", "command", "tool", "run", "shape", "seq_len")},
        "mode": "hf-eager",
        "label": "hf-eager (from its step log)",
        "adapter": b9["adapter"],
        "gpus": 1,
        "tokens_per_s": 4096 / (statistics.median(timed) / 1e3),
        "step_ms": statistics.median(timed),
        "peak_gib": None,
        "mfu": None,
        "hfu": None,
        "loss_step1": steps[0][1],
        "loss_last10": statistics.fmean(x for _, x in steps[10:20]),
        "first_step_s": steps[0][0] / 1e3,
        "status": "ok",
        "source": src(log),
        "note": "the call's limit ended the bench after hf-eager's 20th step but before its worker returned a record: "
        "figures from its step log, median of the same timed steps 9-20 (4096 tokens per pack); peak memory and "
        "MFU/HFU not recorded",
    }
)

# The first GDN benchmark (before `hybridtune bench`): plain / patched / compiled loop, LoRA r=16 on q/k/v/o.
p = R / "2026-11-29-gdn-bench.json"
doc = json.loads(p.read_text())
for variant, r in doc["variants"].items():
    rows.append(
        {
            "date": "2026-11-29",
            "commit": sha("1b7fd08"),
            "device": doc["device"],
            "versions": results.versions(doc["versions"]),
            "command": doc["command"].replace("/opt/torch/.venv/bin/python3 ", "python3 ").replace("/root/out/", ""),
            "tool": "gdn-bench",
            "run": "2026-11-29 gdn-bench",
            "shape": "qwen3_5-2b",
            "seq_len": sum(doc["layouts"][0]),
            "mode": variant,
            "adapter": "lora r=16 (q/k/v/o)",
            "gpus": 1,
            "tokens_per_s": r["tokens_per_s"],
            "step_ms": r["median_step_s"] * 1e3,
            "peak_gib": r["peak_mem_gib"],
            "mfu": None,
            "hfu": None,
            "loss_step1": None,
            "loss_last10": None,
            "first_step_s": r["first_step_s"],
            "status": "ok",
            "source": src(p),
            "note": f"{doc['what']}; {doc['steps']} timed steps after {doc['warmup']} warm-up over 5 layouts; "
            "the script (bench/gdn/bench_loop.py) is superseded by `hybridtune bench`",
        }
    )

# `hybridtune train` runs (benchmarks/scaling.sh, formerly bench/dist/gpu_dist.sh).
DIST = [
    (
        "2026-11-30-gpu-session3/callB",
        "d6c92c0",
        "HYBRIDTUNE_GIT_COMMIT=d6c92c0 bash .snap/bench/gpu/session3-b.sh (gpu_dist.sh one, two-lora, two-full)",
        2,
        "per-run limits 250/130/130 s, every run hit its limit; lora-1 and full-1 side by side on the two GPUs",
    ),
    (
        "2026-11-30-gpu-session3/callC",
        "4cb15df",
        "HYBRIDTUNE_GIT_COMMIT=4cb15df bash .snap/bench/gpu/session3-c.sh (gpu_dist.sh one, two-lora, two-full)",
        2,
        "limits 200/135/135 s: no run reached a logged step (cold compiles)",
    ),
    (
        "2026-11-30-gpu-session4/callB",
        "95a6025",
        "HYBRIDTUNE_GIT_COMMIT=95a6025 T0=555 bash bench/gpu/session4-b.sh (two-lora, one-lora, two-full, one-full)",
        2,
        "one run at a time; the 2-GPU run first (cold caches), the 1-GPU run after it (warm)",
    ),
    (
        "2026-11-30-gpu-session4/callC/dist",
        "7bbe5e9",
        "HYBRIDTUNE_GIT_COMMIT=7bbe5e9 T0=555 bash bench/gpu/session4-c.sh (one-full-gpu1, then two-full)",
        2,
        "full-1 on GPU 1 beside a bench on GPU 0; FSDP2 with the model as one unit, reduced every micro-batch",
    ),
    (
        "2026-11-30-gpu-session5/callC",
        "8b414ac",
        "HYBRIDTUNE_GIT_COMMIT=8b414ac T0=555 bash bench/gpu/session5-c.sh (two-full-modules, one-full-modules, "
        "one-lora)",
        2,
        "--compile modules, FSDP2 per decoder layer; dynamic layout: windows 6-10, 11-15 and 26-30 hold recompiles "
        "of the layer forwards, so the median mixes them in (the windows without recompiles: 24.0-25.5k on 1 GPU, "
        "24.5-27.8k on 2)",
    ),
    (
        "2026-11-30-gpu-session6/callA",
        "5024d5b",
        "HYBRIDTUNE_GIT_COMMIT=5024d5b T0=555 bash bench/gpu/session6-a.sh (two-full, one-full, two-lora, one-lora)",
        8,
        "profiled at steps 11-13 (that window left out); FSDP2's whole-model unit reduced once per optimizer step",
    ),
    (
        "2026-11-30-gpu-session6/callB",
        "efb9bac",
        "HYBRIDTUNE_GIT_COMMIT=efb9bac T0=555 bash bench/gpu/session6-b.sh (two-lora, one-lora, one-lora-t1)",
        8,
        "profiled at steps 11-13 (that window left out)",
    ),
    (
        "2026-11-30-gpu-session6/callC",
        "efb9bac",
        "PHASES='one-full two-full' HYBRIDTUNE_GIT_COMMIT=efb9bac T0=540 bash bench/gpu/session6-a.sh",
        8,
        "the full pair again in the other order (1 GPU first); profiled at steps 11-13 (that window left out)",
    ),
    (
        "2026-11-30-gpu-session6/callD",
        "efb9bac",
        "PHASES='one-lora two-lora' PROFILE=0 STEPS=25 HYBRIDTUNE_GIT_COMMIT=efb9bac T0=283 bash "
        "bench/gpu/session6-a.sh; then PACKS=8 PROFILE=0 STEPS=25 RUN_T=84 bash bench/dist/gpu_dist.sh two-lora",
        8,
        "no profiler; another machine lease than call B; lora-2 did not reach its first step in 84 s",
    ),
]
for d, commit, command, packs, note in DIST:
    path = R / d
    vfile = path / "versions.txt"
    torch_v, tf_v, peft_v = vfile.read_text().split() if vfile.exists() else (V_S3["torch"], "5.17.0", "0.21.0")
    prov = {
        "date": "2026-11-30",
        "commit": sha(commit),
        "device": "NVIDIA H200",
        "versions": {"torch": torch_v, "transformers": tf_v, "fla": "0.6.0", "peft": peft_v},
    }
    for name in table.names(path):
        run = table.run(path, name)
        if run["status"] == "not run":
            continue
        rows.append(
            results.train_row(
                run,
                provenance=prov,
                command=command,
                source=src(path / f"{name}.metrics.jsonl"),
                shape="qwen3_5-2b",
                seq_len=4096,
                packs=packs,
                note=note,
            )  # fmt: skip
        )

# The CPU compile-time measurement README cites (no result file: NOTES 12b and the commit message hold it).
for layout, first in (("static", 86.9), ("dynamic", 198.3)):
    rows.append(
        {
            "date": "2026-11-30",
            "commit": sha("8c896a6"),
            "device": "CPU (2 cores)",
            "versions": {"torch": "2.11.0", "transformers": "5.17.0"},
            "command": f"python bench/cpu/compile_time.py 24 {layout}",
            "tool": "cpu-compile",
            "run": "2026-11-30 cpu-compile",
            "shape": "qwen3_5-2b topology, 24 narrow layers",
            "seq_len": None,
            "mode": f"loop, aot_eager, layout={layout}",
            "adapter": "lora r=16",
            "gpus": 0,
            "tokens_per_s": None,
            "step_ms": None,
            "peak_gib": None,
            "mfu": None,
            "hfu": None,
            "loss_step1": None,
            "loss_last10": None,
            "first_step_s": first,
            "status": "ok",
            "source": "commit 8c896a6 (message) and bench/NOTES.md 12b; no result file was kept",
            "note": "first step of a 24-layer compiled loop on the quiet 2-core CPU machine; later steps 1.0-1.3 s "
            "for both; the code measured is the tree just before 8c896a6",
        }
    )

OUT.write_text("")
added = results.append(rows, OUT)
for r in added:
    tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else r["status"][:40]
    print(r["id"], r["date"], r["commit"][:7], r["tool"], r["shape"], r["gpus"], r["mode"], tps, sep="\t")
