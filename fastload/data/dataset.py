"""The sample path inside a worker: storage -> decode -> uint8 augment (-> CPU normalise)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from fastload.data import rawimage
from fastload.errors import ConfigError, CorruptImageError


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The RNG of one sample in one epoch; see fastload/data/transforms.py for why."""
    return np.random.default_rng((seed, epoch, index))


class ImageDataset(torch.utils.data.Dataset):
    """Indexed by `(epoch, index)` keys from `EpochSampler`, so the epoch reaches the worker
    with every sample even when workers persist across epochs (pytorch#62066)."""

    def __init__(self, storage, backend, transform, *, seed: int, skip_corrupt: bool = False):
        self.storage = storage
        self.backend = backend
        self.transform = transform
        self.seed = int(seed)
        self.skip_corrupt = skip_corrupt
        self.normalize = None  # set by the loader when normalize_on=cpu

    def __len__(self) -> int:
        return len(self.storage)

    def __getitem__(self, key):
        epoch, index = key if isinstance(key, tuple) else (0, key)
        data, target = self.storage.read(index)
        # Raw-pixel records (packed shards of decoded images) have nothing to decode.
        rng = sample_rng(self.seed, epoch, index)
        try:
            if rawimage.is_raw(data):
                pixels = rawimage.load(data, self.transform, rng, self.backend)
            else:
                pixels = self.backend.load(data, self.transform, rng)
        except Exception as exc:  # any decoder's failure on bad bytes
            self._pop_counts()  # a skipped file is counted as skipped, not as a fallback
            if self.skip_corrupt:
                return None
            raise CorruptImageError(
                f"cannot decode image {self.storage.describe(index)} ({type(exc).__name__}: "
                f"{exc}). Remove or replace the file, or set dataset.skip_corrupt=true to skip "
                f"and count such files."
            ) from None
        counts = self._pop_counts()
        if isinstance(pixels, np.ndarray):
            image = torch.from_numpy(pixels).permute(2, 0, 1)  # CHW view of HWC uint8
            if self.normalize is not None:
                image = self.normalize(image)
        else:
            # Deferred decode (backend=nvjpeg): the sample stays encoded; collate batches it
            # under "encoded" and the backend's device decoder finishes it in device prep.
            if self.normalize is not None:
                raise ConfigError(
                    f"backend={self.backend.name} decodes in device prep, after the workers: "
                    f"it needs loader.normalize_on=device (not cpu)."
                )
            image = pixels
        return (image, target, counts) if counts else (image, target)

    def _pop_counts(self) -> dict:
        """Per-sample counters of the backend (e.g. decode fallbacks), collated per batch."""
        pop = getattr(self.backend, "pop_counts", None)
        return pop() if pop is not None else {}


def collate(samples: list, ring=None) -> dict:
    """One NCHW batch (see `stack_images` for its memory layout); skipped (corrupt) samples are dropped and counted.

    Two optional parts: "counts" sums the backend's per-sample counters (python ints; the
    engine adds them into the epoch metrics), and "encoded" holds samples whose decode is
    deferred to device prep (anything not a tensor, batched by its own type's `collate`);
    "image" then holds only the samples decoded on the CPU.

    With a `BatchRing` (in a DataLoader worker), the images are stacked into a reused
    shared-memory slot and "image" is the slot's `RingSlot`; the loader's host stage swaps
    it for the copied tensor (fastload/data/batch_ring.py)."""
    kept = [s for s in samples if s is not None]
    counts: dict[str, int] = {}
    for s in kept:
        for k, v in (s[2] if len(s) > 2 else {}).items():
            counts[k] = counts.get(k, 0) + int(v)
    if not kept:
        batch = {"image": None, "target": None, "skipped": len(samples)}
    else:
        ready = [i for i, s in enumerate(kept) if torch.is_tensor(s[0])]
        deferred = [i for i, s in enumerate(kept) if not torch.is_tensor(s[0])]
        images = stack_images([kept[i][0] for i in ready], ring) if ready else None
        targets = torch.tensor([s[1] for s in kept], dtype=torch.int64)
        batch = {"image": images, "target": targets, "skipped": len(samples) - len(kept)}
        if deferred:
            encoded = [kept[i][0] for i in deferred]
            batch["encoded"] = type(encoded[0]).collate(encoded, deferred)
    if counts:
        batch["counts"] = counts
    return batch


def stack_images(images: list, ring=None):
    """torch.stack of CHW samples. The backends' samples are CHW views of HWC arrays; stacking
    those into contiguous NCHW is a strided gather (~0.2-0.4 ms per 224 px image on one core,
    as much as the resize), so they are stacked as NHWC (plain copies) and returned as an
    NCHW view with channels_last strides: same values and shape, and device prep makes the
    memory format the model wants on the device, where it is cheap. With a `ring` that has
    a free slot for this worker, returns the slot's `RingSlot` instead of a tensor."""
    hwc = [x.permute(1, 2, 0) for x in images if x.dim() == 3]
    nhwc = len(hwc) == len(images) and all(x.is_contiguous() for x in hwc)
    parts = hwc if nhwc else images
    out = slot = None
    got = ring.acquire((len(parts), *parts[0].shape), parts[0].dtype) if ring else None
    if got is not None:
        out, slot = got
    elif torch.utils.data.get_worker_info() is not None:
        # In a DataLoader worker, stack straight into shared memory (as default_collate
        # does): sending the batch to the main process then moves no bytes, where a private
        # batch is copied once more into a new shared segment when it is pickled.
        shape = (len(parts), *parts[0].shape)
        out = torch.empty(0, dtype=parts[0].dtype)
        nbytes = math.prod(shape) * out.element_size()
        out.set_(out.untyped_storage()._new_shared(nbytes), 0, shape)
    batch = torch.stack(parts, out=out)
    if slot is not None:
        if nhwc:  # the NCHW view's strides, for the main process to rebuild the same view
            order = (0, 3, 1, 2)
            slot = dataclasses.replace(
                slot,
                shape=tuple(slot.shape[d] for d in order),
                stride=tuple(slot.stride[d] for d in order),
            )
        return slot
    return batch.permute(0, 3, 1, 2) if nhwc else batch


class Normalize:
    """uint8 CHW/NCHW -> float (x/255 - mean)/std. The single normalisation of the data path:
    the loader hands it either to the dataset (normalize_on=cpu) or to device prep."""

    def __init__(self, mean, std):
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1) * 255
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1) * 255

    def to(self, device) -> Normalize:
        """A copy whose mean/std live on `device`, so each call does not copy them there."""
        moved = Normalize.__new__(Normalize)
        moved.mean, moved.std = self.mean.to(device), self.std.to(device)
        return moved

    def __call__(self, x: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        mean, std = self.mean.to(x.device), self.std.to(x.device)
        return ((x.float() - mean) / std).to(dtype)
