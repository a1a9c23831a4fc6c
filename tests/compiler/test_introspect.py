"""resolve_method: the premise, the decorated case, and every case where it must change nothing."""

from __future__ import annotations

import inspect

import pytest

from hybridtune.compiler import resolve_method
from hybridtune.compiler.introspect import definition, is_decorated

pytestmark = pytest.mark.transformers_compat  # reads transformers' code: run again under another release (CI)


def test_premise_the_attribute_is_the_wrapper(fake):
    # What broke other compilers: name, signature and source are the decorator's.
    attr = fake.FakeMixer.forward
    assert attr.__name__ == "wrapped"
    assert not hasattr(attr, "__wrapped__")
    assert str(inspect.signature(attr)) == "(self, *args, **kwargs)"
    assert "def wrapped(self, *args, **kwargs)" in inspect.getsource(attr)
    assert attr.__code__.co_freevars == ("child_module_name", "forward_func")


def test_resolves_the_real_method_behind_the_bare_closure(fake):
    real = resolve_method(fake.FakeMixer)
    assert real is not fake.FakeMixer.forward
    assert real.__qualname__ == "FakeMixer.forward"
    assert list(inspect.signature(real).parameters) == [
        "self",
        "hidden_states",
        "cache_params",
        "attention_mask",
        "kwargs",
    ]
    assert "opaque_kernel(mixed)" in inspect.getsource(real)
    assert is_decorated(fake.FakeMixer)


def test_plain_method_returns_at_once(fake):
    assert resolve_method(fake.PlainMLP) is fake.PlainMLP.__dict__["forward"]
    assert not is_decorated(fake.PlainMLP)


def test_functools_wraps_returns_the_attribute_at_once(fake):
    attr = fake.WrapsDecorated.__dict__["forward"]
    assert resolve_method(fake.WrapsDecorated) is attr  # wraps copied the qualname: it belongs
    # The def itself is behind __wrapped__, and `definition` finds it for source reading.
    assert definition(fake.WrapsDecorated) is attr.__wrapped__
    assert is_decorated(fake.WrapsDecorated)


def test_inherited_is_unchanged(fake):
    assert resolve_method(fake.Inherited) is fake.PlainMLP.forward
    # An inherited decorated forward is not unwrapped either: it does not belong to the subclass.
    assert resolve_method(fake.InheritsDecorated) is fake.FakeMixer.forward
    assert resolve_method(fake.InheritsDecorated).__name__ == "wrapped"


def test_ambiguous_closure_is_unchanged(fake):
    attr = fake.Ambiguous.__dict__["forward"]
    assert resolve_method(fake.Ambiguous) is attr
    assert definition(fake.Ambiguous) is None


def test_function_of_another_class_is_unchanged(fake):
    attr = fake.Foreign.__dict__["forward"]
    assert resolve_method(fake.Foreign) is attr
    assert definition(fake.Foreign) is None


def test_non_function_attribute_is_unchanged(fake):
    attr = fake.NonFunction.__dict__["forward"]
    assert resolve_method(fake.NonFunction) is attr
    assert definition(fake.NonFunction) is None


def test_stacked_bare_decorators_depth_1_2_3(fake):
    for depth, cls in enumerate([fake.Depth1, fake.Depth2, fake.Depth3], start=1):
        real = resolve_method(cls)
        assert real.__qualname__ == f"{cls.__name__}.forward"
        assert real is not cls.__dict__["forward"]
        assert f"return self.lin(x) + {depth}" in inspect.getsource(real)
