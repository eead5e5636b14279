"""backend=pil: decode with whichever Pillow is installed (plain or Pillow-SIMD)."""

from __future__ import annotations

import io

import numpy as np
import PIL
from PIL import Image, ImageOps


def pillow_flavour() -> str:
    """'pillow-simd' or 'pillow': Pillow-SIMD versions carry a '.postN' suffix."""
    return "pillow-simd" if ".post" in PIL.__version__ else "pillow"


def open_rgb(data: bytes) -> Image.Image:
    """Decode to an RGB image the way real datasets need: EXIF orientation applied,
    grayscale / CMYK / palette / alpha converted to RGB."""
    img = Image.open(io.BytesIO(data))
    img = ImageOps.exif_transpose(img) if img.getexif().get(0x0112, 1) != 1 else img
    return img if img.mode == "RGB" else img.convert("RGB")


class PILBackend:
    """bytes -> transformed uint8 HWC array."""

    name = "pil"

    def info(self) -> dict:
        return {"decoder": f"{pillow_flavour()}-{PIL.__version__}"}

    def load(self, data: bytes, transform, rng: np.random.Generator) -> np.ndarray:
        img = transform(open_rgb(data), rng)
        return np.array(img, dtype=np.uint8)  # writable copy: torch.from_numpy needs one
