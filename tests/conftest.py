"""Shared test setup: `cuda` tests skip cleanly without a GPU; tests never reach a hub."""

from __future__ import annotations

import os

import pytest

# No test may download anything: models and tokenizers come from presets and the bundled files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Keep thread counts small and deterministic on the 2-core CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")  # tiny tensors: threads cost more than they save


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
