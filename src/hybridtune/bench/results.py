"""The results table: one append-only JSONL file of measured rows, and the README tables rendered from it.

    python -m hybridtune.bench.results add-bench OUT/bench.json [--table T]   # a `hybridtune bench` run's modes
    python -m hybridtune.bench.results add-train DIR NAME... --command CMD [--table T]
                                                    # `hybridtune train` runs left by benchmarks/scaling.sh
    python -m hybridtune.bench.results render [--table T]            # print the README's generated tables
    python -m hybridtune.bench.results render --readme README.md [--check]
                                                    # write them between the README's markers (or only check)

`hybridtune bench --results T` appends its rows itself. A row is one measured configuration: when and on what
(date, commit, device, versions, command), what (tool, shape, seq_len, mode, adapter, gpus, engine), the figures
(tokens_per_s, step_ms, peak_gib, mfu, hfu, loss_step1, loss_last10, first_step_s; null where not measured),
`status` ("ok", or why there is no figure), and `source`/`note`. Rows are numbered (`id`) as they are appended
and never rewritten, so a report or the README cites a row by its id. Each README table lists the row ids it
shows (`README_TABLES`); a test checks that the README holds exactly what `render` makes of the table.
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
from hybridtune.bench.report import BASELINE
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
            "shape": s["preset"],
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


# Rendering


def _n(v, spec: str, suffix: str = "") -> str:
    return "" if v is None else format(v, spec) + suffix


def _pct(v) -> str:
    return "" if v is None else f"{100 * v:.1f}%"


def _label(r: dict) -> str:
    return r.get("label") or r["mode"]


def _tokens_cell(r: dict) -> str:
    """tokens/s, or why the row has none."""
    return _n(r["tokens_per_s"], ",.0f") if r["tokens_per_s"] is not None else r["status"]


def _loss_span(r: dict) -> str:
    """A train row's `loss step 1 -> last (step N)`, or nothing where it has not both."""
    last = r.get("loss_last")
    return f"{r['loss_step1']:.3f} -> {last[1]:.3f} (step {last[0]})" if last and r.get("loss_step1") else ""


SHAPE_FAMILIES = {"qwen3_5-": "", "qwen3_next-": "Next-"}  # preset prefix -> its short form in the tables


def _shape(r: dict) -> str:
    """qwen3_5-2b -> 2B, qwen3_5-35b-a3b@layers=8 -> 35B-A3B@layers=8, qwen3_next-80b-a3b@layers=24 ->
    Next-80B-A3B@layers=24; other presets as they are."""
    name, at, cut = r["shape"].partition("@")
    for prefix, short in SHAPE_FAMILIES.items():
        if name.startswith(prefix):
            return short + name.removeprefix(prefix).upper() + at + cut
    return name + at + cut


