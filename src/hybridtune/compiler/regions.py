"""The decoder layers inside the compiled loop: one traced body per distinct layer, and the routers' logits.

`install(text, regional=...)` gives every decoder layer of a text model, on the instance only (`Regions.undo()`
takes it back):

- `forward`: the layer's own forward (its class's, behind its decorators) run through a body function; with
  `regional` the body is a nested compile region (`torch.compiler.nested_compile_region`), traced once per distinct
  layer and stamped out for the others, its parameters lifted as the region's inputs;
- `_gradient_checkpointing_func`: non-reentrant `torch.utils.checkpoint` around the same body, inside a region of
  its own (the region sits outside the checkpoint).

With `Regions.record` on (an MoE model's load-balancing loss), the body runs the layer with stand-in selves (`_Via`)
on the path down to each router, keeps each router's output `index` (its logits, [T, E]) and returns them beside the
hidden states; the layer's forward appends them to `Regions.sink`, which the loop reads after the call.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from hybridtune.compiler.recompute import KEEPS, checkpoint_kwargs

ATTR = "_hybridtune_regions"


class _Via:
    """Stands in for `self` in a module's forward: the module's attributes, except the `children` given (name ->
    callable), which the forward then calls in place of those submodules."""

    def __init__(self, module, children):
        self._module = module
        self._children = children

    def __getattr__(self, name):
        child = self._children.get(name)
        return child if child is not None else getattr(self._module, name)


def _own_forward(module: torch.nn.Module):
    """The function behind `module.forward` (its class's, or one bound on the instance), or None where it is not a
    method of this module (a plain closure)."""
    f = module.forward
    if isinstance(f, types.MethodType) and f.__self__ is module:
        return f.__func__
    return None


def router_spec(text: torch.nn.Module) -> tuple[type, int] | None:
    """The router class and the output index transformers records as `router_logits` for this text model, or None
    where it records none."""
    spec = (getattr(type(text), "_can_record_outputs", None) or {}).get("router_logits")
    if spec is None:
        return None
    if isinstance(spec, type):
        return spec, 0
    cls = getattr(spec, "target_class", None)
    if not isinstance(cls, type) or getattr(spec, "layer_name", None) or getattr(spec, "class_name", None):
        return None
    return cls, int(getattr(spec, "index", 0) or 0)


def _router_tree(module: torch.nn.Module, router_cls: type):
    """The paths from `module` down to its routers: child name -> None at a router, else (the child's forward
    function, its own tree); {} without a router; False where a module on a path runs a forward that is not its
    own method (its routers cannot be reached)."""
    tree: dict = {}
    for name, child in module.named_children():
        if isinstance(child, router_cls):
            tree[name] = None
            continue
        sub = _router_tree(child, router_cls)
        if sub is False:
            return False
        if sub:
            fn = _own_forward(child)
            if fn is None:
                return False
            tree[name] = (fn, sub)
    return tree


def _recording_self(module, tree, index, sink):
    """A stand-in for `module` whose submodules on `tree` record their routers' output `index` into `sink`."""
    children = {}
    for name, node in tree.items():
        child = getattr(module, name)
        if node is None:
            children[name] = functools.partial(_record, child, index, sink)
        else:
            fn, sub = node
            children[name] = functools.partial(fn, _recording_self(child, sub, index, sink))
    return _Via(module, children)


def _record(router, index, sink, *args, **kwargs):
    out = router(*args, **kwargs)
    sink.append(out[index] if isinstance(out, (tuple, list)) else out)
    return out


def _bodies(fn, tree, index, regional: bool, keep_cores: bool = False):
    """[forward body, checkpointed body, recording forward body, recording checkpointed body] for layers whose
    forward is `fn` and whose routers sit at `tree` (the recording ones None without routers); `keep_cores`: the
    checkpoints keep the mixers' cores (compiler/recompute.py)."""
    ckpt = checkpoint_kwargs(keep_cores)

    def plain(layer, *args, **kwargs):
        return fn(layer, *args, **kwargs)

    def recording(layer, *args, **kwargs):
        sink: list = []
        out = fn(_recording_self(layer, tree, index, sink), *args, **kwargs)
        return out, tuple(sink)

    def checkpointed(body):
        def run(layer, *args, **kwargs):
            return checkpoint(functools.partial(body, layer, **kwargs), *args, **ckpt)

        return run

    made = [plain, checkpointed(plain)]
    made += [recording, checkpointed(recording)] if tree else [None, None]
    if regional:
        made = [torch.compiler.nested_compile_region(b) if b is not None else None for b in made]
    return made


@dataclass
class Regions:
    """What `install` put on the layers. `record`: the next calls return router logits into `sink`."""

    layers: list = field(default_factory=list)  # (layer, previous forward in its __dict__ or None, previous ckpt)
    regional: bool = True
    keep_cores: bool = False  # the checkpoints keep the mixers' cores (compiler/recompute.py)
    recordable: bool = False  # every MoE layer's routers can be recorded
    record: bool = False
    sink: list = field(default_factory=list)
    funcs: list = field(default_factory=list)  # each layer's checkpoint function as installed

    def keep_checkpointing(self) -> None:
        """Put back each layer's checkpoint function where something replaced it since `install` (transformers'
        `gradient_checkpointing_enable` after compiling: the out-of-memory retry of runtime/oom.py). A plain
        checkpoint around a recording body would write the router logits out from inside it, which dynamo refuses
        ("Unsafe side effect")."""
        for (layer, _, _), fn in zip(self.layers, self.funcs):
            if layer.__dict__.get("_gradient_checkpointing_func") is not fn:
                layer._gradient_checkpointing_func = fn

    def foreign_hooks(self) -> bool:
        """Whether a layer has forward hooks other than transformers' output-capturing ones (idle inside the
        compiled loop): a checkpointed layer's compiled body does not run its hooks, so the loop then runs upstream."""
        for layer, _, _ in self.layers:
            hooks = [*layer._forward_hooks.values(), *layer._forward_pre_hooks.values()]
            if any(getattr(h, "__name__", "") != "output_capturing_hook" for h in hooks):
                return True
        return False

    def take(self) -> tuple:
        """The router logits recorded since the last take, in layer order."""
        out = tuple(self.sink)
        self.sink.clear()
        return out

    def undo(self) -> None:
        for layer, fwd, ckpt in self.layers:
            layer.__dict__.pop("forward", None)
            if fwd is not None:
                layer.__dict__["forward"] = fwd
            if ckpt is None:
                layer.__dict__.pop("_gradient_checkpointing_func", None)
            else:
                layer._gradient_checkpointing_func = ckpt
        self.layers.clear()
        self.funcs.clear()
        self.sink.clear()


def _install_layer(regions: Regions, layer, bodies) -> None:
    plain, plain_ckpt, rec, rec_ckpt = bodies

    def emit(result):
        out, logits = result
        regions.sink.extend(logits)
        return out

    def forward(*args, **kwargs):
        if regions.record and rec is not None:
            return emit(rec(layer, *args, **kwargs))
        return plain(layer, *args, **kwargs)

    def checkpointed(fn, *args):
        # transformers passes functools.partial(super().__call__, **kwargs): the layer's __call__ (its hooks, then
        # `forward` above). Eagerly that runs as transformers runs it; compiled, the body runs directly (see
        # `Regions.foreign_hooks`), the layer being ours to name and the keyword arguments the partial's.
        if not torch.compiler.is_compiling():
            return checkpoint(fn, *args, **checkpoint_kwargs(regions.keep_cores))
        if regions.record and rec_ckpt is not None:
            return emit(rec_ckpt(layer, *args, **fn.keywords))
        return plain_ckpt(layer, *args, **fn.keywords)

    checkpointed.__dict__[ATTR] = regions  # tells the loop's checkpointing switch this one is non-reentrant already
    checkpointed.__dict__[KEEPS] = regions.keep_cores
    regions.layers.append((layer, layer.__dict__.get("forward"), layer.__dict__.get("_gradient_checkpointing_func")))
    layer.forward = forward
    layer._gradient_checkpointing_func = checkpointed
    regions.funcs.append(checkpointed)


def install(text: torch.nn.Module, regional: bool = True, keep_cores: bool = False) -> Regions | None:
    """Give the decoder layers of `text` their bodies (see the module docstring); None where a layer's forward is
    not its own method (another wrapper already replaced it): the loop then traces the layers as they are.
    `keep_cores`: their checkpoints keep the mixers' cores' outputs (compiler/recompute.py)."""
    spec = router_spec(text)
    layers = list(text.layers)
    fns = [_own_forward(layer) for layer in layers]
    if any(f is None for f in fns):
        return None
    regions = Regions(regional=regional, keep_cores=keep_cores, recordable=spec is not None)
    made: dict = {}
    for layer, fn in zip(layers, fns):
        tree = _router_tree(layer, spec[0]) if spec else {}
        if tree is False:
            regions.recordable, tree = False, {}
        key = (fn, _freeze(tree))
        if key not in made:
            made[key] = _bodies(fn, tree, spec[1] if spec else 0, regional, keep_cores)
        _install_layer(regions, layer, made[key])
    return regions


def _freeze(tree) -> Any:
    """A hashable form of a router tree."""
    if not tree:
        return None
    return tuple(sorted((k, None if v is None else (v[0], _freeze(v[1]))) for k, v in tree.items()))
