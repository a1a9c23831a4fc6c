"""The batch stream: the order in which the training bins are visited, its saved position, and the move of a
collated batch to the device."""

from __future__ import annotations

import math
import random

import torch

from hybridtune.data.packing import Example


class BatchStream:
    """Deterministic stream of micro-batches over epochs; its position is saved in checkpoints.

    Epoch e visits the bins in a permutation seeded by (seed, e); a micro-batch is `micro_batch_size`
    consecutive bins of that order laid end to end.

    >>> s = BatchStream([[Example([1], [1])], [Example([2], [1])], [Example([3], [1])]], 2, seed=0)
    >>> first = s.next_docs(); pos = s.position(); second = s.next_docs()
    >>> s.seek(pos); s.next_docs() == second
    True
    """

    def __init__(self, bins: list[list[Example]], micro_batch_size: int, seed: int):
        self.bins, self.mbs, self.seed = bins, micro_batch_size, seed
        self.epoch, self.index = 0, 0
        self._order = self._perm(0)

    def _perm(self, epoch: int) -> list[int]:
        order = list(range(len(self.bins)))
        random.Random(self.seed * 1000003 + epoch).shuffle(order)
        return order

    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def seek(self, pos: dict) -> None:
        self.epoch, self.index = pos["epoch"], pos["index"]
        self._order = self._perm(self.epoch)

    def next_docs(self) -> list[Example]:
        docs: list[Example] = []
        for _ in range(self.mbs):
            if self.index >= len(self._order):
                self.epoch += 1
                self.index = 0
                self._order = self._perm(self.epoch)
            docs.extend(self.bins[self._order[self.index]])
            self.index += 1
        return docs

    def micro_batches_per_epoch(self) -> int:
        return math.ceil(len(self.bins) / self.mbs)


def to_device(batch: dict, device: torch.device) -> dict:
    """The batch's tensors on `device`. For a GPU they are pinned first: a copy from pageable host memory waits
    for the stream to drain, one from pinned memory is queued behind the work already launched."""
    pin = device.type == "cuda"
    return {
        k: (
            (v.pin_memory() if pin and v.device.type == "cpu" else v).to(device, non_blocking=True)
            if torch.is_tensor(v)
            else v
        )
        for k, v in batch.items()
    }
