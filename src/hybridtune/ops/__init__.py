"""Shared custom ops that belong to no mixer (`loss.py`: the chunked cross-entropy).

A mixer's own custom ops (`torch.ops.hybridtune.*`, with their backward ops and pure-torch references) live in its
folder, `mixers/<kind>/`, and register when imported. This package imports nothing else of hybridtune.
"""