def _bench_table(rows: dict[int, dict], entries: list, baseline_of: dict[int, int]) -> list[str]:
    out = [
        "| shape | pack | mode | tokens/s | vs hf-eager | step ms | peak GiB | HFU | MFU "
        "| loss step 1 / last 10 | first step | row |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rid in entries:
        r = rows[rid]
        base = baseline_of.get(rid) or _same_run_baseline(rows, r)
        ratio = ""
        if base and r["tokens_per_s"] and rows[base]["tokens_per_s"]:
            ratio = f"{r['tokens_per_s'] / rows[base]['tokens_per_s']:.2f}x"
            if base != rid and rows[base].get("run") != r.get("run"):
                ratio += f" (row {base})"
        tps = _tokens_cell(r)
        loss = " / ".join(x for x in (_n(r["loss_step1"], ".5f"), _n(r["loss_last10"], ".5f")) if x)
        out.append(
            f"| {_shape(r)} | {r['seq_len']:,} | {_label(r)} | {tps} | {ratio} | {_n(r.get('step_ms'), '.0f')} "
            f"| {_n(r['peak_gib'], '.2f')} | {_pct(r['hfu'])} | {_pct(r['mfu'])} | {loss} "
            f"| {_n(r['first_step_s'], '.0f', ' s')} | {rid} |"
        )
    return out


def _same_run_baseline(rows: dict[int, dict], r: dict) -> int | None:
    for rid, x in rows.items():
        if x.get("run") == r.get("run") and x["mode"] == BASELINE and x.get("tokens_per_s"):
            return rid
    return None


def _train_table(rows: dict[int, dict], entries: list) -> list[str]:
    """`hybridtune train` rows: tokens/s (the median of the windows after step 10, else the status) and the range of
    the logged windows after step 5 (the first steps compile and record CUDA graphs), or after step 1 where fewer than
    two windows come after step 5."""
    out = [
        "| shape | pack | run | tokens/s | windows (tokens/s) | peak GiB | first step | loss step 1 -> last | row |",
        "|---|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    for rid in entries:
        r = rows[rid]
        windows = r.get("windows") or []
        rates = [w[2] for w in windows if w[0] > 5]
        rates = rates if len(rates) > 1 else [w[2] for w in windows if w[0] > 1]
        span = f"{min(rates):,.0f}-{max(rates):,.0f}" if rates else ""
        tps = _tokens_cell(r)
        loss = _loss_span(r)
        out.append(
            f"| {_shape(r)} | {r['seq_len']:,} | {_label(r)} | {tps} | {span} | {_n(r['peak_gib'], '.2f')} "
            f"| {_n(r['first_step_s'], '.0f', ' s')} | {loss} | {rid} |"
        )
    return out


ENGINES = {"ddp": "DDP", "fsdp": "FSDP2"}


def _scaling_table(rows: dict[int, dict], entries: list) -> list[str]:
    out = [
        "| run | GPUs | engine | tokens/s | per GPU | peak GiB per GPU | scaling | loss step 1 -> last | row |",
        "|---|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    for rid, one in entries:
        r = rows[rid]
        scale = ""
        if one:
            scale = f"{r['tokens_per_s'] / (r['gpus'] * rows[one]['tokens_per_s']):.2f} (row {one})"
        loss = _loss_span(r)
        out.append(
            f"| {r['adapter']} | {r['gpus']} | {ENGINES.get(r.get('engine'), '-')} | {r['tokens_per_s']:,.0f} "
            f"| {r['tokens_per_s'] / r['gpus']:,.0f} | {r['peak_gib']:.1f} | {scale} | {loss} | {rid} |"
        )
    return out


# What the README shows: row ids per table (a new figure of record is a new row id here).
README_TABLES = {
    # Single GPU, the figures of record: the 2B, 0.8B and 9B shapes at 4096 tokens, hf-eager first in each run
    # (the newest code first, then the variants of the conv and of CUDA graphs).
    # Rows 98, 97 (2026-12-02, session 15): hf-eager beside train's compiled mode under checkpointing (regions, CUDA
    # graphs, the cores kept); then that mode's steps alone: cold on a fresh machine (93), the cores recomputed and kept
    # in one run (95, 96), 131,072 tokens (91), and the 9B's cold regional first step (94).
    # Then train's compiled mode (regions) alone at 4096 and 131,072 tokens (rows 89, 91: no hf-eager in their runs).
    # The MoE shapes, each pair in one run: Qwen3.5-35B-A3B (all 40 layers) and Qwen3-Next-80B-A3B cut to 24 layers.
    "perf-table": {
        "rows": [98, 97, 93, 95, 96, 91, 71, 72, 89, 74, 73, 76, 75, 94, 84, 83, 86, 85, 27, 26, 24, 25, 30, 29, 28],
        "baseline": {24: 27, 25: 27},
    },
    # Lanes side by side on one GPU (first steps and long packs; their tokens/s are not figures of record).
    "lanes-table": {"rows": [78, 79, 80, 92], "baseline": {}},
    # The path to there: earlier code (ratios against the same run's hf-eager, else the row named).
    "perf-history": {
        "rows": [1, 5, 2, 4, 3, 9, 6, 14, 17, 10, 11, 20, 19, 22, 21, 32, 31, 66, 65, 77, 82],
        "baseline": {5: 1, 4: 1, 6: 1, 14: 1, 82: 77},
    },
    # One GPU through `hybridtune train` (its defaults: CUDA graphs, checkpointing from the memory estimate).
    # Rows 90, 87, 88 (2026-12-02) the machine alone: a fresh machine with the shipped FLA table, cold, warm.
    "train-table": {"rows": [90, 87, 88, 67, 68, 69, 81, 70]},
    # 1 vs 2 GPUs through `hybridtune train`: (row, the 1-GPU row a 2-GPU row is scaled against, or None).
    "scaling-table": {"rows": [(56, None), (57, 56), (54, None), (55, 54), (59, None), (60, 59)]},
}


def render(rows: list[dict], name: str) -> str:
    by_id = {r["id"]: r for r in rows}
    spec = README_TABLES[name]
    missing = [i for i in _ids(spec) if i not in by_id]
    if missing:
        raise ConfigError(f"README table '{name}' names rows {missing} that the results table does not hold")
    if name == "scaling-table":
        lines = _scaling_table(by_id, spec["rows"])
    elif name == "train-table":
        lines = _train_table(by_id, spec["rows"])
    else:
        lines = _bench_table(by_id, spec["rows"], spec["baseline"])
    return "\n".join(lines) + "\n"


def _ids(spec: dict) -> list[int]:
    out = []
    for e in spec["rows"]:
        out += [x for x in (e if isinstance(e, tuple | list) else (e,)) if x is not None]
    return out + list(spec.get("baseline", {}).values())


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}: generated by `python -m hybridtune.bench.results render --readme README.md` -->", (
        f"<!-- /{name} -->"
    )


def update_readme(text: str, rows: list[dict], where: str = "README.md") -> str:
    """`text` with every generated table replaced by what `render` makes of `rows`."""
    for name in README_TABLES:
        start, end = markers(name)
        a, b = text.find(start), text.find(end)
        if a < 0 or b < a:
            raise ConfigError(f"{where}: no '{start}' ... '{end}' block; add the two marker lines")
        text = text[: a + len(start)] + "\n" + render(rows, name) + text[b:]
    return text


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
    r = sub.add_parser("render", help="the README's generated tables")
    r.add_argument("--readme", type=Path, help="write them into this file between the markers")
    r.add_argument("--check", action="store_true", help="with --readme: only say whether the file is current")
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
    elif a.cmd == "add-train":
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
    else:
        rows = read(a.table)
        if not a.readme:
            for name in README_TABLES:
                print(f"{markers(name)[0]}\n{render(rows, name)}")
            return 0
        old = a.readme.read_text(encoding="utf-8")
        new = update_readme(old, rows, str(a.readme))
        if a.check:
            if new != old:
                print(f"{a.readme}: its generated tables differ from {a.table}; run without --check", file=sys.stderr)
                return 1
            return 0
        a.readme.write_text(new, encoding="utf-8")
        return 0
    for row in added:
        print(f"row {row['id']}: {row['mode']} {row['shape']} {row['status']} {_n(row['tokens_per_s'], ',.0f')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
