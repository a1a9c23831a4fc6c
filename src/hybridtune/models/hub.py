"""Where a model named by the user lives: a built-in preset, a local checkpoint directory, or a hub id resolved as
transformers resolves it (the local hub cache under HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE, a revision), through
`huggingface_hub.snapshot_download`. Everything after resolution (model, tokenizer, processor files, the tensors
transformers does not load) reads the one local directory it returns.

A name is tried in this order: a preset, an existing directory, a hub id (`org/name`). A download that cannot
happen (offline and not cached, no network, no such repository or revision, a gated one without a token) is one
ModelError line naming the id, the revision, the cache and what to do.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import httpx
from huggingface_hub import constants, snapshot_download
from huggingface_hub import errors as hf

from hybridtune.errors import ModelError, did_you_mean
from hybridtune.models.presets import PRESETS

logger = logging.getLogger(__name__)

# The files a training run reads from a hub repository: configs, weights, tokenizer and processor files, chat
# templates, the licence files an export carries (Qwen's repositories hold a `LICENSE` without a suffix). Not other
# weight formats (.bin, .gguf, .pth duplicates) and no code (remote code is never run).
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken", "README.md", "LICENSE*", "NOTICE*"]

# A hub model id: `org/name` (letters, digits, `-_.`; no `..`, no trailing `.`/`-`). A bare `name` (the hub's legacy
# ids, now all redirected to an org) is taken for a mistyped preset or path instead: its error lists the presets.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]{0,95}/[A-Za-z0-9][\w.\-]{0,95}$")


@dataclass(frozen=True)
class ModelSource:
    """A model named by the user, resolved. `name`: as the user named it (preset, path or hub id); `path`: the
    local directory holding it (None for a preset); `revision`: the commit a hub id resolved to (None otherwise)."""

    name: str
    path: Path | None
    revision: str | None = None

    @property
    def is_preset(self) -> bool:
        return self.path is None

    @property
    def config_ref(self) -> str:
        """What the kernel resolver reads the architecture from: the preset's name or the local directory."""
        return self.name if self.path is None else str(self.path)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_cache_dir() -> Path:
    """The hub cache as huggingface_hub finds it, read from the environment now (HF_HUB_CACHE, else HF_HOME/hub,
    else huggingface_hub's default), so a variable set after import still counts."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it, from the environment now (or as it was read at import)."""
    if "HF_HUB_OFFLINE" in os.environ:
        return _truthy(os.environ["HF_HUB_OFFLINE"])
    return bool(constants.HF_HUB_OFFLINE)


def looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and ".." not in name and not name.endswith((".", "-"))


def _not_found(name: str) -> ModelError:
    hint = did_you_mean(name, PRESETS, what="preset ") or f" Presets (random weights): {', '.join(PRESETS)}."
    return ModelError(
        f"base_model '{name}' is neither a preset, a local checkpoint directory nor a hub id (org/name).{hint}"
    )


def looks_like_path(name: str) -> bool:
    """A name the user meant as a local path: it holds a separator or starts with `.` or `~` (and is no hub id)."""
    return not looks_like_hub_id(name) and ("/" in name or os.sep in name or name.startswith((".", "~")))


def check_checkpoint_dir(path: Path, name: str | None = None) -> Path:
    """`path` if it is a directory with a config.json, else a ModelError (a mistyped path: that it does not exist)."""
    name = name or str(path)
    if path.is_file():
        raise ModelError(f"base_model '{name}' is a file; give the checkpoint directory that holds config.json")
    if not path.is_dir() and looks_like_path(name):
        raise ModelError(
            f"base_model '{name}': no such directory ({path.absolute()} does not exist); check the path "
            "(a hub id is org/name, a preset a bare name)"
        )
    if not path.is_dir():
        raise _not_found(name)
    if not (path / "config.json").is_file():
        raise ModelError(f"checkpoint directory '{path}' has no config.json; point base_model at a saved model")
    return path


def _download_error(repo_id: str, revision: str | None, e: Exception) -> ModelError:
    rev = f" at revision '{revision}'" if revision else ""
    cache = hub_cache_dir()
    if isinstance(e, hf.GatedRepoError):
        why = "is gated: accept its terms on huggingface.co and log in (`hf auth login`) or set HF_TOKEN"
    elif isinstance(e, hf.RevisionNotFoundError):
        why = "has no such revision; give a branch, tag or commit of the repository as `revision`"
    elif isinstance(e, hf.RepositoryNotFoundError):
        why = "is not on the hub (or is private: log in with `hf auth login` or set HF_TOKEN); check the id"
    elif isinstance(e, hf.LocalEntryNotFoundError) and hub_offline():
        why = (
            f"is not in the hub cache {cache} and HF_HUB_OFFLINE is set; download it once with network access "
            f"(`hf download {repo_id}`), point HF_HOME/HF_HUB_CACHE at the cache holding it, or give a local directory"
        )
    elif isinstance(e, hf.LocalEntryNotFoundError):
        why = (
            f"cannot be downloaded (no connection to the hub) and is not in the hub cache {cache}; "
            "check the network (or HF_ENDPOINT), or give a local directory"
        )
    else:
        first = (str(e).strip().splitlines() or [""])[0]
        why = f"cannot be downloaded ({type(e).__name__}: {first}); check the network and the id, or give a local directory"
    return ModelError(f"base_model '{repo_id}'{rev} {why}")


