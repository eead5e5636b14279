"""Reused shared-memory batch buffers between DataLoader workers and the main process.

Why: a DataLoader worker puts every batch into a *new* shared-memory segment (torch's
`_new_shared`: shm_open + fallocate + mmap), the main process maps it, and both unmap it
after one use. For a 64 x 224 x 224 x 3 uint8 batch that is ~5.5 ms of page allocation,
zeroing and faults per batch on this machine, ~85 us per image: more than the checksum and
the crop together on a raw-pixel shard pack. FFCV avoids it by filling preallocated batch
buffers; this does the same inside a torch DataLoader, without FFCV's catch (a batch you keep
is overwritten a few steps later): a slot is reused only once nothing references it.

How: before the workers start, the main process allocates `slots` shared storages per worker
and a shared state table. Each slot is owned by one side at a time:

    FREE -> WORKER      a worker's collate takes a free slot of its own row, stacks the
                        batch into it and returns a `RingSlot` (worker, slot, shape,
                        strides) instead of the pixels;
    WORKER -> CONSUMER  the loader's host stage (`resolve_batch`) turns the RingSlot into a
                        tensor viewing the slot (zero copy); when pinning, the DataLoader's
                        pin-memory thread does it instead (`RingSlot.pin_memory`, the hook
                        torch's pinning calls): it copies the slot into pinned memory, the
                        copy it made of every batch anyway, and frees the slot at once;
    CONSUMER -> FREE    `reclaim` (at every resolve) frees the slots whose storage nobody
                        else references any more (the storage's use count is back to the
                        ring's own reference: every tensor, view and numpy array of the
                        batch is gone).

A worker that finds no free slot (more batches in flight or held than slots, or a batch
larger than a slot, e.g. a CPU-normalised float batch) stacks into a fresh segment as
torch does, counted as a miss: correctness never depends on the slot count. `reset()`
(before each epoch's iterator exists, and after it is exhausted) frees WORKER slots that an
abandoned epoch left behind;
CONSUMER slots stay until their batches are dropped. Without torch's storage use count
(private: fastload/torch_internals.py) the consumer gets a private copy and the slot is
freed at once.

Ordering: pixels written by a worker reach the main process after a pipe write (the result
queue); a slot is reused only after the main process saw its last reference go (an atomic
decrement) and then stored FREE.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import weakref

import numpy as np
import torch
from torch.utils.data import get_worker_info

from fastload.host import MB, SHM, SHM_FIX, shm_bytes
from fastload.loaders.transport import InlineArray
from fastload.torch_internals import has_use_count, new_shared_storage, use_count

log = logging.getLogger("fastload.loaders")

FREE, WORKER, CONSUMER = 0, 1, 2
# The rings of this (main) process by token, for RingSlot.pin_memory in the pin thread.
_RINGS: dict[int, weakref.ref] = {}
_TOKENS = itertools.count()


@dataclasses.dataclass(frozen=True)
class RingSlot:
    """What a worker returns instead of a batch tensor stacked into a ring slot."""

    worker: int
    slot: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    ring: int = -1  # the BatchRing's token

    def pin_memory(self, device=None):
        """Called by the DataLoader's pin-memory thread: the slot copied into pinned memory
        (and freed), or this RingSlot unchanged when its ring is gone."""
        ref = _RINGS.get(self.ring)
        ring = ref() if ref is not None else None
        return self if ring is None else ring.resolve(self, pin_memory=True)


class BatchRing:
    def __init__(self, num_workers: int, slots: int, slot_bytes: int):
        if num_workers < 1 or slots < 1 or slot_bytes < 1:
            raise ValueError(f"BatchRing({num_workers}, {slots}, {slot_bytes})")
        self.num_workers, self.slots, self.slot_bytes = (
            int(num_workers),
            int(slots),
            int(slot_bytes),
        )
        self.storages = [
            new_shared_storage(self.slot_bytes) for _ in range(self.num_workers * self.slots)
        ]
        self.state = torch.zeros(self.num_workers, self.slots, dtype=torch.int32).share_memory_()
        # Per worker: batches stacked into a slot (hits) and into a fresh segment (misses).
        self.counters = torch.zeros(self.num_workers, 2, dtype=torch.int64).share_memory_()
        self._state_np = self._counters_np = None
        self.token = next(_TOKENS)
        _RINGS[self.token] = weakref.ref(self)
        weakref.finalize(self, _RINGS.pop, self.token, None)

    @property
    def nbytes(self) -> int:
        return self.num_workers * self.slots * self.slot_bytes

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_state_np"] = state["_counters_np"] = None  # numpy views do not pickle as shared
        return state

    def _views(self):
        if self._state_np is None:
            self._state_np = self.state.numpy()
            self._counters_np = self.counters.numpy()
        return self._state_np, self._counters_np

    def _tensor(self, worker: int, slot: int, shape, stride, dtype) -> torch.Tensor:
        storage = self.storages[worker * self.slots + slot]
        return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape), tuple(stride))

    # -- worker side ---------------------------------------------------------------------

    def acquire(self, shape, dtype) -> tuple[torch.Tensor, RingSlot] | None:
        """In a worker: a contiguous tensor of `shape` in a free slot of this worker's row,
        now owned by the worker, and its `RingSlot`; None (a miss) when there is none."""
        info = get_worker_info()
        if info is None or info.id >= self.num_workers:
            return None
        state, counters = self._views()
        shape = tuple(int(d) for d in shape)
        free = np.flatnonzero(state[info.id] == FREE)
        if int(np.prod(shape)) * dtype.itemsize > self.slot_bytes or not len(free):
            counters[info.id, 1] += 1
            return None
        slot = int(free[0])
        state[info.id, slot] = WORKER
        counters[info.id, 0] += 1
        stride = torch.empty(shape, dtype=torch.uint8, device="meta").stride()
        tensor = self._tensor(info.id, slot, shape, stride, dtype)
        return tensor, RingSlot(info.id, slot, shape, stride, dtype, self.token)

    # -- main-process side ---------------------------------------------------------------

    def reset(self) -> None:
        """Free the slots workers own and reclaim the consumer's unreferenced ones. Call
        when no batch of a live epoch is in flight: before an epoch's DataLoader iterator is
        created, and after it is exhausted. (Persistent workers still finishing an
        abandoned epoch's tasks may take slots after the first call; the DataLoader drops
        those batches, and the call at the end of the next full epoch frees their slots.)"""
        state, _ = self._views()
        state[state == WORKER] = FREE
        self.reclaim()

    def reclaim(self) -> int:
        """Free the consumer's slots that nothing references any more; returns how many."""
        if not has_use_count():
            return 0
        state, _ = self._views()
        freed = 0
        for w, s in zip(*np.nonzero(state == CONSUMER), strict=True):
            if use_count(self.storages[w * self.slots + s]) <= 1:  # the ring's own
                state[w, s] = FREE
                freed += 1
        return freed

    def resolve(self, ref: RingSlot, pin_memory: bool = False) -> torch.Tensor:
        """The batch tensor of a slot: a zero-copy view (the slot is freed once the view and
        everything derived from it is gone), or a pinned (or, without use counts, private)
        copy, after which the slot is free at once."""
        state, _ = self._views()
        view = self._tensor(ref.worker, ref.slot, ref.shape, ref.stride, ref.dtype)
        if pin_memory or not has_use_count():
            out = torch.empty_like(view, pin_memory=pin_memory)  # same (channels_last) strides
            out.copy_(view)
            state[ref.worker, ref.slot] = FREE
            return out
        state[ref.worker, ref.slot] = CONSUMER
        return view

    def resolve_batch(self, batch, pin_memory: bool = False):
        """A collated batch dict with every `RingSlot` and `InlineArray` value replaced by its
        tensor (pinned ones already are, by the DataLoader's pin thread)."""
        self.reclaim()
        if isinstance(batch, dict):
            for key, value in batch.items():
                if isinstance(value, RingSlot):
                    batch[key] = self.resolve(value, pin_memory)
                elif isinstance(value, InlineArray):
                    batch[key] = value.pin_memory() if pin_memory else value.tensor()
        return batch

    def inline(self, array: np.ndarray) -> InlineArray:
        """A small array (the targets) as it travels from a worker stacking into this ring:
        inside the batch's pickle, no shared segment of its own."""
        return InlineArray(array)

    def stats(self) -> dict:
        """Batches stacked into a slot (hits) and into a fresh segment (misses), summed."""
        hits, misses = (int(v) for v in self.counters.sum(0))
        return {"ring_hits": hits, "ring_misses": misses}


