"""The installed version of a distribution, by name: one lookup for the kernels' environment report and for the ops'
FLA adapter (which sits below kernels and may not import it)."""

from __future__ import annotations

import importlib.metadata


def dist_version(*dists: str) -> str | None:
    """The version of the first of `dists` (distribution names, e.g. "fla-core") that is installed, else None."""
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
