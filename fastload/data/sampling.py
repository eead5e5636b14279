"""Samplers that tag each index with its epoch, resume mid-epoch, and plan several epochs.

Every key a dataset sees is `(epoch, index)`: the epoch reaches the worker with every sample,
even when workers persist across epochs (pytorch#62066), and each sample's augmentation is a
function of (seed, epoch, index) alone.

`EpochBatches` is the DataLoader's batch sampler: it yields the batches of a *plan* of epochs
back to back, so one DataLoader iterator can run from one epoch into the next and its workers
never stop at an epoch boundary (fastload/loaders/dataloader_stream.py). Each epoch's batches are
exactly those of a fresh per-epoch iteration (same permutation, same grouping, same
drop_last), so pipelining changes timing, never content.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import DistributedSampler

log = logging.getLogger("fastload")


class BatchPart(list):
    """The keys (in a worker: the samples) of one part of a batch that the batch sampler cut
    across the workers (`EpochBatches`, the stream's tail): a
    list, so a dataset and a fetcher use it as any batch of keys, that remembers which part
    it is. `collate` (fastload/data/batch.py) copies the mark onto the batch as PART."""

    def __init__(self, items, part: int, parts: int):
        super().__init__(items)
        self.part, self.parts = part, parts

    def like(self, items) -> BatchPart:
        """`items` (this part's samples) with this part's mark."""
        return BatchPart(items, self.part, self.parts)


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
        self._orders: dict[int, np.ndarray] = {}
        left = length % world_size
        if left and rank == 0:  # torch's padding, said (the stream sampler says its own)
            log.info(
                "%d samples over %d ranks: %d sample(s) repeated each epoch so that every rank "
                "gets %d (DistributedSampler's padding: they are trained, and counted, twice)",
                length, world_size, world_size - left, len(self.inner),
            )  # fmt: skip

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

    def epoch_keys(self, epoch: int) -> EpochKeys:
        """This rank's whole epoch `epoch`, whatever `set_epoch` says (for planned epochs):
        DistributedSampler's indices, as keys made when read (its length needs no order)."""
        return EpochKeys(epoch, len(self.inner), self._order)

    def _order(self, epoch: int) -> np.ndarray:
        """This rank's indices of epoch `epoch` (int64), the last two asked for kept: one
        array, not a list of 1.28M tuples per epoch (~120 MB and ~0.3 s at ImageNet size)."""
        if epoch not in self._orders:
            order = self.rank_orders(epoch, self.world_size)[self.rank]
            self._orders = dict(list(self._orders.items())[-1:])
            self._orders[epoch] = np.ascontiguousarray(order, np.int64)
        return self._orders[epoch]

    def rank_orders(self, epoch: int, world_size: int) -> list[np.ndarray]:
        """Every rank's order of epoch `epoch` at `world_size`, as DistributedSampler gives
        it (one permutation, padded by repeating its start, rank r taking every W-th from r):
        what an epoch continued at another world size starts from (fastload/data/elastic.py)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.length, generator=g).numpy()
        else:
            order = np.arange(self.length)
        total = -(-self.length // world_size) * world_size
        order = np.resize(order, total)  # repeats from the start, as DistributedSampler pads
        return [order[r::world_size] for r in range(world_size)]

    def __iter__(self):
        return self.epoch_keys(self.epoch).iter_from(self.skipped)

    def __len__(self) -> int:
        return len(self.inner) - self.skipped


class EpochKeys(Sequence):
    """One rank's `(epoch, index)` keys of one epoch, made as they are read: an item is a
    key, a slice a list of keys (a batch), iteration goes a chunk at a time. `order(epoch)`
    gives the indices (np.ndarray), asked for only when a key is read."""

    CHUNK = 1 << 16

    def __init__(self, epoch: int, length: int, order):
        self.epoch, self.length, self._get = epoch, length, order

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [(self.epoch, i) for i in self._get(self.epoch)[k].tolist()]
        return (self.epoch, int(self._get(self.epoch)[k]))

    def __iter__(self):
        return self.iter_from(0)

    def iter_from(self, start: int):
        """The keys from the start-th on."""
        order = self._get(self.epoch) if start < self.length else ()
        for a in range(start, self.length, self.CHUNK):
            yield from ((self.epoch, i) for i in order[a : a + self.CHUNK].tolist())


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
    reads it again at every reset). An epoch in `continued` yields those batches instead.

    `tail_workers` (the loader's worker count; 0 or 1: off) balances the stream's end. The
    DataLoader hands batches to its workers in turn, so when a stream's batch count is not a
    multiple of the workers, the last round leaves workers idle while the others build one
    more batch each: on 2 workers and an odd count, one core idles for a whole batch time
    (~3 % of a 2,000-image epoch; FFCV, whose threads share every batch, has no such tail).
    The batches of that last round (`tail_batch_count`) are yielded as `BatchPart`s instead,
    each cut into one near-equal part per worker, so every worker builds the same share of
    them; the loader's host stage joins the parts again (`merge_parts`): the batches,
    their samples and order are exactly those of the uncut stream."""

    def __init__(self, sampler, batch_size: int, drop_last: bool, tail_workers: int = 0):
        self.sampler, self.batch_size, self.drop_last = sampler, int(batch_size), drop_last
        self.tail_workers = int(tail_workers)
        self.plan: list[tuple[int, int, int]] = []
        # epoch -> this rank's batches of an epoch continued at another world size
        # (fastload/data/elastic.py), which replace the sampler's for that epoch
        self.continued: dict[int, list[list]] = {}

    def epoch_batches(self) -> int:
        """Batches in one whole epoch."""
        return epoch_batch_count(len(self.sampler.epoch_keys(0)), self.batch_size, self.drop_last)

    def _batches(self, epoch: int, skip: int, n: int) -> Sequence[list]:
        if epoch in self.continued:
            return self.continued[epoch][skip : skip + n]
        keys, bs = self.sampler.epoch_keys(epoch), self.batch_size
        total = epoch_batch_count(len(keys), bs, self.drop_last)
        return _Batches(keys, bs, range(skip, min(total, skip + n)))

    def _cut(self, before: int, batches: list[list]) -> int:
        """How many of the plan's last batches are cut (`before`: the batches ahead of them)."""
        if not batches:
            return 0
        n, last = before + len(batches), len(batches[-1])
        return min(tail_batch_count(n, last, self.batch_size, self.tail_workers), len(batches))

    def __iter__(self):
        before = 0
        for i, entry in enumerate(self.plan):
            batches = self._batches(*entry)
            k = self._cut(before, batches) if i == len(self.plan) - 1 else 0
            yield from batches[: len(batches) - k]
            for batch in batches[len(batches) - k :]:
                yield from cut_batch(batch, self.tail_workers)
            before += len(batches)

    def __len__(self) -> int:
        """Items this sampler yields: batches, a cut batch counting once per part."""
        n = sum(n for _, _, n in self.plan)
        if not self.plan or self.tail_workers < 2:
            return n
        batches = self._batches(*self.plan[-1])
        k = self._cut(n - len(batches), batches)
        # a cut batch is min(its size, workers) parts (cut_batch leaves empty parts out)
        return n + sum(min(len(b), self.tail_workers) - 1 for b in batches[len(batches) - k :])


class _Batches(Sequence):
    """Batches `numbers` of `keys` (batch b: keys[b * size : (b + 1) * size]), each made
    when read; a slice is such a view too."""

    def __init__(self, keys, size: int, numbers: range):
        self.keys, self.size, self.numbers = keys, size, numbers

    def __len__(self) -> int:
        return len(self.numbers)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return _Batches(self.keys, self.size, self.numbers[k])
        b = self.numbers[k]
        return self.keys[b * self.size : (b + 1) * self.size]


def tail_batch_count(n_batches: int, last_size: int, batch_size: int, workers: int) -> int:
    """How many of a stream's last batches `EpochBatches` cuts across `workers`: those of
    the last, incomplete round of workers (n_batches mod workers); when the rounds are
    complete but the last batch is short (drop_last off), the whole last round, so the
    worker with the short batch does not sit idle while the others finish theirs."""
    if workers < 2 or n_batches == 0:
        return 0
    k = n_batches % workers
    if k == 0 and last_size < batch_size:
        k = workers
    return min(k, n_batches)


def cut_batch(keys: list, workers: int) -> list[BatchPart]:
    """`keys` as `workers` consecutive parts of near-equal size (empty parts left out)."""
    q, r = divmod(len(keys), workers)
    sizes = [q + (j < r) for j in range(workers) if q + (j < r) > 0]
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    return [
        BatchPart(keys[a : a + m], j, len(sizes))
        for j, (a, m) in enumerate(zip(starts, sizes, strict=True))
    ]


def window_class_mix(labels, shard_sizes, window: int, seed: int = 0) -> tuple[float, float]:
    """How well `shard_stream_order`'s window shuffle can mix classes: (the mean number of
    classes in a window of `window` consecutive samples of an epoch's stream, that number
    for a uniform shuffle). A store written class by class holds one or two classes per
    window whatever the shuffle inside it; a shuffled one about as many as uniform."""
    labels = np.asarray(labels, dtype=np.int64)
    n = len(labels)
    if n == 0:
        return 0.0, 0.0
    w = max(1, min(int(window), n))
    order = shard_stream_order(shard_sizes, seed=seed, epoch=0, rank=0, world_size=1, window=1)[0]
    stream = labels[np.asarray(order, dtype=np.int64)]
    blocks = [stream[a : a + w] for a in range(0, n - w + 1, w)]
    seen = float(np.mean([len(np.unique(b)) for b in blocks]))
    share = np.bincount(labels - labels.min()) / n
    share = share[share > 0]
    return seen, float(np.sum(1.0 - (1.0 - share) ** w))


def shard_stream_order(
    shard_sizes, *, seed: int, epoch: int, rank: int, world_size: int, window: int,
    remainder: str = "pad",
) -> tuple[list[int], int]:  # fmt: skip
    """One rank's sample order for a store read shard by shard (storage=webdataset), a
    function of (seed, epoch, rank, world_size) only, and how many samples the remainder
    padded (+) or dropped (-) across all ranks this epoch.

    1. the shards are permuted by (seed, epoch) and their samples laid end to end (each shard
       in its stored order): the epoch's stream, read sequentially;
    2. the stream is cut into `world_size` contiguous, EQUAL parts: every rank gets the same
       number of samples (so the same number of batches: no rank waits for another at an
       all-reduce), whatever the number of shards, also fewer shards than ranks. The
       N % world_size samples left over are handled explicitly: `pad` repeats the stream
       from its start (every sample at least once, like DistributedSampler), `drop` leaves the
       stream's last ones out this epoch (a different few each epoch);
    3. a rank's part is shuffled block-wise: it is cut into equal blocks of at most `window`
       consecutive samples, each permuted uniformly (seed, epoch, rank). A worker so needs at most the shards
       that overlap one window (about window / shard size + 2), which bounds the node cache a
       rank needs, unlike a classic shuffle buffer whose stragglers come back to shards read
       long ago."""
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    if remainder not in ("pad", "drop"):
        raise ValueError(f"remainder={remainder!r}: use pad or drop")
    rng = np.random.default_rng([seed, epoch, 0x57D5])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    perm = rng.permutation(len(sizes))
    stream = np.concatenate(
        [np.arange(starts[k], starts[k] + sizes[k]) for k in perm] or [np.zeros(0, np.int64)]
    )
    n = len(stream)
    per_rank = -(-n // world_size) if remainder == "pad" else n // world_size
    extra = per_rank * world_size - n
    if extra > 0 and n:
        # cyclically, as DistributedSampler pads: fewer samples than ranks need the stream
        # more than twice (the same as stream + stream[:extra] whenever extra <= n)
        stream = np.resize(stream, per_rank * world_size)
    part = stream[rank * per_rank : (rank + 1) * per_rank].copy()
    window = max(1, int(window))
    if window > 1 and len(part):
        # ceil(len / window) blocks of equal size (no small last block that mixes less)
        cuts = np.linspace(0, len(part), -(-len(part) // window) + 1).astype(np.int64)
        block_rng = np.random.default_rng([seed, epoch, rank, 0xB10C])
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            part[a:b] = part[a:b][block_rng.permutation(b - a)]
    return part.tolist(), extra


class ShardStreamSampler(torch.utils.data.Sampler):
    """The sampler of a store read shard by shard (a reader with `shard_sizes`): training
    order from `shard_stream_order` (equal parts per rank, block-wise shuffle), evaluation
    in stored order, rank r a contiguous 1/W of it without padding (metrics count every
    sample once; each rank fetches only its shards). Yields `(epoch, index)` like
    `EpochSampler`; resume skips batches of `epoch_keys`, which depend on (seed, epoch) only,
    so a resumed run continues with exactly the samples the interrupted one would have read."""

    def __init__(
        self, shard_sizes, *, rank: int, world_size: int, seed: int, train: bool = True,
        window: int = 1, remainder: str = "pad",
    ):  # fmt: skip
        self.shard_sizes = np.asarray(shard_sizes, dtype=np.int64)
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.train, self.window, self.remainder = train, int(window), remainder
        self.epoch = 0
        self.skipped = 0
        self._cache: tuple[int, list[int]] | None = None
        if train:
            n = int(self.shard_sizes.sum())
            left = n % world_size
            if left and rank == 0:
                log.info(
                    "%d samples over %d ranks: %d sample(s) %s each epoch so that every rank "
                    "gets %d (storage.remainder=%s)",
                    n, world_size, world_size - left if remainder == "pad" else left,
                    "repeated" if remainder == "pad" else "left out", len(self.order(0)),
                    remainder,
                )  # fmt: skip

    def order(self, epoch: int) -> list[int]:
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        if self.train:
            out, _ = shard_stream_order(
                self.shard_sizes, seed=self.seed, epoch=epoch, rank=self.rank,
                world_size=self.world_size, window=self.window, remainder=self.remainder,
            )  # fmt: skip
        else:
            n = int(self.shard_sizes.sum())
            out = list(
                range(self.rank * n // self.world_size, (self.rank + 1) * n // self.world_size)
            )
        self._cache = (epoch, out)
        return out

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.epoch, self.skipped = epoch, skip

    def epoch_keys(self, epoch: int) -> list[tuple[int, int]]:
        e = epoch if self.train else 0
        return [(e, i) for i in self.order(epoch)]

    def rank_orders(self, epoch: int, world_size: int) -> list[np.ndarray]:
        """Every rank's training order of epoch `epoch` at `world_size` (each a contiguous
        part of the shard stream): what an epoch continued at another world size starts
        from (fastload/data/elastic.py)."""
        return [
            np.asarray(shard_stream_order(
                self.shard_sizes, seed=self.seed, epoch=epoch, rank=r, world_size=world_size,
                window=self.window, remainder=self.remainder,
            )[0], np.int64)
            for r in range(world_size)
        ]  # fmt: skip

    def __iter__(self):
        return iter(self.epoch_keys(self.epoch)[self.skipped :])

    def __len__(self) -> int:
        return len(self.order(self.epoch)) - self.skipped
