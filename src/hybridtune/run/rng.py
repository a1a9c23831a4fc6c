"""Each rank's random number generators as a checkpoint keeps them (`rng-<rank>.pt`): plain values and tensors only,
so that they load with `torch.load(weights_only=True)` (run/checkpoint.py writes and restores them)."""

from __future__ import annotations

import random

import torch


def rng_state() -> dict:
    """This process's RNG states: Python, torch CPU, and the CUDA generator of the device it trains on
    (one per rank, so a checkpoint restores on any number of visible GPUs). Plain values and tensors only,
    so that it loads with weights_only=True."""
    version, internal, gauss = random.getstate()
    state = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda_device"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda_device" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_device"], torch.cuda.current_device())
