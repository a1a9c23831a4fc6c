"""The `hybridtune train` runs of `benchmarks/scaling.sh` as a table, and their scaling as JSON.

    python -m hybridtune.bench.table DIR            # the markdown table of DIR's runs (scaling.sh prints it)
    python -m hybridtune.bench.table DIR... --json OUT --call DIR="COMMAND" ... [--meta KEY=VALUE ...]
                                                    # every run of every DIR, and each 2-GPU run's scaling
                                                    # against each 1-GPU run of the same adapter, into OUT

A run NAME (lora-1, lora-2, full-1, full-2, full-1m, lora-1t1, ...) left NAME.log, NAME.metrics.jsonl and, when
profiled, NAME.profile.json. Its tokens/s is the median over the logged windows that start after step 10 (past
compilation), leaving out a window that holds a profiled step (the profiler slows it). Scaling is the 2-GPU
tokens/s over twice the 1-GPU figure of the same adapter and variant (the name's tail after the GPU count: full-2m
pairs with full-1m); a 1-GPU run with OMP_NUM_THREADS=1 (tail "t1") pairs with the plain 2-GPU run, whose ranks
torchrun starts with that setting.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from hybridtune.runtime.profiling import summary_line

KNOWN = ["lora-1", "lora-2", "full-1", "full-2"]
FIRST_STEP = 10  # windows starting after this step count
THREAD_VARIANT = "t1"  # a 1-GPU run with OMP_NUM_THREADS=1: torchrun's ranks run so, so it pairs with the plain run


def gpus(name: str) -> int:
    return 2 if name.partition("-")[2].startswith("2") else 1


def variant(name: str) -> str:
    """The name's tail after the GPU count: "" for lora-1 / full-2, "m" for full-2m, "t1" for lora-1t1."""
    return name.partition("-")[2][1:]


def run(r: Path, name: str) -> dict:
    """One run's figures; `status` says what is missing when it has no step."""
    log, m = r / f"{name}.log", r / f"{name}.metrics.jsonl"
    out: dict = {"name": name, "gpus": gpus(name), "adapter": name.partition("-")[0]}
    out["engine"] = "-" if out["gpus"] == 1 else ("ddp" if out["adapter"] == "lora" else "fsdp")
    # The runner's "rc N at Ns" line; lines after it (the results tool's own, appended to the same log) are not it.
    ends = [x for x in log.read_text().splitlines() if re.fullmatch(r"rc \d+( at \d+s)?", x)] if log.exists() else []
    out["rc"] = ends[-1] if ends else ("no rc line" if log.exists() else "not run")
    recs = [x for x in map(json.loads, m.read_text().splitlines()) if x.get("type") == "train"] if m.exists() else []
    if not recs:
        out["status"] = "no step logged" if m.exists() or log.exists() else "not run"
        return out
    profiled = range(0)
    prof = r / f"{name}.profile.json"
    if prof.exists():
        doc = json.loads(prof.read_text())
        profiled = range(doc["steps"][0], doc["steps"][1] + 1)
        out["profile"] = doc
    # A logged window is the steps since the previous logged one.
    ends = [x["step"] for x in recs]
    starts = dict(zip(ends, [0] + ends[:-1]))
    windows = [
        {"steps": [starts[x["step"]] + 1, x["step"]], "tokens_per_s": x["tokens_per_s"]}
        for x in recs
        if "tokens_per_s" in x and x["step"] > 1
    ]
    used = [
        w
        for w in windows
        if w["steps"][0] > FIRST_STEP and not any(w["steps"][0] <= s <= w["steps"][1] for s in profiled)
    ]
    out.update(
        windows=windows,
        peak_mem_gib=max(x.get("mem_gib", 0) for x in recs),
        first_step_s=recs[0].get("first_step_s"),  # (runs before that record: None)
        # Each step's own loss (`step_loss`; the logged `loss` is the mean over the logging window), as rows of runs
        # from before that mean record.
        loss=[recs[0]["step"], recs[0]["loss"], recs[-1]["step"], recs[-1].get("step_loss", recs[-1]["loss"])],
        status="ok" if used else f"no window after step {FIRST_STEP}",
    )
    if used:
        tps = statistics.median(w["tokens_per_s"] for w in used)
        out.update(tokens_per_s=tps, per_gpu=tps / out["gpus"], windows_used=[w["steps"] for w in used])
    return out


