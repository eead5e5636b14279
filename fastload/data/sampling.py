"""Samplers that tag each index with its epoch and can resume mid-epoch."""

from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler


class EpochSampler(torch.utils.data.Sampler):
    """DistributedSampler (shuffled per epoch from the seed, split across ranks) yielding
    `(epoch, index)`; `set_epoch` must be called every epoch (pytorch#31771) and
    `skip(n)` drops this rank's first n samples of the epoch (resume mid-epoch)."""

    def __init__(self, length: int, *, rank: int, world_size: int, shuffle: bool, seed: int):
        self.inner = DistributedSampler(
            range(length), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed
        )
        self.epoch = 0
        self.skipped = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.epoch = epoch
        self.skipped = skip
        self.inner.set_epoch(epoch)

    def __iter__(self):
        indices = list(self.inner)[self.skipped :]
        return iter([(self.epoch, i) for i in indices])

    def __len__(self) -> int:
        return len(self.inner) - self.skipped


class ShardSampler(torch.utils.data.Sampler):
    """Evaluation: rank r takes indices r, r+W, r+2W, ... with no padding, so metrics summed
    across ranks count every sample exactly once."""

    def __init__(self, length: int, *, rank: int, world_size: int):
        self.indices = range(rank, length, world_size)

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        pass

    def __iter__(self):
        return ((0, i) for i in self.indices)

    def __len__(self) -> int:
        return len(self.indices)
