"""`engines.wrap` under FSDP2 with layer or group units chains explicit prefetches: the root's forward issues the
first unit's all-gather, each unit's forward the next one's (so it runs while the unit before computes), and each
unit's backward the previous one's. Checked in one process over a gloo group of one rank (`fully_shard` works on a
mesh of one), with the step still computing what the unwrapped model computes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridtune.data import PackedCollator
from hybridtune.data.packing import Example
from hybridtune.models.anatomy import decoder_layers
from hybridtune.models.loading import load_model
from hybridtune.runtime import distributed, engines
from hybridtune.train.objectives import SFT

CPU = torch.device("cpu")
# Dist.world only says whether to wrap (and what to log); the process group below has one rank.
FSDP = distributed.Dist(rank=0, world=2, engine="fsdp")


@pytest.fixture
def one_rank_group(tmp_path):
    dist = torch.distributed
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _state(module):
    return module._get_fsdp_state()


@pytest.mark.parametrize("units,sizes", [("group:2", [2, 2]), ("group:3", [3, 1]), ("layer", [1, 1, 1, 1])])
def test_each_unit_prefetches_the_next_in_forward_and_the_previous_in_backward(one_rank_group, units, sizes):
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    plain = load_model("tiny-qwen3_5", seed=3).model
    model = load_model("tiny-qwen3_5", seed=3).model
    layers = decoder_layers(model)
    assert len(layers) == sum(sizes) == 4
    engine = engines.wrap(
        distributed.LossModule(model, SFT(fused=True)), dataclasses.replace(FSDP, units=units), CPU, False
    )
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    heads = [layers[s] for s in starts]  # the first layer of each unit: a group's layers share one FSDP2 state
    assert all(_state(layer) is _state(layers[s]) for s, n in zip(starts, sizes) for layer in layers[s : s + n])
    units_ = [_state(h) for h in heads]
    assert _state(engine)._states_to_forward_prefetch == units_[:1]
    assert [_state(h)._states_to_forward_prefetch for h in heads] == [[u] for u in units_[1:]] + [[]]
    assert _state(engine)._states_to_backward_prefetch == units_[-1:]
    assert [_state(h)._states_to_backward_prefetch for h in heads] == [[]] + [[u] for u in units_[:-1]]

    # In the forward, unit u's all-gather is issued before unit u-1's first layer computes.
    index = {id(g): i for i, s in enumerate(units_) for g in s._fsdp_param_groups}
    events: list[tuple[str, int]] = []
    unshard = FSDPParamGroup.unshard

    def spy(self, async_op=False):
        if self._all_gather_result is None and not self.is_unsharded and id(self) in index:
            events.append(("gather", index[id(self)]))
        return unshard(self, async_op)

    for i, h in enumerate(heads):
        h.register_forward_pre_hook(lambda *_, i=i: events.append(("forward", i)))  # after FSDP2's own pre-hook
    batch = PackedCollator()([Example(list(range(5, 5 + n)), [1] * n) for n in (40, 23, 9)])
    FSDPParamGroup.unshard = spy
    try:
        loss = engine(batch, 72)
    finally:
        FSDPParamGroup.unshard = unshard
    forward = [e for e in events if e[0] == "forward"]
    assert [i for _, i in forward] == list(range(len(heads)))
    for u in range(1, len(heads)):
        assert events.index(("gather", u)) < events.index(("forward", u - 1)), events

    loss.backward()
    from hybridtune.train.objectives.sft import sft_loss

    want = sft_loss(plain, batch, 72, True)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    got = {n.removeprefix("model."): p.grad.full_tensor() for n, p in engine.named_parameters()}
    for n, p in plain.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=1e-5, atol=1e-7), n


def test_the_whole_model_unit_prefetches_nothing(one_rank_group):
    model = load_model("tiny-qwen3_5", seed=3).model
    engine = engines.wrap(
        distributed.LossModule(model, SFT(fused=True)), dataclasses.replace(FSDP, units="model"), CPU, False
    )
    assert _state(engine)._states_to_forward_prefetch == [] and _state(engine)._states_to_backward_prefetch == []
