"""The mixers, one folder each (`<kind>/spec.py` gives its `MixerSpec`), and their registry: `MIXERS`, `register`.
The rest of the package iterates the registry (mixers/registry.py) instead of naming a mixer."""

from hybridtune.mixers.attention.spec import SPEC as _attention
from hybridtune.mixers.gdn.spec import SPEC as _gdn
from hybridtune.mixers.registry import MIXERS, MixerSpec, register, unregister

for _spec in (_gdn, _attention):
    register(_spec, replace=True)

__all__ = ["MIXERS", "MixerSpec", "register", "unregister"]
