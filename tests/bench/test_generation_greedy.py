"""The generation bench's greedy check (bench/generation.py `greedy_agreement`): on the CPU the rollout decoder and
transformers' `generate` agree token for token on left-padded prompts of different lengths, and a decoder that goes
wrong at some token is reported row by row at that token, not averaged away."""

from __future__ import annotations

import pytest
import torch

from hybridtune.bench import generation
from hybridtune.config import load_config
from hybridtune.models.hub import resolve_source
from hybridtune.models.loading import tokenizer_for
from hybridtune.runtime import rollout
from hybridtune.runtime.model import build_model


@pytest.fixture(scope="module")
def model():
    cfg = load_config(None, {"base_model": "tiny-qwen3_5", "adapter": "full", "seed": 3})
    torch.manual_seed(3)
    m = build_model(cfg, resolve_source("tiny-qwen3_5"), tokenizer_for("tiny-qwen3_5"), torch.device("cpu"), bf16=False)
    return m.model.eval()


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 400, (int(torch.randint(3, 14, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def test_greedy_check_finds_the_two_decoders_equal(model):
    rows = prompts(3, seed=11)
    assert len(set(map(len, rows))) > 1  # left padding is exercised
    got = generation.greedy_agreement(model, rows, 9, pad=0, device=torch.device("cpu"))
    assert got == {"rows": 3, "tokens": 9, "equal": 3, "first_difference": [None, None, None]}


def test_greedy_check_says_where_a_row_differs(model, monkeypatch):
    real = rollout.sample_rows

    def off_at_five(m, ps, gens, n, stop, temperature, top_p, pad):  # row 1's sixth token replaced
        out = real(m, ps, gens, n, stop, temperature, top_p, pad)
        out[1].ids[5] = (out[1].ids[5] + 1) % 400
        return out

    monkeypatch.setattr(rollout, "sample_rows", off_at_five)
    got = generation.greedy_agreement(model, prompts(3, seed=11), 9, pad=0, device=torch.device("cpu"))
    assert got["equal"] == 2 and got["first_difference"] == [None, 5, None]
