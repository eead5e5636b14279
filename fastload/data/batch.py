"""The batch contract: what every stage after collate can rely on, written down once.

A sample leaves the dataset (fastload/data/dataset.py) as `(image, target)` or
`(image, target, counts)`: image a uint8 CHW tensor (a view of the decoder's HWC array; float
when normalize_on=cpu), a `DeferredSample` (fastload/decode/base.py), or, from a dataset's
`load_batch` only (the batch path the loader takes with this collate), a `PendingImage`: a
crop not resized yet, which collate writes straight into the batch's memory; target an int, counts
a dict of per-sample backend counters; a `Skipped` is a corrupt sample the dataset left out
(dataset.skip_corrupt), `None` one a custom dataset left out.

`collate` turns a list of them into a batch, a dict with these keys:
"""

from __future__ import annotations

import abc
import dataclasses
import math

import numpy as np
import torch

from fastload.data.sampling import BatchPart
from fastload.torch_internals import new_shared_storage

IMAGE = "image"
"""uint8 NCHW with channels_last strides (see `stack_images`), float32 NCHW when normalised
in the workers, a `RingSlot` while it travels through a reused batch slot; after device prep
the model's input (float or loader.input_dtype, normalised, in the model's memory format).
None when every sample of the batch was skipped."""
TARGET = "target"
"""int64 (N,) on the same device as the image; None when every sample was skipped. An
`InlineArray` (fastload/loaders/transport.py) while it travels from a worker that stacks
into a reused slot."""
SKIPPED = "skipped"
"""int: samples of this batch dropped as corrupt (dataset.skip_corrupt=true)."""
COUNTS = "counts"
"""optional dict[str, int]: the backend's per-sample counters summed over the batch (decode
fallbacks, DCT-scaled decodes); the engine adds them into the epoch metrics."""
SKIPPED_FILES = "skipped_files"
"""optional list[str]: where the skipped samples live (their reader's `describe`), for the
run's report of what dataset.skip_corrupt left out."""
ENCODED = "encoded"
"""optional dict: samples whose decode is deferred to device prep (backend=nvjpeg), batched by
their class's `collate`; IMAGE then holds only the samples decoded in the workers. Device
prep replaces both with the decoded IMAGE."""
PART = "part"
"""(k, n) on a batch built from a `BatchPart` of keys (fastload/data/sampling.py): the k-th of
n consecutive parts of one batch, which the loader's host stage joins
(fastload/loaders/transport.py: `merge_parts`) before anything else sees it."""


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A sample the dataset could not decode and skipped: where it lives."""

    where: str


class PendingImage(abc.ABC):
    """A sample's uint8 image that collate materialises in place: `write` puts its HWC pixels
    into the sample's place in the batch (a view of the reused slot), so the image is never
    built in a buffer of its own and copied again (~150 KB per 224 px image)."""

    shape: tuple[int, int, int]  # (C, H, W) of the image it becomes

    @abc.abstractmethod
    def write(self, out: np.ndarray) -> None:
        """Fill `out`, a C-contiguous (H, W, C) uint8 array."""

    def tensor(self) -> torch.Tensor:
        """The image alone: a CHW view of a new HWC array (what the dataset's item gives)."""
        c, h, w = self.shape
        hwc = np.empty((h, w, c), np.uint8)
        self.write(hwc)
        return torch.from_numpy(hwc).permute(2, 0, 1)


def collate(samples: list, ring=None) -> dict:
    """Samples -> one batch dict with the keys above; skipped (corrupt) samples, `None`, are
    dropped and counted.

    With a `ring` (in a DataLoader worker: the loader's reused batch slots,
    fastload/loaders/batch_ring.py, or fresh segments when it has none), the images are
    stacked into what `ring.acquire` hands out (a free slot: IMAGE is then its handle) and
    TARGET is what `ring.inline` makes of the labels; the loader's host stage swaps them for
    tensors (fastload/loaders/transport.py)."""
    kept = [s for s in samples if s is not None and not isinstance(s, Skipped)]
    gone = [s.where for s in samples if isinstance(s, Skipped)]
    counts = sum_counts(s[2] for s in kept if len(s) > 2)
    if not kept:
        batch = {IMAGE: None, TARGET: None, SKIPPED: len(samples)}
    else:
        ready = [i for i, s in enumerate(kept) if is_image(s[0])]
        deferred = [i for i, s in enumerate(kept) if not is_image(s[0])]
        images = stack_images([kept[i][0] for i in ready], ring) if ready else None
        labels = [s[1] for s in kept]
        if ring is None:
            targets = torch.tensor(labels, dtype=torch.int64)
        else:  # a worker stacking into reused slots: no shared segment for the targets either
            targets = ring.inline(np.array(labels, dtype=np.int64))
        batch = {IMAGE: images, TARGET: targets, SKIPPED: len(samples) - len(kept)}
        if deferred:
            encoded = [kept[i][0] for i in deferred]
            batch[ENCODED] = type(encoded[0]).collate(encoded, deferred)
    put_optional(batch, counts, gone)
    if isinstance(samples, BatchPart):
        batch[PART] = (samples.part, samples.parts)  # joined again by the host stage
    return batch


def sum_counts(many) -> dict[str, int]:
    """Per-sample (or per-part) COUNTS dicts summed key by key, for one batch's COUNTS."""
    total: dict[str, int] = {}
    for counts in many:
        for k, v in counts.items():
            total[k] = total.get(k, 0) + int(v)
    return total


def put_optional(batch: dict, counts: dict[str, int], gone: list[str]) -> None:
    """The optional COUNTS and SKIPPED_FILES keys of a batch, set only when non-empty (every
    collate, and the join of a cut batch's parts, end with this)."""
    if counts:
        batch[COUNTS] = counts
    if gone:
        batch[SKIPPED_FILES] = gone


def is_image(x) -> bool:
    return torch.is_tensor(x) or isinstance(x, PendingImage)


def batch_memory(shape, dtype, ring=None):
    """(an empty contiguous batch tensor of `shape`, its RingSlot or None): a free slot of
    `ring`; in a DataLoader worker without one, a new shared-memory segment (as
    default_collate does: sending the batch to the main process then moves no bytes, where
    a private batch is copied once more into a new shared segment when it is pickled);
    else private memory."""
    got = ring.acquire(shape, dtype) if ring else None
    if got is not None:
        return got
    out = torch.empty(0, dtype=dtype)
    if torch.utils.data.get_worker_info() is not None:
        nbytes = math.prod(shape) * out.element_size()
        return out.set_(new_shared_storage(nbytes), 0, tuple(shape)), None
    return torch.empty(tuple(shape), dtype=dtype), None


def nchw_result(batch, slot):
    """An NHWC batch as the NCHW view (channels_last strides) collate returns, or its slot
    (with the NCHW view's shape and strides, for the main process to rebuild the same view)."""
    if slot is None:
        return batch.permute(0, 3, 1, 2)
    order = (0, 3, 1, 2)
    return dataclasses.replace(
        slot,
        shape=tuple(slot.shape[d] for d in order),
        stride=tuple(slot.stride[d] for d in order),
    )


def stack_pending(images: list, ring=None):
    """`stack_images` of a batch holding `PendingImage`s: each is written straight into its
    place in the batch memory (tensors are copied there), NHWC, returned as in stack_images."""
    c, h, w = images[0].shape
    out, slot = batch_memory((len(images), h, w, c), torch.uint8, ring)
    arr = out.numpy()
    for k, x in enumerate(images):
        if isinstance(x, PendingImage):
            if tuple(x.shape) != (c, h, w):
                raise ValueError(f"a batch of {(c, h, w)} images got one of {tuple(x.shape)}")
            x.write(arr[k])
        else:
            out[k].copy_(x.permute(1, 2, 0))
    return nchw_result(out, slot)


def stack_images(images: list, ring=None):
    """torch.stack of CHW samples. The backends' samples are CHW views of HWC arrays; stacking
    those into contiguous NCHW is a strided gather (~0.2-0.4 ms per 224 px image on one core,
    as much as the resize), so they are stacked as NHWC (plain copies) and returned as an
    NCHW view with channels_last strides: same values and shape, and device prep makes the
    memory format the model wants on the device, where it is cheap. With a `ring` that has
    a free slot for this worker, returns the slot's `RingSlot` instead of a tensor."""
    if any(isinstance(x, PendingImage) for x in images):
        return stack_pending(images, ring)
    hwc = [x.permute(1, 2, 0) for x in images if x.dim() == 3]
    nhwc = len(hwc) == len(images) and all(x.is_contiguous() for x in hwc)
    parts = hwc if nhwc else images
    out, slot = batch_memory((len(parts), *parts[0].shape), parts[0].dtype, ring)
    batch = torch.stack(parts, out=out)
    if nhwc:
        return nchw_result(batch, slot)
    return slot if slot is not None else batch
