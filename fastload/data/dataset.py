"""The sample path inside a worker: storage -> decode -> uint8 augment (-> CPU normalise).

What a sample is when it leaves here, and how samples become a batch: fastload/data/batch.py.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from fastload.data import rawimage
from fastload.data.batch import PendingImage, Skipped
from fastload.data.rng import batch_rngs, sample_rng  # noqa: F401  (sample_rng: re-exported)
from fastload.errors import CorruptImageError


class ImageDataset(torch.utils.data.Dataset):
    """Indexed by `(epoch, index)` keys from `EpochSampler`, so the epoch reaches the worker
    with every sample even when workers persist across epochs (pytorch#62066). Reads the
    records' `image` and `label` fields (an ImageFolder source's)."""

    IMAGE, LABEL = "image", "label"
    # Each sample draws from its own RNG, (seed, epoch, index), never the global ones: so a
    # batch cut into parts across the workers (loader.balanced_tail) builds the same pixels.
    rng_per_sample = True

    def __init__(
        self,
        reader,
        backend,
        transform,
        *,
        seed: int,
        skip_corrupt=False,
        normalize=None,
        item_cost_ms: float = 0.0,
    ):
        self.reader = reader  # a fastload.storage.base.Reader
        self.labels = reader.column(self.LABEL)  # every label at once: no read per label
        self.backend = backend  # a fastload.decode.base.DecodeBackend
        self.transform = transform
        self.seed = int(seed)
        self.skip_corrupt = skip_corrupt
        # A Normalize when the builder put normalisation in the workers (normalize_on=cpu),
        # else None: the batch stays uint8 and device prep normalises it.
        self.normalize = normalize
        # Extra CPU work per sample (a busy loop, not a sleep: it holds a core the way a
        # heavier augmentation would), for worker-scaling experiments (EXPERIMENTS.md, D).
        self.item_cost_ms = float(item_cost_ms)

    def __len__(self) -> int:
        return len(self.reader)

    @property
    def crops_in_place(self) -> bool:
        """Whether `load_batch` may leave raw-pixel crops to collate (`PendingCrop`): a
        uint8 batch, a transform that draws its box with `sample`, a backend that crops a
        drawn box (`crop_pixels`)."""
        return (
            self.normalize is None
            and callable(getattr(self.transform, "sample", None))
            and isinstance(getattr(self.transform, "size", None), int)
            and callable(getattr(self.backend, "crop_pixels", None))
        )

    def __getitem__(self, key):
        return self._load(key, pending=False)

    def __getitems__(self, keys: list) -> list:
        """The samples of `keys`, the same as `[self[k] for k in keys]`."""
        return [
            (s[0].tensor(), *s[1:])
            if isinstance(s, tuple) and isinstance(s[0], PendingImage)
            else s
            for s in self.load_batch(keys)
        ]

    def load_batch(self, keys: list) -> list:
        """A batch's samples for fastload's `collate` (fastload/data/batch.py), the loader's
        path: raw-pixel records and ROI-decoded JPEGs come back as `PendingCrop`s (box drawn;
        pixels a view of the record, or the decoded region) that collate resizes straight
        into the batch's reused slot; everything else as `__getitem__` gives it."""
        pending = self.crops_in_place
        # The keys' generators made for the whole batch at once (fastload/data/rng.py): the
        # same streams as sample_rng, at ~3 us a sample instead of ~8-15.
        rngs = batch_rngs(self.seed, keys)
        return [self._load(k, pending, rng) for k, rng in zip(keys, rngs, strict=True)]

    def _load(self, key, pending: bool, rng=None):
        epoch, index = key if isinstance(key, tuple) else (0, key)
        self.reader.epoch = epoch  # its reads count in this epoch's row
        data, target = self.reader.get(index, self.IMAGE), int(self.labels[index])
        if rng is None:
            rng = sample_rng(self.seed, epoch, index)
        # Raw-pixel records (packed shards of decoded images) have nothing to decode.
        try:
            if rawimage.is_raw(data):
                pixels = rawimage.pixels(data)
                if pending:
                    box, flip = self.transform.sample(pixels.shape[1], pixels.shape[0], rng)
                    pixels = (pixels, box, flip)
                else:
                    pixels = self.backend.load_pixels(pixels, self.transform, rng)
            elif pending and hasattr(self.backend, "decode_region"):
                # ROI-decoded JPEGs (backend=turbo): the region, resized in collate too
                pixels = self.backend.decode_region(data, self.transform, rng)
            else:
                pixels = self.backend.load(data, self.transform, rng)
        except Exception as exc:  # any decoder's failure on bad bytes
            return undecodable(self, index, exc)
        counts = self.backend.pop_counts()
        if self.item_cost_ms > 0:
            busy_wait(self.item_cost_ms / 1000)
        if isinstance(pixels, tuple):  # (pixels, box, flip): collate crops into the slot
            image = PendingCrop(*pixels, self.transform.size, self.backend)
        elif isinstance(pixels, np.ndarray):
            image = torch.from_numpy(pixels).permute(2, 0, 1)  # CHW view of HWC uint8
            if self.normalize is not None:
                image = self.normalize(image)
        else:
            # Deferred decode (backend=nvjpeg): the sample stays encoded; collate batches it
            # under "encoded" and the backend's device decoder finishes it in device prep,
            # which names the file and applies skip_corrupt if that cannot decode it either.
            image = pixels
            image.index = index
        return (image, target, counts) if counts else (image, target)


