"""backend=pil: decode with whichever Pillow is installed (plain or Pillow-SIMD), through
the project's reference decode `open_rgb` (fastload/decode/base.py).

`draft=true` uses libjpeg's DCT-domain downscale through PIL's `Image.draft()`: the crop box
is sampled on the full-resolution size from the header (same RNG draw, same box as without
draft), then the JPEG is decoded at 1/2, 1/4 or 1/8 scale whenever the box still covers the
output size after that reduction, and the box is mapped into the reduced image.
"""

from __future__ import annotations

import io

import numpy as np
import PIL
from PIL import Image

from fastload.data.transforms import resized_crop
from fastload.decode.base import DecodeBackend, open_rgb, reference_load
from fastload.decode.jpeg_header import Counts, dct_scale


def pillow_flavour() -> str:
    """'pillow-simd' or 'pillow': Pillow-SIMD versions carry a '.postN' suffix."""
    return "pillow-simd" if ".post" in PIL.__version__ else "pillow"


def pillow_name() -> str:
    return f"{pillow_flavour()}-{PIL.__version__}"


class PILBackend(DecodeBackend):
    """bytes -> transformed uint8 HWC array."""

    name = "pil"

    @classmethod
    def libraries(cls, options: dict, facts) -> str:
        try:
            from PIL import features

            turbo = features.version("libjpeg_turbo")
        except Exception:  # an old Pillow without the feature table
            turbo = None
        return (
            f"JPEGs decoded by {pillow_name()} ({f'libjpeg-turbo {turbo}' if turbo else 'libjpeg'})"
        )

    def __init__(self, draft: bool = False):
        self.draft = bool(draft)
        self.counts = Counts("decode_dct_scaled") if self.draft else None

    def info(self) -> dict:
        return {"decoder": pillow_name() + ("+draft" if self.draft else "")}

    def pop_counts(self) -> dict:
        return self.counts.pop() if self.counts is not None else {}

    def load(self, data: bytes, transform, rng: np.random.Generator) -> np.ndarray:
        if not self.draft:
            return reference_load(data, transform, rng)
        img = Image.open(io.BytesIO(data))
        if img.format != "JPEG" or img.mode not in ("RGB", "L") or _rotated(img):
            return np.array(transform(open_rgb(data), rng), dtype=np.uint8)
        box, flip = transform.sample(img.width, img.height, rng)
        s = dct_scale(box, transform.size)
        if s > 1:
            # draft() picks the largest scale whose result is >= the requested size; asking
            # for floor(size / s) makes that exactly s. Output pixel i covers source pixels
            # [i*s, (i+1)*s), so the box maps by 1/s exactly.
            full_width = img.width
            img.draft("RGB", (img.width // s, img.height // s))
            s = _applied_scale(img, full_width)
            box = tuple(v / s for v in box)
            self.counts.add("decode_dct_scaled", int(s > 1))
        img = img if img.mode == "RGB" else img.convert("RGB")
        return np.array(resized_crop(img, box, transform.size, flip), dtype=np.uint8)


def _rotated(img: Image.Image) -> bool:
    return img.getexif().get(0x0112, 1) != 1


def _applied_scale(img: Image.Image, full_width: int) -> int:
    """The reduction draft() configured: Pillow keeps it in decoderconfig; else from sizes
    (the reduced width is ceil(width / s), so rounding the ratio recovers s)."""
    config = getattr(img, "decoderconfig", None)
    if config and int(config[0]) in (1, 2, 4, 8):
        return int(config[0])
    return max(1, round(full_width / img.width))
