"""Training over several machines: what torchrun's ranks on different hosts must share."""

from __future__ import annotations

import socket
from pathlib import Path

from hybridtune.errors import ConfigError
from hybridtune.runtime import distributed
from hybridtune.runtime.distributed import Dist


def check_shared_output_dir(d: Dist, run_file: Path) -> None:
    """Every rank sees `run_file`, which rank 0 wrote into the output directory during setup: checkpoints are written
    there by every rank and committed by rank 0 renaming a directory, so over several machines the output directory
    must be one shared directory. A ConfigError on every rank otherwise, naming the ranks and hosts that do not see
    it."""
    if not d.enabled:
        return
    distributed.barrier(d)
    seen = distributed.gather_objects((run_file.is_file(), socket.gethostname(), str(run_file.parent)), d)
    blind = [f"rank {r} on {host}" for r, (ok, host, _) in enumerate(seen) if not ok]
    if blind:
        raise ConfigError(
            f"output_dir '{seen[0][2]}' is not shared: {', '.join(blind)} cannot see {run_file.name}, written "
            "there by rank 0; over several machines output_dir must be one directory every machine mounts at the "
            "same path"
        )
