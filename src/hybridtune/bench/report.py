"""The bench's markdown table, one-line summaries and bar chart, from its JSON document."""

from __future__ import annotations

from pathlib import Path

BASELINE = "hf-eager"
DPO_BASELINE = "trl-dpo"  # the baseline of a run without hf-eager: TRL's DPOTrainer beside hybridtune's dpo


def baseline(doc: dict) -> str:
    """The mode the table's ratios are against: hf-eager, or trl-dpo in a run without it."""
    return DPO_BASELINE if BASELINE not in doc["modes"] and DPO_BASELINE in doc["modes"] else BASELINE


def _fmt(v, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def one_line(label: str, r: dict) -> str:
    if "error" in r or "skipped" in r:
        return f"{label}: {r.get('error') or 'skipped: ' + r['skipped']}"
    mem = r.get("peak_alloc_gib", r.get("peak_rss_gib"))
    return (
        f"{label}: {r['tokens_per_s']:,.0f} tok/s, first step {r['first_step_s']:.1f} s, "
        f"peak {_fmt(mem, '.2f')} GiB, loss {r['loss_step1']:.5f} -> {r['loss_last10_mean']:.5f}, "
        f"{r['graph_breaks']} graph breaks"
    )


def _gemm_rate(g: dict | None) -> str:
    """The profile's grouped-GEMM figure of a mode (`--profile`), or nothing (no profile)."""
    if not g:
        return ""
    if not g.get("tflops_per_s"):
        return "; no grouped-GEMM kernel found in the profile"
    return f"; grouped-GEMM kernels {g['kernel_ms_per_step']:.1f} ms/step, {g['tflops_per_s']:.0f} TFLOP/s (profile)"


def markdown(doc: dict, title: str | None = None) -> str:
    s = doc["settings"]
    versus = baseline(doc)
    base = doc["modes"].get(versus, {})
    base_tps = base.get("tokens_per_s")
    base_mem = base.get("peak_alloc_gib")
    peak = doc.get("peak", {}).get("flops_per_s")
    head = title or f"{s['preset']}, {s['seq_len']}-token packs, {s['adapter']}" + (
        f" r={s['lora_r']}" if s["adapter"] == "lora" else ""
    )
    if s["adapter"] == "lora" and s.get("lora_parameters") and not title:
        head += f" (+ experts: {','.join(s['lora_parameters'])})"
    lines = [
        f"**{head}** on {doc['device']} ({s['dtype']}; {s['steps']} timed steps after {s['warmup']} warm-up; "
        f"peak {_fmt(peak and peak / 1e12, '.3g')} TFLOP/s measured; commit {doc['git_commit'][:10]})",
        "",
        f"| mode | GC | tokens/s | vs {versus} | step ms | first step s | peak alloc GiB | vs {versus} | "
        "MFU | HFU | loss step 1 | loss last 10 | breaks | recompiles |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in doc["modes"].items():
        gc = "on" if r.get("mode", {}).get("gc", True) else "off"
        if "error" in r or "skipped" in r:
            why = r.get("error") or "skipped: " + r["skipped"]
            lines.append(f"| {label} | {gc} | {why} |" + " |" * 11)
            continue
        mem = r.get("peak_alloc_gib", r.get("peak_rss_gib"))
        lines.append(
            "| "
            + " | ".join(
                [
                    label,
                    gc,
                    f"{r['tokens_per_s']:,.0f}",
                    _fmt(base_tps and r["tokens_per_s"] / base_tps, ".2f") + "x",
                    f"{r['median_step_s'] * 1e3:.0f}",
                    f"{r['first_step_s']:.1f}",
                    _fmt(mem, ".2f"),
                    _fmt(base_mem and r.get("peak_alloc_gib") and r["peak_alloc_gib"] / base_mem, ".2f"),
                    _fmt(r.get("mfu") and 100 * r["mfu"], ".1f") + "%",
                    _fmt(r.get("hfu") and 100 * r["hfu"], ".1f") + "%",
                    f"{r['loss_step1']:.5f}",
                    f"{r['loss_last10_mean']:.5f}",
                    str(r["graph_breaks"]),
                    str(r["recompiles_after_warmup"]),
                ]
            )
            + " |"
        )
    if "warmup_asked" in s:
        lines += [
            "",
            f"Warm-up stretched from {s['warmup_asked']} to {s['warmup']} steps for every mode, so that each CUDA "
            "graph (one per distinct chunk count) is recorded before the timed steps and every mode's losses "
            "cover the same steps.",
        ]
    failed = {k: r["profile_error"] for k, r in doc["modes"].items() if r.get("profile_error")}
    if failed:
        lines += [
            "",
            "Profile failed (the timed figures above stand): " + "; ".join(f"{k}: {e}" for k, e in failed.items()),
        ]
    if doc.get("not_run"):
        lines += ["", "Not run (the bench was stopped before them): " + ", ".join(doc["not_run"]) + "."]
    moe = {k: r for k, r in doc["modes"].items() if r.get("experts")}
    if moe:
        lines += ["", "Routed experts per mode:"]
        lines += [
            f"- {k}: {r['experts']}"
            + (f"; LoRA on them: {r['experts_lora']}" if r.get("experts_lora") else "")
            + _gemm_rate(r.get("expert_gemms"))
            for k, r in moe.items()
        ]
    padded = {k: r for k, r in doc["modes"].items() if r.get("padded_tokens_per_pack") and r.get("step_tokens")}
    for k, r in padded.items():  # (a trl mode: its collator pads each batch to its longest row)
        real = sum(doc.get("pairs", {}).get("tokens_per_pack", [])) or None
        pad = sum(r["padded_tokens_per_pack"])
        share = f" ({100 * (1 - real / pad):.0f}% padding)" if real else ""
        lines += ["", f"{k}: its padded batches hold {pad:,} token slots per pass over the packs{share}."]
    longer = {  # documents written before the warm-up was one per run (some modes warmed up longer)
        k: r["warmup_steps"] for k, r in doc["modes"].items() if r.get("warmup_steps", s["warmup"]) != s["warmup"]
    }
    if longer:
        lines += [
            "",
            "Warm-up stretched for CUDA graphs in some modes only (their losses cover later steps): "
            + ", ".join(f"{k} {w} steps" for k, w in longer.items())
            + ".",
        ]
    return "\n".join(lines) + "\n"


def chart(doc: dict, path: Path, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {k: r for k, r in doc["modes"].items() if "tokens_per_s" in r}
    labels = list(ok)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(labels) + 4), 4.2))
    colors = ["#888888" if k.startswith(("hf-", "trl-")) else "#2b6cb0" for k in labels]
    ax1.bar(labels, [ok[k]["tokens_per_s"] for k in labels], color=colors)
    ax1.set_ylabel("tokens/s")
    ax1.set_title("throughput (higher is better)")
    mem = [ok[k].get("peak_alloc_gib", ok[k].get("peak_rss_gib")) or 0 for k in labels]
    ax2.bar(labels, mem, color=colors)
    ax2.set_ylabel("GiB")
    ax2.set_title("peak memory (lower is better)")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=30)
    s = doc["settings"]
    fig.suptitle(title or f"hybridtune bench: {s['preset']}, {s['seq_len']}-token packs, {doc['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
