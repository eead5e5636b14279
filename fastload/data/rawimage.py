"""A tiny self-describing record of decoded pixels: what raw-pixel shards store and return.

    b"FLRAW1" | height uint16 | width uint16 | channels uint8 | pad | H*W*C uint8 (HWC)

A storage returns such bytes from `read(i)` like any encoded image; the dataset recognises
the magic and skips the decode (there is nothing to decode): the backend's `load_pixels`
applies the same uint8 transform to the stored image, so RandomResizedCrop keeps its
semantics on it.
"""

from __future__ import annotations

import struct

import numpy as np
from PIL import Image

MAGIC = b"FLRAW1"
_HEADER = struct.Struct("<6sHHBx")  # 12 bytes
HEADER_SIZE = _HEADER.size


def is_raw(data) -> bool:
    return bytes(data[: len(MAGIC)]) == MAGIC


def encode(pixels: np.ndarray) -> bytes:
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"raw records hold HxWx3 uint8 pixels, got {pixels.shape} {pixels.dtype}")
    h, w, c = pixels.shape
    return _HEADER.pack(MAGIC, h, w, c) + np.ascontiguousarray(pixels).tobytes()


def shape(data) -> tuple[int, int, int]:
    magic, h, w, c = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ValueError("not a fastload raw record")
    if len(data) != HEADER_SIZE + h * w * c:
        raise ValueError(f"raw record of {h}x{w}x{c} has {len(data) - HEADER_SIZE} pixel bytes")
    return h, w, c


def to_image(data) -> Image.Image:
    """A PIL view of the record's pixels (no decode, no copy)."""
    h, w, _ = shape(data)
    return Image.frombuffer("RGB", (w, h), memoryview(data)[HEADER_SIZE:], "raw", "RGB", 0, 1)


def pixels(data) -> np.ndarray:
    """The record's HWC uint8 pixels: a read-only view of `data` (no copy)."""
    h, w, c = shape(data)
    return np.frombuffer(memoryview(data)[HEADER_SIZE:], np.uint8).reshape(h, w, c)
