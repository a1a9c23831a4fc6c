"""Trace each region body once, not once per layer: torch's input-mutation check on `invoke_subgraph`, memoised.

Under autograd every `invoke_subgraph` call (one per decoder layer of the regional loop) asks
`InvokeSubgraphHOP.gen_schema` whether the body mutates its inputs, and `gen_schema` re-traces the whole body,
uncached, in each of AOT autograd's passes. `memoize()` keeps each schema per compile (`TracingContext`), keyed by
dynamo's body identifier, the kind of subgraph object, grad mode, and every operand's type, shape, stride, dtype,
device and requires_grad: the check still runs once per distinct body and operand layout, and a body that mutates an
input is refused as before. Installed by `compiler.loop.compile_loop` for a regional loop, on the torch releases of
TESTED_TORCH; elsewhere, or on a torch without this method, torch's own check runs (the log says which).
"""

from __future__ import annotations

import functools
import importlib
import logging
import weakref
from typing import Any

import torch

logger = logging.getLogger(__name__)

_MODULE = "torch._higher_order_ops.invoke_subgraph"
# The torch releases whose gen_schema and its callers this was read against and tested with (2.11 on the H200,
# 2.13 here); another release keeps torch's own check until it is read again.
TESTED_TORCH = ("2.11", "2.12", "2.13")
_MARK = "_hybridtune_memoized"
# One table per compile: dropped with its TracingContext.
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def operand_key(o: Any) -> tuple:
    """What of an operand a body's schema can depend on."""
    if isinstance(o, torch.Tensor):
        return (type(o).__name__, tuple(map(str, o.shape)), tuple(map(str, o.stride())), o.dtype, str(o.device),
                o.requires_grad)  # fmt: skip
    if isinstance(o, (int, float, bool, str, torch.SymInt, torch.SymFloat, torch.SymBool)) or o is None:
        return (type(o).__name__, str(o))
    return (type(o).__name__, id(o))  # anything else: only the very same object matches


def memoize() -> str:
    """Memoise `InvokeSubgraphHOP.gen_schema` per compile (idempotent); returns what was done, for the log."""
    release = ".".join(torch.__version__.split(".")[:2])
    if release not in TESTED_TORCH:
        return f"region schemas: not memoised (torch {torch.__version__} untested; each layer's body is re-traced)"
    try:
        hop = importlib.import_module(_MODULE).InvokeSubgraphHOP
    except (ImportError, AttributeError):
        return "region schemas: this torch has no InvokeSubgraphHOP; nothing to memoise"
    original = getattr(hop, "gen_schema", None)
    if original is None:
        return "region schemas: this torch's InvokeSubgraphHOP has no gen_schema; nothing to memoise"
    if getattr(original, _MARK, False):
        return "region schemas: memoised per compile (already)"

    @functools.wraps(original)
    def gen_schema(self, subgraph, identifier, *operands):
        ctx = torch._guards.TracingContext.try_get()
        if ctx is None or identifier is None:
            return original(self, subgraph, identifier, *operands)
        table = _TABLES.setdefault(ctx, {})
        key = (identifier, type(subgraph).__name__, torch.is_grad_enabled(), tuple(map(operand_key, operands)))
        if key not in table:
            table[key] = original(self, subgraph, identifier, *operands)
        return table[key]

    setattr(gen_schema, _MARK, True)
    gen_schema.__wrapped_original__ = original  # for tests and for undoing
    hop.gen_schema = gen_schema
    return "region schemas: memoised per compile (each region body traced once for torch's mutation check)"


def undo() -> None:
    """Put torch's own `gen_schema` back (tests)."""
    hop = importlib.import_module(_MODULE).InvokeSubgraphHOP
    original = getattr(hop.gen_schema, "__wrapped_original__", None)
    if original is not None:
        hop.gen_schema = original
