"""A model built on the meta device (no storage), then filled in place, so that no process holds the whole model.

- `skeleton`: the model of a config on the meta device (structure, tied weights, no storage, no init run);
  `models.loading` gives it the dtypes and frozen parameters of a plain load.
- `fill`: once the parameters have storage (`to_empty`, after `fully_shard` or not), each parameter's local part (its
  FSDP2 shard: a contiguous range of dim-0 rows; else the whole tensor) is written by a `Reader`: `CheckpointReader`
  reads those rows from the safetensors files (`safe_open(...).get_slice`), `PresetReader` replays transformers'
  `initialize_weights` with the preset's seed, `Overlay` adds parameters made before the fill (a LoRA adapter);
  then the buffers (rotary tables) are recomputed.

A checkpoint's keys are the model's own names, except the routed experts saved one tensor per expert and held fused:
`experts.gate_up_proj` [E, 2I, H] (gate and up of each expert concatenated), `experts.down_proj` [E, H, I] (stacked).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors import safe_open

from hybridtune.errors import ModelError

logger = logging.getLogger(__name__)

# (row start, row stop) of a parameter's saved rows that this rank holds -> that block, in the dtype saved
Reader = Callable[[str, int, int], torch.Tensor]
_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<which>gate_up_proj|down_proj)$")


@dataclass
class FillStats:
    """What a fill materialised on this rank: `local_bytes` the parameter parts it holds, `staged_bytes` the
    largest block read or generated at once on the host (never the whole model), `model_bytes` the whole model."""

    local_bytes: int = 0
    staged_bytes: int = 0
    model_bytes: int = 0
    parameters: int = 0

    def staged(self, t: torch.Tensor) -> None:
        self.staged_bytes = max(self.staged_bytes, t.numel() * t.element_size())


def skeleton(config, cls: type | None = None) -> torch.nn.Module:
    """The model of `config` (class `cls`, default the causal LM of its model_type) on the meta device: its structure
    and tied weights, no storage, no init run."""
    cls = cls or transformers.AutoModelForCausalLM
    with torch.device("meta"):
        if cls is transformers.AutoModelForCausalLM:
            return cls.from_config(config)
        return cls._from_config(config)


def local_rows(p: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    """(first row, row count, local shape) of this rank's part of `p` (a DTensor sharded on dim 0, or a plain
    tensor held whole)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        shape = tuple(p.shape)
        return 0, shape[0] if shape else 0, shape
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for placement in p.placements:
        if isinstance(placement, Shard) and placement.dim != 0:
            raise ModelError(f"a parameter sharded on dim {placement.dim}: only dim-0 shards (FSDP2's) load sharded")
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return (offset[0] if offset else 0), (shape[0] if shape else 0), tuple(shape)


def _local(p: torch.Tensor) -> torch.Tensor:
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) else p


@torch.no_grad()
def fill(model: torch.nn.Module, read: Reader, stats: FillStats | None = None) -> FillStats:
    """Write every parameter's local part from `read(name, start, stop)` (rows start:stop of the whole tensor,
    any dtype: cast here), then recompute the buffers. The model's parameters hold storage already
    (`to_empty`), sharded or not."""
    stats = stats or FillStats()
    for name, p in model.named_parameters():  # tied parameters once
        start, rows, shape = local_rows(p)
        stats.model_bytes += p.numel() * p.element_size()
        stats.parameters += 1
        block = read(name, start, start + rows)  # also for no rows: a preset's init must still draw them
        if tuple(block.shape) != shape:
            raise ModelError(f"'{name}': read a block of shape {tuple(block.shape)} for a local part of {shape}")
        local = _local(p)
        local.copy_(block)
        stats.staged(block)
        stats.local_bytes += local.numel() * local.element_size()
    reset_buffers(model)
    return stats


def reset_buffers(model: torch.nn.Module) -> None:
    """The buffers a meta build leaves empty, recomputed as the model's own init computes them (rotary tables)."""
    for module, fn in _init_order(model):
        owner = fn.__self__
        if not any(True for _ in module.buffers(recurse=False)):
            continue
        if "RotaryEmbedding" in type(module).__name__:
            owner._init_weights(module)  # its rotary branch: computed from the config, no random draw
            continue
        names = [n for n, _ in module.named_buffers(recurse=False)]
        raise ModelError(f"{type(module).__name__} has buffers {names} that a meta-device build cannot recompute")


