"""Module compiler: standalone per-class forwards for any transformers family.

- `resolve_method(cls, name="forward")`: the function written in `cls`, found behind any stack of
  decorators (`introspect.py`).
- `standalone_source(cls)`: the generated module text for one class (`standalone.py`).
- `plan_model(model)`: compile / eager / routed / left per class, with the reason (`plan.py`).
- `compile_model(model, strategy)`: "loop", "modules" or "off" (`strategies.py`).

Imports of torch-heavy parts are lazy so `import hybridtune.compiler` stays cheap.
"""

from __future__ import annotations

from hybridtune.compiler.introspect import resolve_method

__all__ = ["resolve_method", "standalone_source", "plan_model", "compile_model"]


def __getattr__(name: str):
    if name == "standalone_source":
        from hybridtune.compiler.standalone import standalone_source

        return standalone_source
    if name == "plan_model":
        from hybridtune.compiler.plan import plan_model

        return plan_model
    if name == "compile_model":
        from hybridtune.compiler.strategies import compile_model

        return compile_model
    raise AttributeError(f"module 'hybridtune.compiler' has no attribute {name!r}")
