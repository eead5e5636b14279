"""backend=turbo: libjpeg-turbo through simplejpeg, straight to a numpy array, with
DCT-domain downscaling.

Per image: read the header (size, components, EXIF orientation), sample the crop box on the
full-resolution size (the same RNG draw, hence the same box, as backend=pil), pick the
largest reduction s in {8, 4, 2} after which the box still covers the output size, decode at
1/s (libjpeg-turbo skips most of the IDCT work), map the box by 1/s and do the one
antialiased bilinear crop+resize of the PIL path. Where simplejpeg cannot give the reference
image (not a JPEG, CMYK/YCCK, EXIF-rotated) or fails, the image goes through PIL's
`open_rgb` with the same box, and the fallback is counted by reason.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from fastload.data.transforms import resized_crop
from fastload.decode.jpeg_header import (
    FALLBACK_REASONS,
    Counts,
    dct_scale,
    fallback_reason,
    jpeg_info,
)
from fastload.decode.pil import load_with_box, pillow_name, reference_load
from fastload.errors import ConfigError


def import_simplejpeg():
    try:
        import simplejpeg
    except ImportError:
        raise ConfigError(
            "backend=turbo needs simplejpeg (libjpeg-turbo bindings with wheels for Linux, "
            "macOS and Windows): pip install simplejpeg"
        ) from None
    return simplejpeg


class TurboBackend:
    name = "turbo"

    def __init__(self, dct_scale: bool = True, fastdct: bool = False, fastupsample: bool = False):
        self.simplejpeg = import_simplejpeg()
        self.dct_scale = bool(dct_scale)
        self.fastdct = bool(fastdct)
        self.fastupsample = bool(fastupsample)
        self.counts = Counts(
            "decode_dct_scaled", *(f"decode_fallback_{r}" for r in FALLBACK_REASONS)
        )

    def __getstate__(self):  # a module cannot be pickled (spawn-started workers)
        return {k: v for k, v in self.__dict__.items() if k != "simplejpeg"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.simplejpeg = import_simplejpeg()

    def info(self) -> dict:
        return {
            "decoder": f"simplejpeg-{self.simplejpeg.__version__}",
            "decoder_fallback": pillow_name(),
        }

    def pop_counts(self) -> dict:
        return self.counts.pop()

    def load(self, data: bytes, transform, rng: np.random.Generator) -> np.ndarray:
        info = jpeg_info(data)
        reason = fallback_reason(info)
        if reason is not None:
            self.counts.add(f"decode_fallback_{reason}")
            return reference_load(data, transform, rng)
        box, flip = transform.sample(info.width, info.height, rng)
        s = dct_scale(box, transform.size) if self.dct_scale else 1
        try:
            pixels = self.simplejpeg.decode_jpeg(
                data,
                colorspace="RGB",
                fastdct=self.fastdct,
                fastupsample=self.fastupsample,
                min_height=math.ceil(info.height / s),
                min_width=math.ceil(info.width / s),
                min_factor=s,
            )
        except (ValueError, RuntimeError):
            self.counts.add("decode_fallback_decode_error")
            return load_with_box(data, box, flip, transform.size)
        if s > 1:
            # The decoded width is ceil(width / s); recover s from it (robust to simplejpeg
            # picking another factor), then map the box: output pixel i covers [i*s, (i+1)*s).
            s = max(1, round(info.width / pixels.shape[1]))
            box = tuple(v / s for v in box)
            self.counts.add("decode_dct_scaled", int(s > 1))
        img = resized_crop(Image.fromarray(pixels), box, transform.size, flip)
        return np.array(img, dtype=np.uint8)
