"""Fixtures: a fake modeling module, written to disk and imported by name."""

from __future__ import annotations

import importlib.util
import itertools
import sys

import pytest

# Source of a fake modeling module, written to disk by the tests so `inspect` and `linecache` read it.
#
# `bare_hooks` mirrors transformers 5.13-5.15 `force_accelerate_hooks` (integrations/accelerate.py):
# a decorator factory whose inner `wrapped(self, *args, **kwargs)` is a bare closure, no
# `functools.wraps`, holding the child module's name and the forward it wraps. It also counts calls so
# a test can see the decorator fire exactly once per forward.
SOURCE = '''
import functools

import torch
from torch import nn

CALLS = []


def bare_hooks(child_module_name):
    def decorator(forward_func):
        def wrapped(self, *args, **kwargs):
            hooked_module = getattr(self, child_module_name)
            hook = getattr(hooked_module, "_hf_hook", None)
            if hook is not None:
                hook.pre_forward(hooked_module)
            CALLS.append(child_module_name)
            output = forward_func(self, *args, **kwargs)
            if hook is not None:
                hook.post_forward(hooked_module, ())
            return output

        return wrapped

    return decorator


def wraps_deco(func):
    @functools.wraps(func)
    def wrapper(self, *args, **kwargs):
        return func(self, *args, **kwargs)

    return wrapper


def helper(x):
    return x + 1


def two_functions(func):
    # The closure holds two functions: which one is the method cannot be told for certain.
    post = helper

    def wrapped(self, *args, **kwargs):
        return post(func(self, *args, **kwargs))

    return wrapped


@torch.compiler.disable
def opaque_kernel(x):
    # Like FLA's public ops: torch.compiler.disable keeps it out of graphs.
    return x * torch.sigmoid(x)


class FakeMixer(nn.Module):
    """The decorated mixer: its forward is hidden behind the bare closure."""

    def __init__(self, dim=8):
        super().__init__()
        self.conv1d = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    @bare_hooks("conv1d")
    def forward(
        self,
        hidden_states: torch.Tensor,
        cache_params=None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ):
        # The real body: names that exist only here, never in the decorator.
        mixed = self.conv1d(hidden_states)
        mixed = opaque_kernel(mixed)
        if attention_mask is not None:
            mixed = mixed * attention_mask[..., None]
        return self.out_proj(mixed)


class PlainMLP(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        # An undecorated forward: generated exactly as written.
        return self.down(torch.nn.functional.silu(self.up(x)))


class FakeModel(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.mixer = FakeMixer(dim)
        self.mlp = PlainMLP(dim)

    def forward(self, hidden_states, attention_mask=None):
        hidden_states = hidden_states + self.mixer(hidden_states, attention_mask=attention_mask)
        return hidden_states + self.mlp(hidden_states)


class WrapsDecorated(nn.Module):
    @wraps_deco
    def forward(self, x):
        return x * 2


class Inherited(PlainMLP):
    pass


class InheritsDecorated(FakeMixer):
    pass


class Ambiguous(nn.Module):
    @two_functions
    def forward(self, x):
        return x * 3


class Other(nn.Module):
    def forward(self, x):
        return x - 1


def use_other(func):
    other = Other.forward

    def wrapped(self, *args, **kwargs):
        return other(self, *args, **kwargs)

    return wrapped


class Foreign(nn.Module):
    @use_other
    def forward(self, x):
        return x * 5


class CallableObject:
    def __call__(self, module, x):
        return x


class NonFunction(nn.Module):
    forward = CallableObject()


class Depth1(nn.Module):
    @bare_hooks("lin")
    def forward(self, x):
        return self.lin(x) + 1

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)


class Depth2(nn.Module):
    @bare_hooks("lin")
    @bare_hooks("lin")
    def forward(self, x):
        return self.lin(x) + 2

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)


class Depth3(nn.Module):
    @bare_hooks("lin")
    @bare_hooks("lin")
    @bare_hooks("lin")
    def forward(self, x):
        return self.lin(x) + 3

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)


class UsesSuper(PlainMLP):
    def forward(self, x):
        return super().forward(x) * 2


class Raises(nn.Module):
    def forward(self, x):
        raise ValueError("raised from the generated body")
'''

_counter = itertools.count()


@pytest.fixture
def fake(tmp_path):
    """A freshly imported fake modeling module (its own name, its own file under tmp_path)."""
    name = f"hybridtune_fake_modeling_{next(_counter)}"
    path = tmp_path / f"{name}.py"
    path.write_text(SOURCE)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(name, None)
