"""FLA's Triton autotuning, done once per GPU kind and shipped as data: no autotuning on a fresh machine.

- `save(path)` (after a run on the GPU: `hybridtune bench --save_kernel_configs FILE`) writes what every FLA
  autotuner of this process chose, per kernel and autotune key, with the device and the FLA / Triton versions;
- `seed()` (before the self-test: the suite's `seed_tuning`, called by `kernels.provision`) puts the shipped
  table of this GPU kind (`mixers/gdn/tuned/<GPU>.json`, package data) into the autotuners, so they pick without
  benchmarking.

The file is JSON, read as data: an entry is taken only when its config equals one of the kernel's own candidates, for
the device and versions it was made with, and never over a choice the process already made; it stands over Triton's
on-disk autotuning cache. With `FLA_CACHE_MODE` set, FLA's own config files choose and the table is not used; a kernel
the table does not cover autotunes as before. The self-test's verdicts are keyed by the table's digest; the choices
are FLA's Triton kernels' only, so a verdict of the GDN chunk on FlashQLA is keyed by flash-qla's version instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

from hybridtune.files import atomic_write_text
from hybridtune.versions import dist_version

logger = logging.getLogger(__name__)

FORMAT = "hybridtune-kernel-configs/1"
SHIPPED = Path(__file__).parent / "tuned"
_JSON_SCALARS = (bool, int, float, str, type(None))


def device_slug(name: str) -> str:
    """A device name as a file name: `NVIDIA H200` -> `NVIDIA_H200` (FLA's spelling of its config folders)."""
    return re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_") or "unknown"


def shipped(device: str) -> Path:
    """Where the table of `device`'s kind ships (it may not exist)."""
    return SHIPPED / f"{device_slug(device)}.json"


def digest(device: str) -> str:
    """The shipped table's sha256 (first 16 hex digits) for `device`, or "none": part of a self-test verdict's key."""
    path = shipped(device)
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.exists() else "none"


def versions() -> dict[str, str | None]:
    """The versions a table is valid for: the kernels' source (FLA) and their compiler (Triton)."""
    return {"fla": dist_version("fla-core", "flash-linear-attention"), "triton": dist_version("triton")}


def autotuners(modules: dict[str, Any] | None = None, kind: type | None = None) -> dict[str, Any]:
    """Every Triton autotuner in FLA's imported modules, by the defining function's `module.name`.

    A kernel is a module attribute that may wrap its autotuner (`@triton.heuristics` over `@autotune` over
    `@triton.jit`): each `.fn` is followed down to the plain function. A kernel re-exported by another module is
    the same object and is counted once. `modules` (default sys.modules) and `kind` (default Triton's Autotuner)
    are for tests."""
    if kind is None:
        from triton.runtime.autotuner import Autotuner as kind  # torch-bound: only on a GPU path

    found: dict[str, Any] = {}
    for mod_name, mod in list((modules if modules is not None else sys.modules).items()):
        if not (mod_name == "fla" or mod_name.startswith("fla.")) or mod is None:
            continue
        for value in list(vars(mod).values()):
            obj, tuner = value, None
            for _ in range(8):  # heuristics -> autotuner -> jit -> function; a bound on odd wrappers
                if isinstance(obj, kind):
                    tuner = obj
                inner = getattr(obj, "fn", None)
                if inner is None or inner is obj:
                    break
                obj = inner
            if tuner is not None and callable(obj):
                found.setdefault(f"{getattr(obj, '__module__', mod_name)}.{getattr(obj, '__name__', '?')}", tuner)
    return found


def _plain(config: Any) -> dict[str, Any]:
    """A Triton config as the flat dict Triton launches it with (its kwargs and num_warps, num_stages, ...)."""
    return dict(config.all_kwargs())


def snapshot(tuners: dict[str, Any] | None = None) -> dict[str, list[dict[str, Any]]]:
    """What each autotuner chose so far: {kernel: [{"key": [...], "config": {...}}]}, JSON-able entries only."""
    out: dict[str, list[dict[str, Any]]] = {}
    for name, tuner in sorted((tuners if tuners is not None else autotuners()).items()):
        entries = []
        for key, config in tuner.cache.items():
            plain = _plain(config)
            if _is_data(key, plain):
                entries.append({"key": list(key), "config": plain})
        if entries:
            out[name] = sorted(entries, key=lambda e: json.dumps(e["key"]))
    return out


def save(path: Path, device: str, tuners: dict[str, Any] | None = None) -> int:
    """Add this process's choices to the table at `path` (made for `device` and the installed versions; a table of
    other versions is replaced, not mixed; one of another device is refused). Returns the number of entries."""
    path = Path(path)
    table = _read(path) if path.exists() else None
    if table is not None and table.get("device") != device:
        raise ValueError(f"{path} holds the kernel configs of {table.get('device')}, not {device}: give another file")
    want = {"device": device, "versions": versions()}
    kernels: dict[str, list[dict[str, Any]]] = {}
    if table is not None and table.get("versions") == want["versions"]:  # (its device is this one: checked above)
        kernels = table["kernels"]
    for name, entries in snapshot(tuners).items():
        merged = {json.dumps(e["key"]): e for e in kernels.get(name, [])}
        merged.update({json.dumps(e["key"]): e for e in entries})  # this run's choice wins
        kernels[name] = [merged[k] for k in sorted(merged)]
    atomic_write_text(path, json.dumps({"format": FORMAT, **want, "kernels": kernels}, indent=1, sort_keys=True))
    return sum(len(v) for v in kernels.values())


def merge(out: Path, inputs: list[Path]) -> int:
    """Fold the tables at `inputs` (one per process: an xdist worker's, a bench's) into the table at `out`, as `save`
    adds a process's choices: one device, one set of versions (a table of other versions in `out` is replaced, an
    input of another device or versions is refused), the later input's choice wins. Returns the number of entries."""
    tables = [(p, _read(Path(p))) for p in inputs]
    tables = [(p, t) for p, t in tables if t is not None]
    if not tables:
        raise ValueError(f"none of {[str(p) for p in inputs]} is a {FORMAT} table")
    first = tables[0][1]
    device, vers = first.get("device"), first.get("versions")
    for p, t in tables:
        if (t.get("device"), t.get("versions")) != (device, vers):
            raise ValueError(f"{p} is for {_made(t.get('device'), t.get('versions'))}, not {_made(device, vers)}")
    out = Path(out)
    held = _read(out) if out.exists() else None
    if held is not None and held.get("device") != device:
        raise ValueError(f"{out} holds the kernel configs of {held.get('device')}, not {device}: give another file")
    kernels: dict[str, dict[str, Any]] = {}
    for t in ([held] if held is not None and held.get("versions") == vers else []) + [t for _, t in tables]:
        for name, entries in t["kernels"].items():
            for entry in entries if isinstance(entries, list) else []:
                key, config = _entry(entry)
                if key is not None:
                    kernels.setdefault(name, {})[json.dumps(list(key))] = {"key": list(key), "config": config}
    table = {name: [byk[k] for k in sorted(byk)] for name, byk in sorted(kernels.items())}
    atomic_write_text(out, json.dumps({"format": FORMAT, "device": device, "versions": vers, "kernels": table},
                                      indent=1, sort_keys=True))  # fmt: skip
    return sum(len(v) for v in table.values())


def covered() -> list[str]:
    """The GPU kinds a table ships for (`NVIDIA H200`, ...), as each table names its device."""
    names = []
    for path in sorted(SHIPPED.glob("*.json")):
        table = _read(path)
        if table is not None and isinstance(table.get("device"), str):
            names.append(table["device"])
    return names


def _read(path: Path) -> dict[str, Any] | None:
    """The table at `path`, or None (with the reason logged) when it is unreadable or not of this format."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        logger.warning("kernel config table %s unreadable (%s): FLA autotunes as usual", path, e)
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("kernels"), dict):
        logger.warning("kernel config table %s is not a %s file: FLA autotunes as usual", path, FORMAT)
        return None
    return data


def seed(device: str, path: Path | None = None, tuners: dict[str, Any] | None = None) -> str:
    """Put the table for `device` (default: the shipped one of its kind) into FLA's autotuners; returns the log line.

    Needs FLA's kernel modules imported (the self-test suite's `prepare()`, selftest.py's `seed_tuning`)."""
    if os.environ.get("FLA_CACHE_MODE", "disabled") != "disabled":
        return (
            f"kernel configs: FLA_CACHE_MODE={os.environ['FLA_CACHE_MODE']} is set: FLA's own config files choose; "
            "hybridtune's table is not used"
        )
    path = Path(path) if path is not None else shipped(device)
    if not path.exists():
        return (
            f"kernel configs: none shipped for {device} (tables ship for {', '.join(covered()) or 'no GPU'}): FLA "
            "autotunes its kernels (slow on a cold Triton cache; benchmarks/proof.sh cuda makes this GPU's table)"
        )
    table = _read(path)
    if table is None:
        return f"kernel configs: {path} not used (see the warning): FLA autotunes its kernels"
    have = versions()
    if table.get("device") != device or table.get("versions") != have:
        return (
            f"kernel configs: {path.name} is for {_made(table.get('device'), table.get('versions'))}, this is "
            f"{_made(device, have)}: FLA autotunes its kernels (make a table: hybridtune bench --save_kernel_configs)"
        )
    tuners = tuners if tuners is not None else autotuners()
    taken = offered = absent = 0
    for name, entries in table["kernels"].items():
        tuner = tuners.get(name)
        if tuner is None or not isinstance(entries, list):
            absent += 1
            continue
        for entry in entries:
            offered += 1
            key, config = _entry(entry)
            if key is None or key in tuner.cache:
                continue
            match = next((c for c in tuner.configs if _plain(c) == config), None)
            if match is None:
                logger.debug("kernel config for %s %s is none of its candidates: not taken", name, list(key))
                continue
            tuner.cache[key] = match
            taken += 1
    line = f"kernel configs: {taken} FLA autotuning choices taken from {path.name} ({_made(device, have)})"
    if taken < offered:
        line += f"; {offered - taken} of its {offered} not (already chosen, or not a candidate of that kernel)"
    if absent:
        line += f"; {absent} of its kernels not in this FLA"
    return line + "; kernels or keys it does not list autotune"


def _made(device: Any, vers: Any) -> str:
    """`NVIDIA H200, fla 0.6.0, triton 3.6.0`: what a table was made on, or what this process has."""
    pairs = sorted(vers.items()) if isinstance(vers, dict) else []
    return ", ".join([str(device), *(f"{k} {v}" for k, v in pairs)])


def _entry(entry: Any) -> tuple[tuple | None, dict[str, Any] | None]:
    """An entry's (key, config) when both are plain JSON of the expected shape, else (None, None)."""
    if not isinstance(entry, dict):
        return None, None
    key, config = entry.get("key"), entry.get("config")
    if not isinstance(key, list) or not isinstance(config, dict):
        return None, None
    if not _is_data(key, config):
        return None, None
    return tuple(key), config


def _is_data(key: Any, config: dict[str, Any]) -> bool:
    """Whether an autotune key and a config's launch kwargs are plain JSON scalars (what a table holds)."""
    return all(isinstance(v, _JSON_SCALARS) for v in (*key, *config.values()))


def main(argv: list[str] | None = None) -> int:
    """`python -m hybridtune.mixers.gdn.tuned merge OUT IN [IN ...]`: the tables of several processes folded into OUT
    (benchmarks/proof.sh cuda: one per xdist worker of the CUDA tier); `covered`: the GPU kinds a table ships for."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m hybridtune.mixers.gdn.tuned")
    sub = ap.add_subparsers(dest="verb", required=True)
    m = sub.add_parser("merge", help="fold tables into OUT")
    m.add_argument("out", type=Path)
    m.add_argument("inputs", type=Path, nargs="+")
    sub.add_parser("covered", help="the GPU kinds a table ships for")
    args = ap.parse_args(argv)
    if args.verb == "covered":
        print("\n".join(covered()))
        return 0
    try:
        n = merge(args.out, args.inputs)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {n} entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