def names(r: Path) -> list[str]:
    found = {p.name.split(".")[0] for p in r.glob("*.metrics.jsonl")} | {p.stem for p in r.glob("*.log")}
    return KNOWN + sorted(found - set(KNOWN))


def table(r: Path) -> str:
    rows = [
        "| run | GPUs | engine | tok/s (median, global) | per GPU | peak mem GiB (max over ranks) | loss first -> last | rc |",
        "|---|---|---|---|---|---|---|---|",
    ]
    profiles = []
    for name in names(r):
        x = run(r, name)
        if "tokens_per_s" not in x:
            rows.append(f"| {name} | | | {x['status'] if x['status'] != 'not run' else ''} | | | | {x['rc']} |")
            continue
        loss = f"{x['loss'][1]:.3f} -> {x['loss'][3]:.3f}"
        rows.append(
            f"| {name} | {x['gpus']} | {x['engine']} | {x['tokens_per_s']:,.0f} | {x['per_gpu']:,.0f} | "
            f"{x['peak_mem_gib']:.1f} | {loss} | {x['rc']} |"
        )
        if "profile" in x:
            doc = x["profile"]
            for rank, p in enumerate(doc["ranks"]):
                text = p["error"] if "error" in p else summary_line(p)
                profiles.append(f"- {name} steps {doc['steps'][0]}-{doc['steps'][1]}, rank {rank}: {text}")
    return "\n".join(rows + profiles)


def scaling(runs: list[dict]) -> list[dict]:
    """Each 2-GPU run against each 1-GPU run of the same adapter and variant (see the module's docstring)."""
    out = []
    for two in runs:
        if two["gpus"] != 2 or two.get("status") != "ok":
            continue
        for one in runs:
            same = variant(one["name"]) in (variant(two["name"]), THREAD_VARIANT if not variant(two["name"]) else None)
            if one["gpus"] == 1 and one["adapter"] == two["adapter"] and same and one.get("status") == "ok":
                out.append(
                    {
                        "two": two["id"],
                        "one": one["id"],
                        "same_call": two["dir"] == one["dir"],
                        "efficiency": two["tokens_per_s"] / (2 * one["tokens_per_s"]),
                    }
                )
    return out


def _read(f: Path) -> str | None:
    return f.read_text().strip() if f.exists() else None


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, help="write every run and the scaling pairs here")
    ap.add_argument("--call", action="append", default=[], help='DIR="the command that produced DIR"')
    ap.add_argument("--meta", action="append", default=[], help="KEY=VALUE recorded as is (e.g. fla=0.6.0)")
    a = ap.parse_args(argv)
    if not a.json:
        for d in a.dirs:
            print(table(d))
        return 0
    calls = dict(c.split("=", 1) for c in a.call)
    runs, meta = [], {}
    for d in a.dirs:
        command = calls.get(str(d), calls.get(d.name, ""))
        commit = re.search(r"HYBRIDTUNE_GIT_COMMIT=(\w+)", command)
        meta[d.name] = {
            "command": command,
            "commit": commit.group(1) if commit else None,
            "versions (torch transformers peft)": _read(d / "versions.txt"),
            "device": _read(d / "nvidia-smi.txt"),
        }
        for name in names(d):
            x = run(d, name)
            if x.get("status") == "not run":
                continue
            x.pop("profile", None)  # the profile files stay beside the logs
            runs.append({"id": f"{d.name}/{name}", "dir": d.name, **x})
    doc = {
        "calls": meta,
        **dict(m.split("=", 1) for m in a.meta),
        "runs": runs,
        "scaling": scaling(runs),
        "method": __doc__.split("\n\n", 2)[2].strip(),
    }
    a.json.write_text(json.dumps(doc, indent=2) + "\n")
    for s in doc["scaling"]:
        print(f"{s['two']} vs {s['one']}: {s['efficiency']:.3f}{'' if s['same_call'] else ' (different calls)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
