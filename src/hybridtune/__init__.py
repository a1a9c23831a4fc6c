"""hybridtune: fast, correct fine-tuning of hybrid linear-attention LLMs.

Public entry points (see docs/ARCHITECTURE.md):

- `hybridtune.patch_model(model) -> PatchReport`
- `hybridtune.compile_model(model, strategy="loop" | "modules" | "off")`
- `hybridtune.data.PackedCollator`, `hybridtune.data.pack`
- `hybridtune.compiler.resolve_method`, `hybridtune.compiler.standalone_source`
- `hybridtune.kernels.needs`, `hybridtune.kernels.report`

Imports are lazy so that `import hybridtune` stays cheap (no torch/transformers import).
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "patch_model", "compile_model"]


def __getattr__(name: str):
    # why lazy: `import hybridtune` stays cheap (no torch or transformers until one of these is asked for)
    if name == "patch_model":
        from hybridtune.models.patching import patch_model

        return patch_model
    if name == "compile_model":
        from hybridtune.compiler.strategies import compile_model

        return compile_model
    raise AttributeError(f"module 'hybridtune' has no attribute {name!r}")
