"""The sample path inside a worker: storage -> decode -> uint8 augment (-> CPU normalise)."""

from __future__ import annotations

import numpy as np
import torch

from fastload.errors import CorruptImageError


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
        try:
            pixels = self.backend.load(data, self.transform, sample_rng(self.seed, epoch, index))
        except Exception as exc:  # any decoder's failure on bad bytes
            if self.skip_corrupt:
                return None
            raise CorruptImageError(
                f"cannot decode image {self.storage.describe(index)} ({type(exc).__name__}: "
                f"{exc}). Remove or replace the file, or set dataset.skip_corrupt=true to skip "
                f"and count such files."
            ) from None
        image = torch.from_numpy(pixels).permute(2, 0, 1)  # CHW view of HWC uint8
        if self.normalize is not None:
            image = self.normalize(image)
        return image, target


def collate(samples: list) -> dict:
    """One contiguous NCHW batch; skipped (corrupt) samples are dropped and counted."""
    kept = [s for s in samples if s is not None]
    if not kept:
        return {"image": None, "target": None, "skipped": len(samples)}
    images = torch.stack([s[0] for s in kept])
    targets = torch.tensor([s[1] for s in kept], dtype=torch.int64)
    return {"image": images, "target": targets, "skipped": len(samples) - len(kept)}


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
