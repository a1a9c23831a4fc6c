"""The results table: one append-only JSONL file of measured rows.

    python -m hybridtune.bench.results add-bench OUT/bench.json [--table T]   # a `hybridtune bench` run's modes
    python -m hybridtune.bench.results add-train DIR NAME... --command CMD [--table T]
                                                    # `hybridtune train` runs left by benchmarks/scaling.sh
    python -m hybridtune.bench.results provenance   # this machine's date, commit, device, versions (for add-train)

`hybridtune bench --results T` appends its rows itself. A row is one measured configuration: when and on what
(date, commit, device, versions, command), what (tool, shape, seq_len, mode, adapter, gpus, engine), the figures
(tokens_per_s, step_ms, peak_gib, mfu, hfu, loss_step1, loss_last10, first_step_s; null where not measured),
`status` ("ok", or why there is no figure), and `source`/`note`. Rows are numbered (`id`) as they are appended
and never rewritten, so a report or a doc cites a row by its id. The tables of README.md and docs/PERFORMANCE.md
are rendered from it by benchmarks/tools/render_docs.py (not part of the wheel).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

from hybridtune.bench import table
from hybridtune.errors import ConfigError
from hybridtune.kernels.environment import environment

TABLE = Path("benchmarks/results.jsonl")
REQUIRED = ("date", "commit", "device", "versions", "command", "tool", "shape", "mode", "gpus", "status", "source")
FIGURES = ("tokens_per_s", "step_ms", "peak_gib", "mfu", "hfu", "loss_step1", "loss_last10", "first_step_s")
VERSION_KEYS = {  # row key: distribution name as `hybridtune doctor` reports it
    "torch": "torch",
    "transformers": "transformers",
    "fla": "flash-linear-attention",
    "cuda": "cuda",
    "triton": "triton",
    "peft": "peft",
}


# Reading and appending


def read(path: Path = TABLE) -> list[dict]:
    """Every row of the table; a line that is not a JSON object is one clear error naming the file and line."""
    if not path.is_file():
        return []
    return _parse(path.read_text(encoding="utf-8"), path)


def _parse(text: str, path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{path}:{n}: not a JSON row ({e}); fix or remove that line") from None
        if not isinstance(row, dict) or not isinstance(row.get("id"), int):
            raise ConfigError(f"{path}:{n}: a row must be a JSON object with an integer 'id'; fix that line")
        rows.append(row)
    return rows


def append(rows: list[dict], path: Path = TABLE) -> list[dict]:
    """Number the rows after the table's last id and append them; returns them with their ids.

    The file is locked from reading the last id to the end of the write, so benches running side by side
    (one per GPU) can append to one table."""
    for r in rows:
        missing = [k for k in REQUIRED if k not in r]
        if missing:
            raise ConfigError(f"a results row lacks {', '.join(missing)} (row: {json.dumps(r)[:200]})")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        last = max((r["id"] for r in _parse(f.read(), path)), default=0)
        out = [{"id": last + i, **{k: v for k, v in r.items() if k != "id"}} for i, r in enumerate(rows, 1)]
        for r in out:
            f.write(json.dumps(r, ensure_ascii=True) + "\n")
    return out


def versions(found: dict) -> dict:
    """The versions a row keeps, from `hybridtune doctor`'s names (or the row's own already)."""
    out = {}
    for key, dist in VERSION_KEYS.items():
        v = found.get(dist) or found.get(key)
        if v:
            out[key] = v
    return out


# Rows from what the tools leave


def _status(r: dict) -> str:
    if "error" in r or "skipped" in r:
        why = r.get("error") or "skipped: " + str(r["skipped"])
        return why.splitlines()[0][:200]
    return "ok"


def bench_rows(doc: dict, source: str, note: str = "") -> list[dict]:
    """One row per mode of a `hybridtune bench` document (its bench.json).

    `loss_last10` is the mean of the last 10 steps that every mode of the run ran, so modes that warmed up
    longer compare over the same steps."""
    s = doc["settings"]
    ran = [len(r["losses"]) for r in doc["modes"].values() if r.get("losses")]
    common = min(ran, default=0)
    run = f"{doc['date']} {s['preset']} {s['seq_len']}"
    rows = []
    for label, r in doc["modes"].items():
        ok = "tokens_per_s" in r
        row = {
            "date": doc["date"][:10],
            "commit": doc["git_commit"],
            "device": doc["device"],
            "versions": versions(doc.get("versions", {})),
            "command": doc["command"],
            "tool": "bench",
            "run": run,
            "shape": s["preset"] + (" vision-language" if s.get("vision") else ""),  # (bench --vision)
            "seq_len": s["seq_len"],
            "mode": label,
            "adapter": s["adapter"]
            + (f" r={s['lora_r']}" if s["adapter"] == "lora" else "")
            + (" +experts" if s["adapter"] == "lora" and s.get("lora_parameters") else ""),
            "gpus": 1,
            "tokens_per_s": r.get("tokens_per_s"),
            "step_ms": r["median_step_s"] * 1e3 if ok else None,
            "peak_gib": r.get("peak_alloc_gib", r.get("peak_rss_gib")),
            "mfu": r.get("mfu"),
            "hfu": r.get("hfu"),
            "loss_step1": r.get("loss_step1"),
            "loss_last10": statistics.fmean(r["losses"][max(0, common - 10) : common]) if ok and common else None,
            "first_step_s": r.get("first_step_s"),
            "status": _status(r) if r else "no record",
            "source": source,
        }
        if note:
            row["note"] = note
        rows.append(row)
    return rows


def train_row(
    run: dict, *, provenance: dict, command: str, source: str, shape: str, seq_len: int, packs: int, note: str = ""
) -> dict:
    """One row from `table.run` (a `hybridtune train` run that benchmarks/scaling.sh left)."""
    loss = run.get("loss")
    variant = table.variant(run["name"])
    mode = "train" + {"m": ":compile=modules", "t1": ":omp_threads=1"}.get(variant, f":{variant}" if variant else "")
    row = {
        **provenance,
        "command": command,
        "tool": "train",
        "shape": shape,
        "seq_len": seq_len,
        "packs_per_step": packs,
        "mode": mode,
        "adapter": run["adapter"],
        "gpus": run["gpus"],
        "engine": run["engine"],
        "tokens_per_s": run.get("tokens_per_s"),
        "peak_gib": run.get("peak_mem_gib"),
        "first_step_s": run.get("first_step_s"),
        "loss_step1": loss[1] if loss and loss[0] == 1 else None,
        "loss_last": [loss[2], loss[3]] if loss else None,
        "windows": [[*w["steps"], round(w["tokens_per_s"], 1)] for w in run.get("windows", [])],
        "status": run["status"],
        "rc": run["rc"],
        "source": source,
    }
    if note:
        row["note"] = note
    return row


def provenance_here(device: str | None = None) -> dict:
    """date, commit, device and versions of this machine (`hybridtune doctor`'s environment)."""
    env = environment()
    gpus = env["gpu"].get("devices") or []
    found = dict(env["versions"], cuda=env["gpu"].get("cuda"))
    return {
        "date": datetime.now(timezone.utc).date().isoformat(),
        "commit": env["git_commit"] or "unknown",
        "device": device or (gpus[0]["name"] if gpus else "CPU"),
        "versions": versions(found),
    }


def _provenance_file(path: Path) -> dict:
    """date, commit, device and versions as `provenance` wrote them on the machine that ran the runs."""
    try:
        prov = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable provenance file ({e}); pass what `provenance` printed") from None
    missing = [k for k in ("date", "commit", "device", "versions") if not isinstance(prov, dict) or k not in prov]
    if missing:
        raise ConfigError(f"{path}: no {', '.join(missing)}; pass what `provenance` printed on the run's machine")
    return {k: prov[k] for k in ("date", "commit", "device", "versions")}


# Command line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridtune.bench.results", description=__doc__.splitlines()[0])
    ap.add_argument("--table", type=Path, default=TABLE, help=f"the results table (default {TABLE})")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("add-bench", help="append the rows of a hybridtune bench run (its bench.json)")
    b.add_argument("bench_json", type=Path)
    t = sub.add_parser("add-train", help="append hybridtune train runs left by benchmarks/scaling.sh")
    t.add_argument("dir", type=Path)
    t.add_argument("names", nargs="+", help="run names (lora-1, full-2, ...)")
    t.add_argument("--command", required=True, help="the command that produced the runs")
    t.add_argument("--shape", default="qwen3_5-2b")
    t.add_argument("--seq-len", type=int, default=4096)
    t.add_argument("--packs", type=int, default=2, help="packs per optimizer step")
    t.add_argument("--note", default="", help="what a reader of the row must know (the GPU shared, say)")
    t.add_argument(
        "--provenance",
        type=Path,
        help="date, commit, device and versions from this JSON file (what `provenance` "
        "printed on the machine that ran them) instead of this machine's",
    )
    sub.add_parser("provenance", help="this machine's date, commit, device and versions as JSON (for add-train)")
    a = ap.parse_args(argv)
    try:
        return _run(a)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(a: argparse.Namespace) -> int:
    if a.cmd == "add-bench":
        try:
            doc = json.loads(a.bench_json.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"{a.bench_json}: not a readable bench.json ({e}); pass the file hybridtune bench wrote"
            ) from None
        added = append(bench_rows(doc, source=str(a.bench_json)), a.table)
    elif a.cmd == "provenance":
        print(json.dumps(provenance_here()))
        return 0
    else:  # add-train
        prov = _provenance_file(a.provenance) if a.provenance else provenance_here()
        added = []
        for name in a.names:
            run = table.run(a.dir, name)
            if run["status"] == "not run":
                raise ConfigError(f"{a.dir}: no {name}.log or {name}.metrics.jsonl; name a run scaling.sh made")
            row = train_row(
                run, provenance=prov, command=a.command, source=f"{a.dir}/{name}", shape=a.shape,
                seq_len=a.seq_len, packs=a.packs, note=a.note,
            )  # fmt: skip
            added += append([row], a.table)
    for row in added:
        tps = "" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:,.0f}"
        print(f"row {row['id']}: {row['mode']} {row['shape']} {row['status']} {tps}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
