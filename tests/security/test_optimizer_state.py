"""A resumed optimizer state that is not what this run's optimizer holds (runtime/masters.py's `MasterAdamW`): a
checkpoint without the fp32 master (another optim or precision wrote it), a master of another shape (torch's
`copy_` broadcast a one-value tensor over the whole weight), a non-float moment, NaN or a negative second moment.
Each was loaded silently (a missing master resumed from this run's initial weights over the checkpoint's); each is
now one ModelError line (exit 2), and nothing is copied before every tensor is checked."""

from __future__ import annotations

import copy

import pytest
import torch

from hybridtune.errors import ModelError
from hybridtune.runtime.masters import MASTER, MasterAdamW, split


def _opt(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    split(model)
    return model, MasterAdamW(list(model.parameters()), lr=1e-2, weight_decay=0.0)


def _saved():
    model, opt = _opt(0)
    for _ in range(2):
        model(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
        opt.zero_grad()
    return copy.deepcopy(opt.state_dict())


CASES = {
    "missing master": (lambda s: s[0].pop(MASTER), r"has no 'master'"),
    "one-value master": (lambda s: s[0].__setitem__(MASTER, torch.zeros(1)), r"'master' is torch.float32 \(1,\)"),
    "master of another shape": (lambda s: s[0].__setitem__(MASTER, torch.zeros(4, 3)), r"\(4, 3\), this optim"),
    "integer moment": (lambda s: s[1].__setitem__("exp_avg", torch.zeros(3, dtype=torch.int64)), r"torch.int64"),
    "NaN master": (lambda s: s[1][MASTER].fill_(float("nan")), r"'master' holds NaN"),
    "negative second moment": (lambda s: s[0]["exp_avg_sq"].fill_(-1.0), r"'exp_avg_sq' holds a negative value"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_tampered_state_is_one_line_and_nothing_is_loaded(case):
    tamper, pattern = CASES[case]
    saved = _saved()
    tamper(saved["state"])
    model, opt = _opt(1)
    before = [t.clone() for p in model.parameters() for t in (p.detach(), *opt.state[p].values())]
    with pytest.raises(ModelError, match=r"^the checkpoint's optimizer state of parameter [01]") as e:
        opt.load_state_dict(saved)
    assert pattern and __import__("re").search(pattern, str(e.value)) and "\n" not in str(e.value)
    after = [t for p in model.parameters() for t in (p.detach(), *opt.state[p].values())]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # nothing half-loaded


def test_an_intact_state_still_loads_exactly():
    saved = _saved()
    model, opt = _opt(1)
    opt.load_state_dict(saved)
    for p, k in zip(model.parameters(), (0, 1)):
        assert torch.equal(opt.state[p][MASTER], saved["state"][k][MASTER])
        assert torch.equal(p.detach(), saved["state"][k][MASTER].to(torch.bfloat16))
