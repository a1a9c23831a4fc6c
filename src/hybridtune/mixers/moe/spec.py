"""The routed MoE experts' registry entry (`SPEC`). They replace an MLP, not a sequence mixer: no layer type, no
batch metadata, no kept core; their routing (grouped GEMMs through transformers' experts interface, experts.py)
is model-wide, set by models/patching.py, and their FLOPs are the MLP's (models/flops.py)."""

from __future__ import annotations

from hybridtune.mixers.registry import MixerSpec

SPEC = MixerSpec(kind="moe")