# -- checkpoints ------------------------------------------------------------------------------------------------


def weight_map(path: Path) -> dict[str, Path]:
    """Every tensor name of a checkpoint directory -> the safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {k: path / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise ModelError(f"checkpoint '{path}' has no model.safetensors (or its index): only safetensors load sharded")
    with safe_open(str(single), "pt") as f:
        return {k: single for k in f.keys()}


class CheckpointReader:
    """`Reader` over a checkpoint's safetensors files: each call reads only the asked rows of the tensors it needs
    (memory-mapped files, one handle per file, closed by `close`)."""

    def __init__(self, path: Path):
        self.files = weight_map(Path(path))
        self._stack = ExitStack()
        self._open: dict[Path, object] = {}

    def _slice(self, key: str):
        file = self.files[key]
        if file not in self._open:
            self._open[file] = self._stack.enter_context(safe_open(str(file), "pt"))
        return self._open[file].get_slice(key)

    def saved(self, name: str) -> tuple[torch.dtype, tuple[int, ...]] | None:
        """The dtype and whole shape parameter `name` has in the checkpoint (its experts stacked for a fused one);
        None when the checkpoint holds no tensor for it."""
        if name in self.files:
            block = self._slice(name)
            return _DTYPES[block.get_dtype()], tuple(block.get_shape())
        fused = _FUSED_EXPERTS.match(name)
        if not fused or f"{fused['prefix']}.0.down_proj.weight" not in self.files:
            return None
        prefix, experts = fused["prefix"], 0
        while f"{prefix}.{experts}.down_proj.weight" in self.files:
            experts += 1
        which = ("gate", "up") if fused["which"] == "gate_up_proj" else ("down",)
        shapes = [tuple(self._slice(f"{prefix}.0.{w}_proj.weight").get_shape()) for w in which]
        dtype = _DTYPES[self._slice(f"{prefix}.0.{which[0]}_proj.weight").get_dtype()]
        return dtype, (experts, sum(sh[0] for sh in shapes), *shapes[0][1:])

    def __call__(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name in self.files:
            return self._slice(name)[start:stop]
        fused = _FUSED_EXPERTS.match(name)
        if fused and f"{fused['prefix']}.0.down_proj.weight" in self.files:
            prefix = fused["prefix"]
            if fused["which"] == "down_proj":
                return torch.stack([self._slice(f"{prefix}.{e}.down_proj.weight")[:] for e in range(start, stop)])
            return torch.stack(
                [
                    torch.cat([self._slice(f"{prefix}.{e}.{w}_proj.weight")[:] for w in ("gate", "up")])
                    for e in range(start, stop)
                ]
            )
        raise ModelError(f"checkpoint has no tensor for parameter '{name}' (nor per-expert tensors for it)")

    def close(self) -> None:
        self._stack.close()


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class Overlay:
    """`Reader` for a meta-built model some of whose parameters got their values before the fill (a LoRA adapter,
    drawn on the host by peft over the meta base): those, in `given` (name -> the whole tensor), handed out row by
    row from it; every other one read from `base` under `rename(name)`, its name in the model before it was
    wrapped. The fill then writes them all alike, each rank its own shard."""

    def __init__(self, base, given: dict[str, torch.Tensor], rename: Callable[[str], str]):
        self.base, self.given, self.rename = base, given, rename

    @property
    def held_bytes(self) -> int:
        return getattr(self.base, "held_bytes", 0)

    def __call__(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name in self.given:
            t = self.given[name]
            return t[start:stop] if t.dim() else t
        return self.base(self.rename(name), start, stop)

    def close(self) -> None:
        self.base.close()


# -- presets ----------------------------------------------------------------------------------------------------


def _init_order(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, Callable]]:
    """(module, the init function transformers applies to it), in the order of `PreTrainedModel.initialize_weights`:
    children before their parent, a nested PreTrainedModel with its own `_initialize_weights`."""

    def walk(module, fn):
        for child in module.children():
            yield from walk(child, child._initialize_weights if isinstance(child, transformers.PreTrainedModel) else fn)
        yield module, fn

    yield from walk(model, model._initialize_weights)


class PresetReader:
    """`Reader` for a preset: the seeded fp32 init of `models.loading` (torch.manual_seed(seed), then transformers'
    `initialize_weights` on a model built on the meta device), replayed block by block. A block is a decoder layer or
    another direct child of a PreTrainedModel (embeddings, norm, head): an init may set its children's parameters
    (an MoE block draws its router's weight), so a block's parameters are made real on the host before the first init
    inside it and handed out once its own init has run. The values are those of `initialize_weights` on the whole
    model: the same function, order and random draws. Reads ask for a parameter by name, once each; the most this
    holds at once is about one block (`held_bytes`)."""

    def __init__(self, config, seed: int):
        self.model = skeleton(config)
        self._order = _init_order(self.model)
        self._ready: dict[str, torch.Tensor] = {}
        self._names = {id(p): n for n, p in self.model.named_parameters()}
        self._real: dict[str, tuple[torch.nn.Module, str, torch.nn.Parameter]] = {}  # made real, not handed out
        self._done: set[str] = set()  # made real once already
        self._blocks = {
            id(child)
            for parent in self.model.modules()
            if isinstance(parent, (torch.nn.ModuleList, transformers.PreTrainedModel))
            for child in parent.children()
            if not isinstance(child, (torch.nn.ModuleList, transformers.PreTrainedModel))
        }
        self._block_of: dict[int, torch.nn.Module] = {}  # a module below a block -> that block
        for module in self.model.modules():
            if id(module) in self._blocks:
                self._block_of.update((id(m), module) for m in module.modules() if m is not module)
        self._rng = torch.random.fork_rng(devices=[])
        self._rng.__enter__()
        torch.manual_seed(seed)
        from transformers import initialization as init

        self._guard = init.guard_torch_init_functions()
        self._guard.__enter__()
        self.held_bytes = 0  # the most bytes of generated tensors held at once

    def _make_real(self, module: torch.nn.Module, whole: bool) -> None:
        """`module`'s parameters (`whole`: its subtree's) real, NaN until an init writes them: a parameter no init
        touches is an error when read, never garbage. Each parameter once: one handed out stays handed out."""
        for owner in module.modules() if whole else [module]:
            for pname, p in list(owner._parameters.items()):
                name = self._names.get(id(p)) if p is not None else None
                if name is None or name in self._done:
                    continue
                real = torch.nn.Parameter(
                    torch.full(p.shape, float("nan"), dtype=p.dtype), requires_grad=p.requires_grad
                )
                if getattr(p, "_is_hf_initialized", False):
                    real._is_hf_initialized = True
                owner._parameters[pname] = real
                self._real[name] = (owner, pname, p)
                self._done.add(name)
            for bname, b in list(owner._buffers.items()):
                if b is not None and b.is_meta:
                    owner._buffers[bname] = torch.empty(b.shape, dtype=b.dtype)

    def _release(self) -> None:
        """Hand out every parameter made real so far (their block's init has run), the skeleton meta again."""
        for name, (owner, pname, meta) in self._real.items():
            self._ready[name] = owner._parameters[pname].data
            owner._parameters[pname] = meta
        self._real.clear()

    def _advance(self) -> None:
        module, fn = next(self._order)
        block = self._block_of.get(id(module), module if id(module) in self._blocks else None)
        # a block whole before the first init inside it; a module above the blocks (a PreTrainedModel, a ModuleList)
        # sets its own parameters only
        self._make_real(block or module, whole=block is not None)
        with torch.no_grad():
            fn(module, False)
        if id(module) not in self._block_of:  # a block (or above it): its init was the last to touch it
            self._release()
        self.held_bytes = max(self.held_bytes, sum(t.numel() * t.element_size() for t in self._ready.values()))

    def __call__(self, name: str, start: int, stop: int) -> torch.Tensor:
        while name not in self._ready:
            try:
                self._advance()
            except StopIteration:
                raise ModelError(f"preset init never reached parameter '{name}'") from None
        t = self._ready.pop(name)  # each parameter is read once per rank
        if t.is_floating_point() and bool(t.isnan().any()):
            raise ModelError(f"the preset's init left parameter '{name}' unset (transformers' _init_weights skips it)")
        return t[start:stop] if t.dim() else t

    def close(self) -> None:
        for _ in self._order:  # the init of the rest (no parameters left), then the RNG as it was
            pass
        self._guard.__exit__(None, None, None)
        self._rng.__exit__(None, None, None)