class PendingCrop(PendingImage):
    """A raw-pixel sample's (or an ROI-decoded JPEG's) crop, drawn but not resized: collate has the backend resize it
    into the sample's place in the batch (`crop_pixels(..., out=)`), the same pixels as
    `load_pixels` with the same draw."""

    __slots__ = ("pixels", "box", "flip", "size", "backend", "shape")

    def __init__(self, pixels: np.ndarray, box, flip: bool, size: int, backend):
        self.pixels, self.box, self.flip, self.size, self.backend = pixels, box, flip, size, backend
        self.shape = (pixels.shape[2], size, size)

    def write(self, out: np.ndarray) -> None:
        got = self.backend.crop_pixels(self.pixels, self.box, self.flip, self.size, out=out)
        if got is not out and not np.shares_memory(got, out):
            out[...] = got  # a backend that could not write in place


def busy_wait(seconds: float) -> None:
    """`seconds` of this thread's CPU time spent (not of the wall clock: on a busy machine
    real per-sample work takes longer too, and a wall-clock loop would do less of it)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def undecodable(dataset, index: int, exc: Exception) -> Skipped:
    """A sample the backend could not decode: `Skipped` with dataset.skip_corrupt, else the
    error naming the file. The backend's counters of that sample are dropped (a skipped file
    is counted as skipped, not as a decode fallback)."""
    dataset.backend.pop_counts()
    if dataset.skip_corrupt:
        return Skipped(dataset.reader.describe(index))
    raise CorruptImageError(
        f"cannot decode image {dataset.reader.describe(index)} ({type(exc).__name__}: {exc}). "
        f"Remove or replace the file, or set dataset.skip_corrupt=true to skip and count such "
        f"files."
    ) from None


class Normalize:
    """uint8 CHW/NCHW -> float (x/255 - mean)/std. The single normalisation of the data path:
    the builder (fastload/pipeline.py) hands it either to the dataset (normalize_on=cpu) or
    to device prep (normalize_on=device), never both. Computed in place on the float copy,
    x * (1 / (255 std)) + (-mean / std) with the constants precomputed: out-of-place
    arithmetic allocates (and, on the CPU, page-faults) a batch-sized tensor per operation,
    20x the cost of the arithmetic itself for a 64 x 3 x 64 x 64 batch."""

    def __init__(self, mean, std):
        mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1) * 255
        std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1) * 255
        self.mean, self.std = mean, std  # in pixel units (0..255)
        self.scale, self.shift = 1 / std, -mean / std

    def to(self, device) -> Normalize:
        """A copy whose constants live on `device`, so each call does not copy them there."""
        moved = Normalize.__new__(Normalize)
        for k in ("mean", "std", "scale", "shift"):
            setattr(moved, k, getattr(self, k).to(device))
        return moved

    def __call__(self, x: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        scale, shift = self.scale.to(x.device), self.shift.to(x.device)
        return x.to(torch.float32, copy=True).mul_(scale).add_(shift).to(dtype)
