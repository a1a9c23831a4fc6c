"""Module compiler: standalone per-class forwards for any transformers family.

- `resolve_method(cls, name="forward")`: the function written in `cls`, found behind any stack of
  decorators (`introspect.py`).
- `standalone_source(cls)`: the generated module text for one class (`standalone.py`).
- `plan_model(model)`: compile / eager / routed / left per class, with the reason (`plan.py`).
- `compile_model(model, strategy)`: "loop", "modules" or "off" (`strategies.py`).

Inside: `decoration.py` (the plan's choice per class and the generation errors), `source.py` (a method's
def in its file), `analyze.py` + `plan.py` (the decision), `standalone.py` (the text), `loader.py`
(execute, check against the originals, cache), `diskload.py` (dumps), `loop.py`, `strategies.py`,
`sweep.py`, `command.py` (`hybridtune compile`).
"""

from __future__ import annotations

from hybridtune.compiler.introspect import resolve_method
from hybridtune.compiler.modules.plan import plan_model
from hybridtune.compiler.modules.standalone import standalone_source

__all__ = ["resolve_method", "standalone_source", "plan_model", "compile_model"]


def __getattr__(name: str):
    if name == "compile_model":
        # why lazy: strategies imports torch and the patched models; `import hybridtune.compiler` stays cheap.
        from hybridtune.compiler.strategies import compile_model

        return compile_model
    raise AttributeError(f"module 'hybridtune.compiler' has no attribute {name!r}")
