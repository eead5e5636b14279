"""How a batch travels from a DataLoader worker to the consumer, apart from what a batch is.

fastload/data/batch.py says what a batch holds (the keys every consumer reads); this module
holds what only the trip needs:

* `InlineArray`: a small array (the targets) sent inside the batch's pickle, not as a
  shared-memory tensor of its own (its image travels as a `RingSlot`,
  fastload/loaders/batch_ring.py);
* `SlotCollate`: the DataLoader's collate_fn when batches reuse slots: the batch contract's
  `collate` into the ring that `LoaderSlots` opened for the current stream;
* `merge_parts` / `join_images`: a batch that the batch sampler cut across the workers
  (fastload/data/sampling.py: `BatchPart`) joined again before anything else sees it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from fastload.data.batch import (
    COUNTS,
    ENCODED,
    IMAGE,
    SKIPPED,
    SKIPPED_FILES,
    TARGET,
    put_optional,
    sum_counts,
)


@dataclasses.dataclass(frozen=True, eq=False)
class InlineArray:
    """A small array a worker sends inside the batch's pickle (bytes through the pipe) rather
    than as a tensor. torch sends every tensor a worker returns as a new shared-memory
    segment whose file descriptor the main process fetches over a new connection to the
    worker (authenticated, then the fd passed): ~150 us of main-process and ~200 us of worker
    CPU per tensor on 2 cores, far more than 64 int64 targets are worth; the image slot
    already travels as a `RingSlot`, so this was the batch's last tensor. The loader's host
    stage makes it a tensor again (`BatchRing.resolve_batch`); the DataLoader's pin thread
    calls `pin_memory`."""

    array: np.ndarray

    def tensor(self) -> torch.Tensor:
        return torch.from_numpy(self.array)

    def pin_memory(self, device=None) -> torch.Tensor:
        return self.tensor().pin_memory()


def resolve_inline(batch, pin_memory: bool = False):
    """A batch dict with its `InlineArray` values made tensors again (pinned when pinning);
    `BatchRing.resolve_batch` does this and the slots' views for a stream with slots."""
    if isinstance(batch, dict):
        for key, value in batch.items():
            if isinstance(value, InlineArray):
                batch[key] = value.pin_memory() if pin_memory else value.tensor()
    return batch


class FreshSegments:
    """What collate stacks into when a stream has no slots (/dev/shm without room for them):
    each batch's images in a new shared segment made by the worker itself, its small arrays
    inline. A targets tensor would instead be moved to shared memory by the worker's queue
    feeder thread, where a full /dev/shm fails without an error reaching the main process:
    the batch is lost and the run waits for it forever."""

    def acquire(self, shape, dtype):
        return None

    def inline(self, array: np.ndarray) -> InlineArray:
        return InlineArray(array)


class SlotCollate:
    """The DataLoader's collate_fn when its workers stack into reused batch slots: the batch
    contract's `collate` into the ring of `slots`, or `FreshSegments` while a stream has none
    (/dev/shm without room). Built with the DataLoader, never swapped in later: each
    stream's workers take a copy of it when they start, after `LoaderSlots.open` made that
    stream's ring."""

    def __init__(self, collate, slots):
        self.collate, self.slots = collate, slots

    def __call__(self, samples):
        return self.collate(samples, ring=self.slots.ring or FreshSegments())


def merge_parts(parts: list[dict], pin_memory: bool = False) -> dict:
    """The batch that `parts` (collated `BatchPart`s of one batch, in order, their tensors
    already out of their slots) were cut from: the same dict `collate` gives for the whole
    batch. The images are joined by `join_images` (pinned when `pin_memory`), the targets,
    counts and skipped files concatenated or summed; a batch's deferred (ENCODED) samples
    cannot be joined, so the loader never cuts batches for a backend that defers its decode."""
    if any(ENCODED in p for p in parts):
        raise ValueError("merge_parts: parts with deferred (encoded) samples cannot be joined")
    images = [p[IMAGE] for p in parts if p[IMAGE] is not None]
    targets = [p[TARGET] for p in parts if p[TARGET] is not None]
    batch = {IMAGE: None, TARGET: None, SKIPPED: sum(p[SKIPPED] for p in parts)}
    if images:
        batch[IMAGE] = join_images(images, pin_memory)
        batch[TARGET] = torch.cat(targets)
        if pin_memory:
            batch[TARGET] = batch[TARGET].pin_memory()
    counts = sum_counts(p.get(COUNTS, {}) for p in parts)
    put_optional(batch, counts, [w for p in parts for w in p.get(SKIPPED_FILES, [])])
    return batch


def join_images(images: list[torch.Tensor], pin_memory: bool = False) -> torch.Tensor:
    """The images of consecutive parts as one batch tensor with the first part's strides.

    Where the first part sits at the start of a storage with room for the whole batch (a
    reused slot: sized for a batch, and the consumer's until the batch is dropped), the
    other parts are copied in after it and the batch is that storage: no new memory (a new
    ~10 MB tensor costs more in page faults than the copy), a copy of the other parts only.
    Else (pinned copies, fresh segments) a new tensor, pinned when `pin_memory`."""
    first = images[0]
    shape = (sum(len(x) for x in images), *first.shape[1:])
    per_sample = math.prod(first.shape[1:])
    dense = first.is_contiguous() or (
        first.dim() == 4 and first.is_contiguous(memory_format=torch.channels_last)
    )
    storage = first.untyped_storage()
    room = storage.nbytes() >= math.prod(shape) * first.element_size() and not pin_memory
    if dense and first.storage_offset() == 0 and first.stride(0) == per_sample and room:
        out = torch.empty(0, dtype=first.dtype).set_(storage, 0, shape, first.stride())
    else:
        nhwc = first.dim() == 4 and not first.is_contiguous()
        fmt = torch.channels_last if nhwc else torch.contiguous_format
        out = torch.empty(shape, dtype=first.dtype, memory_format=fmt, pin_memory=pin_memory)
        out[: len(first)].copy_(first)
    at = len(first)
    for x in images[1:]:
        out[at : at + len(x)].copy_(x)
        at += len(x)
    return out
