"""Samplers that tag each index with its epoch, resume mid-epoch, and plan several epochs.

Every key a dataset sees is `(epoch, index)`: the epoch reaches the worker with every sample,
even when workers persist across epochs (pytorch#62066), and each sample's augmentation is a
function of (seed, epoch, index) alone.

`EpochBatches` is the DataLoader's batch sampler: it yields the batches of a *plan* of epochs
back to back, so one DataLoader iterator can run from one epoch into the next and its workers
never stop at an epoch boundary (fastload/loaders/baseline.py). Each epoch's batches are
exactly those of a fresh per-epoch iteration (same permutation, same grouping, same
drop_last), so pipelining changes timing, never content.
"""

from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler


class EpochSampler(torch.utils.data.Sampler):
    """DistributedSampler (shuffled per epoch from the seed, split across ranks) yielding
    `(epoch, index)`; `set_epoch` must be called every epoch (pytorch#31771) and
    `skip(n)` drops this rank's first n samples of the epoch (resume mid-epoch)."""

    def __init__(self, length: int, *, rank: int, world_size: int, shuffle: bool, seed: int):
        self.length, self.rank, self.world_size = length, rank, world_size
        self.shuffle, self.seed = shuffle, seed
        self.inner = self._distributed()
        self.epoch = 0
        self.skipped = 0

    def _distributed(self) -> DistributedSampler:
        return DistributedSampler(
            range(self.length),
            num_replicas=self.world_size,
            rank=self.rank,
            shuffle=self.shuffle,
            seed=self.seed,
        )

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.epoch = epoch
        self.skipped = skip
        self.inner.set_epoch(epoch)

    def epoch_keys(self, epoch: int) -> list[tuple[int, int]]:
        """This rank's whole epoch `epoch`, whatever `set_epoch` says (for planned epochs)."""
        inner = self._distributed()
        inner.set_epoch(epoch)
        return [(epoch, i) for i in inner]

    def __iter__(self):
        indices = list(self.inner)[self.skipped :]
        return iter([(self.epoch, i) for i in indices])

    def __len__(self) -> int:
        return len(self.inner) - self.skipped


class ShardSampler(torch.utils.data.Sampler):
    """Evaluation: rank r takes indices r, r+W, r+2W, ... with no padding, so metrics summed
    across ranks count every sample exactly once. The same samples every pass."""

    def __init__(self, length: int, *, rank: int, world_size: int):
        self.indices = range(rank, length, world_size)

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        pass

    def epoch_keys(self, epoch: int) -> list[tuple[int, int]]:
        return [(0, i) for i in self.indices]

    def __iter__(self):
        return ((0, i) for i in self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def epoch_batch_count(samples: int, batch_size: int, drop_last: bool) -> int:
    return samples // batch_size if drop_last else -(-samples // batch_size)


class EpochBatches(torch.utils.data.Sampler):
    """Batch sampler over a plan of epochs: `plan` is a list of (epoch, skip_batches,
    n_batches); it yields epoch e's batches skip .. skip + n in order, then the next epoch's.
    Set `plan` before each DataLoader iterator is created (a persistent-worker iterator
    reads it again at every reset)."""

    def __init__(self, sampler, batch_size: int, drop_last: bool):
        self.sampler, self.batch_size, self.drop_last = sampler, int(batch_size), drop_last
        self.plan: list[tuple[int, int, int]] = []

    def epoch_batches(self) -> int:
        """Batches in one whole epoch."""
        return epoch_batch_count(len(self.sampler.epoch_keys(0)), self.batch_size, self.drop_last)

    def __iter__(self):
        bs = self.batch_size
        for epoch, skip, n in self.plan:
            keys = self.sampler.epoch_keys(epoch)
            total = epoch_batch_count(len(keys), bs, self.drop_last)
            for b in range(skip, min(total, skip + n)):
                yield keys[b * bs : (b + 1) * bs]

    def __len__(self) -> int:
        return sum(n for _, _, n in self.plan)
