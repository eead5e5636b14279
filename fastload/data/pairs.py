"""Super-resolution samples: aligned (LR, HR) patch pairs, and their batches.

A record is an HR image (its `image` field) and, when the layout has LR files, its LR image
(its `lr` field: DIV2K's `DIV2K_<split>_LR_bicubic/X<scale>/0001x2.png`). Without LR
files (`dataset.layout.lr=null`, any image folder) the LR patch is made from the HR patch by
PIL's bicubic downscale (antialiased, like MATLAB's imresize that made DIV2K's LR images).
Encoded records decode through the backend's `decode_rgb` (PNG through PIL); raw-pixel
records (packed with `--kind raw`) are used as they are.

Patches: the LR patch is `patch_size` pixels square and the HR patch the same place times
`scale` (LR pixel (y, x) covers HR pixels [y*s, (y+1)*s) x [x*s, (x+1)*s)). Training draws
the position, a flip and a quarter turn from the sample's RNG (`sample_rng(seed, epoch,
index)`), the same for both images; evaluation takes the centre patch, so the metric is
deterministic. `repeat` draws that many patches per image per epoch (index = repeat * image
+ k): a 2K image gives more than one 96-px patch.

Sizes: an LR image must be its HR image's size divided by the scale, rounded down (DIV2K,
Pillow) or up (MATLAB's imresize); anything else is a pair that does not belong together or
a wrong `dataset.scale`, refused naming both files (dataset.skip_corrupt does not skip it).

A sample is `(lr, hr)` or `(lr, hr, counts)`: uint8 CHW tensors (lr float when normalised in
the workers); `collate_pairs` stacks them into IMAGE (LR, N x 3 x p x p) and TARGET (HR,
N x 3 x ps x ps, uint8), keeping the batch contract of fastload/data/batch.py.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from fastload.data import rawimage
from fastload.data.batch import (
    IMAGE,
    SKIPPED,
    TARGET,
    Skipped,
    put_optional,
    stack_images,
    sum_counts,
)
from fastload.data.dataset import sample_rng
from fastload.errors import CorruptImageError, DatasetError


def bicubic_down(hr: np.ndarray, scale: int) -> np.ndarray:
    """HWC uint8 -> (H // scale, W // scale) by PIL's antialiased bicubic, over exactly the
    HR pixels the LR grid covers (so LR pixel (y, x) stays aligned with HR (y*s, x*s))."""
    h, w = hr.shape[0] // scale, hr.shape[1] // scale
    img = Image.fromarray(np.ascontiguousarray(hr), "RGB")
    return np.asarray(img.resize((w, h), Image.BICUBIC, box=(0, 0, w * scale, h * scale)))


def check_pair_size(hr_hw, lr_hw, scale: int, hr_where: str, lr_where: str) -> None:
    """The LR image is the HR image / scale (rounded down or up), else DatasetError."""
    ok = all(lo in (hi // scale, -(-hi // scale)) for hi, lo in zip(hr_hw, lr_hw, strict=True))
    if not ok:
        (H, W), (h, w) = hr_hw, lr_hw
        raise DatasetError(
            f"LR image {lr_where} is {w}x{h} px but its HR image {hr_where} is {W}x{H} px: at "
            f"dataset.scale={scale} the LR image must be {W // scale}x{H // scale}. Set "
            f"dataset.scale to the LR folder's scale (X{scale} = {scale}), or replace the pair."
        )


def augment(lr: np.ndarray, hr: np.ndarray, rng: np.random.Generator):
    """The same random quarter turn and horizontal flip of both patches (8 orientations)."""
    turns, flip = int(rng.integers(4)), bool(rng.random() < 0.5)
    lr, hr = np.rot90(lr, turns), np.rot90(hr, turns)
    if flip:
        lr, hr = lr[:, ::-1], hr[:, ::-1]
    return lr, hr


def chw(pixels: np.ndarray) -> torch.Tensor:
    """HWC -> a CHW tensor view of a contiguous, writable copy (the patch of a read-only
    decoded or memory-mapped image is copied once here; torch refuses read-only arrays)."""
    return torch.from_numpy(np.require(pixels, requirements=["C", "W"])).permute(2, 0, 1)


class PairDataset(torch.utils.data.Dataset):
    """(epoch, index) keys -> (LR patch, HR patch); see the module doc."""

    def __init__(
        self,
        reader,
        backend,
        *,
        scale: int,
        patch_size: int,
        train: bool,
        seed: int,
        repeat: int = 1,
        skip_corrupt: bool = False,
        normalize=None,
    ):
        self.reader, self.backend = reader, backend
        self.scale, self.patch_size, self.train = int(scale), int(patch_size), bool(train)
        self.seed, self.repeat = int(seed), int(repeat)
        self.skip_corrupt = skip_corrupt
        self.normalize = normalize  # normalize_on=cpu: the LR input only (HR is the target)
        self.paired = reader.has("lr")

    def __len__(self) -> int:
        return len(self.reader) * self.repeat

    def where(self, i: int, lr: bool = False) -> str:
        return self.reader.describe(i, "lr" if lr else "image")

    def decode(self, data, i: int, lr: bool = False) -> np.ndarray:
        if rawimage.is_raw(data):
            return rawimage.pixels(data)  # packed pixels: nothing to decode
        try:
            return self.backend.decode_rgb(data)
        except Exception as exc:  # any decoder's failure on bad bytes
            self.backend.pop_counts()  # counted as skipped, not as a fallback
            if self.skip_corrupt:
                raise _Skip(self.where(i, lr)) from None
            raise CorruptImageError(
                f"cannot decode image {self.where(i, lr)} ({type(exc).__name__}: {exc}). "
                f"Remove or replace the file, or set dataset.skip_corrupt=true to skip and "
                f"count such files."
            ) from None

    def __getitem__(self, key):
        epoch, index = key if isinstance(key, tuple) else (0, key)
        i = index // self.repeat
        self.reader.epoch = epoch  # its reads count in this epoch's row
        hr_data = self.reader.get(i, "image")
        lr_data = self.reader.get(i, "lr") if self.paired else None
        try:
            hr = self.decode(hr_data, i)
            lr = None if lr_data is None else self.decode(lr_data, i, lr=True)
        except _Skip as skip:
            return Skipped(skip.where)
        counts = self.backend.pop_counts()
        lr, hr = self.patches(hr, lr, i, sample_rng(self.seed, epoch, index))
        lr, hr = chw(lr), chw(hr)
        if self.normalize is not None:
            lr = self.normalize(lr)
        return (lr, hr, counts) if counts else (lr, hr)

    def patches(self, hr: np.ndarray, lr: np.ndarray | None, i: int, rng):
        """The aligned (LR, HR) patch pair of record i: random (train) or central (val)."""
        s, p = self.scale, self.patch_size
        if lr is not None:
            check_pair_size(hr.shape[:2], lr.shape[:2], s, self.where(i), self.where(i, True))
        # An LR image rounded up (MATLAB) has a last row/column with no whole HR cell.
        lh, lw = hr.shape[0] // s, hr.shape[1] // s
        if lh < p or lw < p:
            raise DatasetError(
                f"{self.where(i)} is {hr.shape[1]}x{hr.shape[0]} px: at dataset.scale={s} its "
                f"LR image ({lw}x{lh}) is smaller than the patch (dataset.patch_size={p}). "
                f"Lower dataset.patch_size (and dataset.val_patch_size), or remove the image."
            )
        if self.train:
            y, x = int(rng.integers(lh - p + 1)), int(rng.integers(lw - p + 1))
        else:
            y, x = (lh - p) // 2, (lw - p) // 2
        hr_patch = hr[y * s : (y + p) * s, x * s : (x + p) * s]
        lr_patch = bicubic_down(hr_patch, s) if lr is None else lr[y : y + p, x : x + p]
        if self.train:
            lr_patch, hr_patch = augment(lr_patch, hr_patch, rng)
        return lr_patch, hr_patch


class _Skip(Exception):
    """A corrupt image left out (dataset.skip_corrupt): where it lives."""

    def __init__(self, where: str):
        super().__init__(where)
        self.where = where


def collate_pairs(samples: list) -> dict:
    """(LR, HR[, counts]) samples -> {IMAGE: LR uint8 NCHW, TARGET: HR uint8 NCHW, ...}, the
    keys of fastload/data/batch.py; skipped samples are counted and named, not batched."""
    kept = [s for s in samples if isinstance(s, tuple)]
    batch = {SKIPPED: len(samples) - len(kept), IMAGE: None, TARGET: None}
    gone = [s.where for s in samples if isinstance(s, Skipped)]
    put_optional(batch, sum_counts(s[2] for s in kept if len(s) > 2), gone)
    if kept:
        # stack_images stacks straight into shared memory inside a worker (no extra copy)
        batch[IMAGE] = stack_images([s[0] for s in kept])
        batch[TARGET] = stack_images([s[1] for s in kept])
    return batch