def check_revision(repo_id: str, revision: str | None) -> None:
    """A ModelError when `revision` is a path rather than a branch, tag or commit: huggingface_hub joins it onto the
    cache's refs/ and snapshots/ folders, so `..`, a leading `/` or a backslash would read outside the cache."""
    if revision is None:
        return
    parts = revision.split("/")
    why = (
        "'..'" if ".." in parts
        else "a leading '/'" if revision.startswith("/")
        else "a backslash" if "\\" in revision
        else "a control character" if not revision.isprintable()
        else "an empty or '.' part" if any(p in ("", ".") for p in parts)
        else None
    )  # fmt: skip
    if why is not None:
        raise ModelError(
            f"base_model '{repo_id}': revision '{revision}' is not a branch, tag or commit name: it holds {why}, "
            "which would name a path outside the hub cache; give a branch, tag or commit of the repository"
        )


def check_snapshot(repo_id: str, revision: str | None, snapshot: Path) -> Path:
    """`snapshot` when it and every file in it lie inside the repository's folder of the hub cache; a ModelError
    otherwise (a `refs/` file holding `../..`, or a snapshot or file linked elsewhere, planted in the cache). The
    cache itself may be reached through a symlink: both sides are resolved."""
    repo = (hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))).resolve()
    ref = f"refs/{revision or 'main'}"
    fix = f"the cache was changed by hand: delete {repo} and download the model again"
    if snapshot.resolve().parent != repo / "snapshots":
        raise ModelError(
            f"base_model '{repo_id}': its hub snapshot {snapshot} (from {ref}) lies outside the hub cache's "
            f"{repo / 'snapshots'}, so it is not read; {fix}"
        )
    for path in snapshot.rglob("*"):
        if not path.resolve().is_relative_to(repo):
            raise ModelError(
                f"base_model '{repo_id}': {path.relative_to(snapshot)} in its hub snapshot {snapshot} links to "
                f"{path.resolve()}, outside the hub cache's {repo}, so it is not read; {fix}"
            )
    return snapshot


def download(repo_id: str, revision: str | None = None, files: list[str] | None = None) -> Path:
    """The local snapshot of hub model `repo_id` at `revision` (default: main), downloaded into the hub cache when
    missing and the hub can be reached; `files`: the name patterns fetched (default HUB_FILES; ["config.json"] for a
    look at the architecture alone). One ModelError line when it cannot be had, or when the revision or what the
    cache holds for it would lead outside the cache."""
    check_revision(repo_id, revision)
    offline = hub_offline()
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=str(hub_cache_dir()),
            local_files_only=offline,
            allow_patterns=files or HUB_FILES,
        )
    # HfHubHTTPError covers a missing repository or revision and a gated one; LocalEntryNotFoundError offline or
    # unreachable and not cached; httpx's errors a proxy that refuses; OSError a cache that cannot be written.
    except (hf.HfHubHTTPError, hf.LocalEntryNotFoundError, httpx.HTTPError, OSError, ValueError) as e:
        raise _download_error(repo_id, revision, e) from None
    return check_snapshot(repo_id, revision, Path(path))


def resolve_source(name: str, revision: str | None = None, files: list[str] | None = None) -> ModelSource:
    """Resolve `base_model` (and `revision`, for a hub id) to a ModelSource; see the module docstring. `files`: as
    in `download`."""
    if name in PRESETS:
        if revision:
            logger.warning("revision '%s' ignored: base_model '%s' is a preset, not a hub id", revision, name)
        return ModelSource(name, None)
    path = Path(name).expanduser()
    if path.exists() or not looks_like_hub_id(name):
        source = ModelSource(name, check_checkpoint_dir(path, name))
        if revision:
            logger.warning("revision '%s' ignored: base_model '%s' is a local directory, not a hub id", revision, name)
        return source
    snapshot = download(name, revision, files)
    if not (snapshot / "config.json").is_file():
        raise ModelError(
            f"hub model '{name}'{f' at revision {revision!r}' if revision else ''} has no config.json in its "
            f"snapshot {snapshot}; is it a transformers model?"
        )
    logger.info("base_model %s: hub snapshot %s", name, snapshot)
    return ModelSource(name, snapshot, snapshot.name)