class LoaderSlots:
    """A loader's batch slots over its epochs: sized at construction, allocated at the first
    epoch (a loader never iterated costs nothing), read by the DataLoader's collate
    (fastload/loaders/transport.py: `SlotCollate`), and released with `close()` (after each epoch when workers are not persistent, so the eval
    loader's slots do not sit in /dev/shm while training runs). Counts hits and misses over
    every epoch."""

    def __init__(self, num_workers: int, slots: int, slot_bytes: int):
        self.num_workers, self.slots, self.slot_bytes = num_workers, slots, slot_bytes
        self.ring: BatchRing | None = None
        self._totals = {"ring_hits": 0, "ring_misses": 0}

    def open(self) -> BatchRing | None:
        """The slots (allocated if needed, before the workers start); None when /dev/shm
        has no room for them (this epoch then uses a new shared segment per batch)."""
        if self.ring is not None:
            return self.ring
        nbytes = self.num_workers * self.slots * self.slot_bytes
        shm = shm_bytes()
        if shm is not None and nbytes > shm[1] // 2:
            log.warning(
                "loader.reuse_batch_memory: %d MiB of batch slots would take more than half of "
                "the %d MiB free in %s; this epoch falls back to a new shared segment per "
                "batch. %s",
                nbytes // MB,
                shm[1] // MB,
                SHM,
                SHM_FIX,
            )
            return None
        self.ring = BatchRing(self.num_workers, self.slots, self.slot_bytes)
        return self.ring

    def close(self) -> None:
        """Drop the slots (batches the consumer still holds keep their own slot alive)."""
        ring, self.ring = self.ring, None
        if ring is not None:
            for k, v in ring.stats().items():
                self._totals[k] += v

    def stats(self) -> dict:
        now = self.ring.stats() if self.ring is not None else {}
        return {k: v + now.get(k, 0) for k, v in self._totals.items()}
