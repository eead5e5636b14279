"""uint8 augmentations driven by an explicit per-sample RNG.

Each sample gets its own numpy Generator seeded from (seed, epoch, index) by the dataset, so
the crop of an image depends on nothing else: not the worker that loads it, not the number
of workers, not the loader strategy, not whether the run was resumed mid-epoch. That is what
makes every loader strategy yield bit-identical batches and makes resume exact.

The crop box follows torchvision's RandomResizedCrop.get_params step by step (ten tries of
a log-uniform ratio and uniform scale, then a centre-crop fallback), so the sampled boxes
have the same distribution; crop + resize is one PIL resize(box=...) call.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

Box = tuple[int, int, int, int]  # left, top, width, height
FloatBox = tuple[float, float, float, float]  # the same, between pixels (the evaluation crop)


def random_resized_crop_box(
    width: int,
    height: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    rng: np.random.Generator,
) -> Box:
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return left, top, w, h
    # Fallback: the whole image, clipped to the ratio range.
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def center_crop_box(width: int, height: int, resize: int, size: int) -> FloatBox:
    """The box of torchvision's Resize(resize) (shorter side) + CenterCrop(size), in source
    pixels: the resized size as torchvision computes it (the longer side int(resize * long /
    short)), the crop's offset rounded in resized pixels (int(round((rw - size) / 2))), and
    both mapped back by that resize's scale per axis. Floats, because rounding to whole
    source pixels moves the box by up to half a pixel at each edge (0.65 output pixels for a
    500x375 photo, 1-1.7 for one under `resize`, upscaled); one resample of this box is
    torchvision's two to within their rounding. A crop larger than the resized image takes
    all of it (torchvision pads it with black)."""
    short, long = min(width, height), max(width, height)
    resized_long = int(resize * long / short)
    rw, rh = (resize, resized_long) if width <= height else (resized_long, resize)
    cw, ch = min(size, rw), min(size, rh)
    left, top = int(round((rw - cw) / 2.0)), int(round((rh - ch) / 2.0))
    sx, sy = width / rw, height / rh
    return left * sx, top * sy, cw * sx, ch * sy


def resized_crop(img: Image.Image, box, size: int, flip: bool = False) -> Image.Image:
    """Crop `box` (left, top, width, height; floats allowed, e.g. a box mapped into a
    DCT-downscaled image) and resize to size x size in one antialiased bilinear resample."""
    left, top, w, h = box
    out = img.resize((size, size), Image.BILINEAR, box=(left, top, left + w, top + h))
    return out.transpose(Image.FLIP_LEFT_RIGHT) if flip else out


# What each transform option must be. Refused here, by name, before any data work: inside
# a worker a crop of size 0 or an empty scale range failed every image, and the run blamed
# the images ("cannot decode ... remove or replace the file"); a negative evaluation size
# failed with a raw traceback only after a whole epoch had trained.
def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _sizes(v) -> bool:
    """One whole number of pixels, or a non-empty list of them (one drawn per sample)."""
    if _whole(v):
        return True
    many = isinstance(v, (list, tuple)) or type(v).__name__ == "ListConfig"
    return many and len(v) > 0 and all(_whole(x) for x in v)


def _range(v) -> bool:
    pair = isinstance(v, (list, tuple)) or type(v).__name__ == "ListConfig"
    if not (pair and len(v) == 2 and all(_number(x) for x in v)):
        return False
    return 0 < v[0] <= v[1]


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


TRANSFORM_OPTIONS = {
    "size": (_whole, "a whole number of pixels >= 1"),
    "resize": (_whole, "a whole number of pixels >= 1 (the shorter side before the crop)"),
    "min_size": (
        _sizes,
        "a whole number of pixels >= 1, or for training a list of them (one drawn per image)",
    ),
    "max_size": (_whole, "a whole number of pixels >= 1"),
    "scale": (_range, "[low, high] with 0 < low <= high (shares of the image's area)"),
    "ratio": (_range, "[low, high] with 0 < low <= high (width / height)"),
    "hflip": (lambda v: _number(v) and 0 <= v <= 1, "a probability in [0, 1]"),
}


def check_transforms(dataset_cfg) -> None:
    """ConfigError naming dataset.<split>_transform.<option> and what it takes."""
    from fastload.errors import ConfigError

    for split in ("train", "val"):
        node = dataset_cfg.get(f"{split}_transform")
        if not hasattr(node, "items"):
            continue
        for key, (ok, use) in TRANSFORM_OPTIONS.items():
            if key in node and not ok(node[key]):
                value = node[key]
                shown = (
                    list(value)
                    if hasattr(value, "__len__") and not isinstance(value, str)
                    else value
                )
                raise ConfigError(f"dataset.{split}_transform.{key}={shown!r}: use {use}.")
        check_sizes(node, split)


def check_sizes(node, split: str) -> None:
    """A detection resize's min_size against its max_size, and one size for evaluation."""
    from fastload.errors import ConfigError

    if "min_size" not in node:
        return
    sizes = [node.min_size] if _whole(node.min_size) else list(node.min_size)
    if split != "train" and len(sizes) > 1:
        raise ConfigError(
            f"dataset.{split}_transform.min_size={sizes}: evaluation resizes every image to one "
            f"size; use one number (torchvision's evaluation takes the last, {sizes[-1]})."
        )
    if "max_size" in node and max(sizes) > node.max_size:
        raise ConfigError(
            f"dataset.{split}_transform.min_size={node.min_size if len(sizes) == 1 else sizes} "
            f"is larger than its max_size={node.max_size} (the longer side's bound): lower "
            f"min_size or raise max_size."
        )


class RandomResizedCropFlip:
    """Training augmentation: RandomResizedCrop(size, scale, ratio) + horizontal flip."""

    def __init__(
        self,
        size: int,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        hflip: float = 0.5,
    ):
        self.size = int(size)
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.hflip = float(hflip)

    def sample(self, width: int, height: int, rng: np.random.Generator) -> tuple[Box, bool]:
        box = random_resized_crop_box(width, height, self.scale, self.ratio, rng)
        return box, bool(rng.random() < self.hflip)

    def __call__(self, img: Image.Image, rng: np.random.Generator) -> Image.Image:
        box, flip = self.sample(img.width, img.height, rng)
        return resized_crop(img, box, self.size, flip)


class ResizeCenterCrop:
    """Evaluation: Resize(resize) of the shorter side + CenterCrop(size), one resample."""

    def __init__(self, size: int, resize: int):
        self.size = int(size)
        self.resize = int(resize)

    def sample(self, width: int, height: int, rng: np.random.Generator) -> tuple[Box, bool]:
        return center_crop_box(width, height, self.resize, self.size), False

    def __call__(self, img: Image.Image, rng: np.random.Generator) -> Image.Image:
        box, _ = self.sample(img.width, img.height, rng)
        return resized_crop(img, box, self.size)
