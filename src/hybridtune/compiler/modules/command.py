"""`hybridtune compile`: generate standalone per-class forwards, for one family or for all of them.

    hybridtune compile --family qwen3_5 [--dump DIR] [--backend inductor]
    hybridtune compile --check DIR --family qwen3_5   verify a dump against what is generated now
    hybridtune compile --sweep [--families a,b] [--jobs N] [--json] [--verbose]

`--family` prints the plan per class and, with `--dump`, writes the generated modules (one file per
modeling module) with a manifest of hashes. `--sweep` generates every nn.Module class of every
modeling module of the installed transformers and exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
import sys

from hybridtune.compiler.modules.diskload import read_verified, write_dump
from hybridtune.compiler.modules.plan import format_plan, plan_class
from hybridtune.compiler.modules.standalone import generate_loaded
from hybridtune.compiler.modules.sweep import all_families, family_modules, format_report, module_classes, run_sweep
from hybridtune.errors import UserError


class CompileCommandError(UserError, ValueError):
    """Bad arguments to `hybridtune compile`."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridtune compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--family", help="transformers model family (directory name under transformers/models)")
    p.add_argument("--dump", metavar="DIR", help="write the generated modules and a MANIFEST.json here")
    p.add_argument("--check", metavar="DIR", help="verify a dump of --family against what is generated now")
    p.add_argument("--sweep", action="store_true", help="generate every class of every family and report")
    p.add_argument("--families", help="with --sweep: comma-separated families instead of all")
    p.add_argument("--backend", default=None, help="torch.compile backend written into the generated code")
    p.add_argument("--jobs", type=int, default=None, help="with --sweep: worker processes (default: CPU count)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--verbose", action="store_true", help="with --sweep: list what was left alone and why")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.sweep:
        return _sweep(args)
    if not args.family:
        raise CompileCommandError("give --family NAME (e.g. --family qwen3_5) or --sweep")
    if args.check and not os.path.isdir(args.check):
        raise CompileCommandError(f"--check '{args.check}' is not a directory; give the directory written by --dump")
    return _family(args)


def _sweep(args: argparse.Namespace) -> int:
    families = [f.strip() for f in args.families.split(",") if f.strip()] if args.families else None
    if families:
        _check_families(families)
    jobs = args.jobs if args.jobs is not None else max(1, min(os.cpu_count() or 1, 8))
    report = run_sweep(families, backend=args.backend or "eager", jobs=jobs)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_report(report, verbose=args.verbose))
    return 1 if report.totals()["failures"] else 0


def _check_families(families: list[str]) -> None:
    available = all_families()
    for f in families:
        if f not in available:
            near = difflib.get_close_matches(f, available, n=3)
            hint = f" Did you mean {', '.join(near)}?" if near else ""
            raise CompileCommandError(
                f"transformers has no model family {f!r} (a directory under transformers/models).{hint}"
            )


def _family(args: argparse.Namespace) -> int:
    _check_families([args.family])
    generated = {}
    out: dict = {"family": args.family, "modules": {}}
    for modname in family_modules(args.family):
        try:
            mod = importlib.import_module(modname)
        except Exception as e:  # an optional dependency of that family is missing
            raise CompileCommandError(f"cannot import {modname}: {type(e).__name__}: {e}") from e
        plans = [plan_class(c) for c in module_classes(mod)]
        decorations = {
            p.cls: p.decoration(args.backend or "inductor") for p in plans if p.decision in ("compile", "eager")
        }
        gm = generate_loaded(mod, decorations)
        for p in plans:
            if p.cls.__qualname__ in gm.skipped:
                p.decision, p.fullgraph, p.reason = "left", False, gm.skipped[p.cls.__qualname__]
        generated[gm.basename] = gm
        out["modules"][modname] = {"plans": [p.to_dict() for p in plans], "sha256": gm.sha256, "file": gm.basename}
        if not args.json:
            print(f"{modname}  ({len(gm.sections)} generated, sha256 {gm.sha256[:12]})")
            print(format_plan(plans))
            print()
    if args.dump:
        path = write_dump(args.dump, {name: gm.text for name, gm in generated.items()})
        out["dump"] = str(path)
        if not args.json:
            print(f"wrote {len(generated)} module(s) and MANIFEST.json to {path}")
    if args.check:
        for name, gm in generated.items():
            read_verified(args.check, name, gm.sha256)
        out["check"] = "ok"
        if not args.json:
            print(f"{args.check}: {len(generated)} module(s) match what is generated now")
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
