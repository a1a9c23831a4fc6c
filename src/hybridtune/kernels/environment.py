"""Facts about the environment: installed versions, the git commit, the GPU, the cache directories.

Which version of a distribution is installed: `dist_version` (by distribution name, from the leaf
`hybridtune.versions`, which the ops' FLA adapter uses too) and `installed_version` (by import name). `environment()` is what is recorded next to every GPU result and what
`hybridtune doctor` prints first. Nothing here installs anything; `use_compile_caches` sets the compile caches'
variables for the process.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from hybridtune import __version__
from hybridtune.versions import dist_version  # noqa: F401 (this module's version lookup)

logger = logging.getLogger(__name__)

# Distributions whose versions decide the fast path (and the self-test cache key).
VERSIONED = (
    "torch",
    "triton",
    "transformers",
    "peft",
    "accelerate",
    "flash-linear-attention",
    "fla-core",
    "causal-conv1d",
    "mamba-ssm",
    "flash-attn",
    "tilelang",
    "liger-kernel",
    "kernels",
)

# Words an environment switch (HYBRIDTUNE_OFFLINE, HYBRIDTUNE_REQUIRE_FAST_PATH, ...) may use.
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")


def installed_version(import_name: str) -> str | None:
    """Version of an importable package (by import name), "unknown" when no distribution names it, or None
    when it is not importable."""
    importlib.invalidate_caches()
    try:
        if importlib.util.find_spec(import_name) is None:
            return None
    except (ImportError, ValueError):
        return None
    candidates = [import_name, import_name.replace("_", "-")]
    try:
        candidates += importlib.metadata.packages_distributions().get(import_name, [])
    except Exception:  # metadata of a broken install: the package is still importable
        pass
    if import_name == "fla":
        candidates.insert(0, "fla-core")
    return dist_version(*candidates) or "unknown"


def git_commit() -> str | None:
    """`HYBRIDTUNE_GIT_COMMIT` when set (a tree copied to another machine may carry a stale .git, whose HEAD
    is older than the code it runs), else HEAD of the checkout this package runs from."""
    named = os.environ.get("HYBRIDTUNE_GIT_COMMIT") or None
    head = None
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        head = out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        pass
    if named and head and not head.startswith(named) and not named.startswith(head):
        logger.warning(
            "HYBRIDTUNE_GIT_COMMIT=%s differs from the tree's git HEAD %s; recording %s", named, head[:10], named
        )
    return named or head or None


def gpu_info() -> dict[str, Any]:
    try:
        import torch  # why here: the environment is reported even where torch does not import
    except ImportError:
        return {"available": False, "reason": "torch is not importable"}
    if not torch.cuda.is_available():
        return {"available": False, "reason": f"no CUDA device visible to torch {torch.__version__}"}
    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        devices.append(
            {
                "index": i,
                "name": p.name,
                "capability": f"{p.major}.{p.minor}",
                "memory_gib": round(p.total_memory / 2**30, 1),
                "multiprocessors": p.multi_processor_count,
            }
        )
    return {"available": True, "cuda": torch.version.cuda, "devices": devices}


def detect_accelerator() -> str | None:
    """'cuda' (with the device name) when a CUDA device is visible, else None. Imports torch."""
    try:
        import torch
    except ImportError:
        return None
    if torch.cuda.is_available():
        return f"cuda ({torch.cuda.get_device_name(0)})"
    return None


def environment() -> dict[str, Any]:
    """Versions and device, as committed next to every GPU result."""
    return {
        "hybridtune": __version__,
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {d: dist_version(d) for d in VERSIONED},
        "gpu": gpu_info(),
    }


def cache_dir() -> Path:
    """hybridtune's cache: `$HYBRIDTUNE_CACHE_DIR`, else `$XDG_CACHE_HOME/hybridtune`, else `~/.cache/hybridtune`."""
    if os.environ.get("HYBRIDTUNE_CACHE_DIR"):
        return Path(os.environ["HYBRIDTUNE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hybridtune"


# The compile caches and the variables that place them: inductor's generated code and compiled graphs, and
# Triton's compiled kernels with the autotuning results FLA keeps there (its `cache_results`).
COMPILE_CACHES = (("inductor", "TORCHINDUCTOR_CACHE_DIR"), ("triton", "TRITON_CACHE_DIR"))
# Counting a cache's files stops here: past it, the cache is warm and the exact number says nothing more.
CACHE_COUNT_CAP = 10_000


def _entries(path: Path) -> int:
    """Files under `path` (0 when it does not exist), counted up to CACHE_COUNT_CAP."""
    n = 0
    for _, _, files in os.walk(path):
        n += len(files)
        if n >= CACHE_COUNT_CAP:
            return CACHE_COUNT_CAP
    return n


def use_compile_caches() -> str:
    """Point inductor and Triton at caches that outlive the process, before anything compiles: each variable of
    COMPILE_CACHES a user set is kept, the others are set to `cache_dir()/<name>`. Returns the log line: each
    cache's place and whether it is cold (empty or new: this run compiles and autotunes everything) or warm."""
    parts = []
    for name, var in COMPILE_CACHES:
        ours = str(cache_dir() / name)
        chosen = os.environ.get(var) or ours
        os.environ[var] = chosen
        n = _entries(Path(chosen))
        state = f"warm, {n}{'+' if n >= CACHE_COUNT_CAP else ''} files" if n else "cold, empty"
        parts.append(f"{name} {chosen} ({state}{'' if chosen == ours else f', from {var}'})")
    return "compile caches: " + "; ".join(parts)
