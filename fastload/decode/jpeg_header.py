"""What the JPEG-only decoders need to know before decoding, read from the header alone.

libjpeg-turbo (turbo, accimage) and nvJPEG decode baseline and progressive YCbCr/grayscale
JPEGs, but ignore EXIF orientation and cannot give RGB from CMYK/YCCK. `fallback_reason`
says when an image must go through PIL's `open_rgb` instead; the walk over the marker
segments costs microseconds (no entropy-coded data is touched).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

# SOFn markers that start a frame (C4 = DHT, C8 = JPG, CC = DAC are not frames).
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_PROGRESSIVE = {0xC2, 0xC6, 0xCA, 0xCE}

FALLBACK_REASONS = ("not_jpeg", "cmyk", "exif_rotated", "unterminated", "decode_error")


@dataclass(frozen=True)
class JpegInfo:
    width: int
    height: int
    components: int  # 1 grayscale, 3 YCbCr/RGB, 4 CMYK/YCCK
    progressive: bool
    orientation: int  # EXIF orientation, 1 = upright (also when there is no EXIF)
    scan: int = 0  # offset of the first start-of-scan marker: the entropy-coded data follows

    def terminated(self, data: bytes) -> bool:
        """Whether an end-of-image marker follows the scan: one cut short has none (byte
        stuffing keeps FF D9 out of entropy-coded data). Bytes after the marker (padding,
        an appended second image) are allowed, as every decoder allows them."""
        return data.rfind(b"\xff\xd9", self.scan) >= 0


def jpeg_info(data: bytes) -> JpegInfo | None:
    """The frame header and EXIF orientation of a JPEG; None for anything else (PNG, GIF,
    a truncated or garbled header). The orientation is PIL's: the first EXIF block's (PIL
    appends later blocks to it, so its first directory stays the one read), else the last
    XMP packet's (each replaces the one before); markers are read up to the scan, as PIL
    does, so an EXIF block after the frame header counts too."""
    if data[:2] != b"\xff\xd8":
        return None
    exif = xmp = frame = None
    exif_seen = False
    i, n = 2, len(data)
    scan = n
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # standalone markers
            i += 2
            continue
        if marker == 0xDA:  # start of scan: the header is complete
            scan = i
            break
        (length,) = struct.unpack_from(">H", data, i + 2)
        seg = i + 4
        if marker == 0xE1 and data[seg : seg + 6] == b"Exif\x00\x00":
            if not exif_seen:
                exif, exif_seen = _exif_orientation(data[seg + 6 : i + 2 + length]), True
        elif marker == 0xE1 and data[seg : seg + len(_XMP)] == _XMP:
            found = _XMP_ORIENTATION.search(data, seg + len(_XMP), i + 2 + length)
            xmp = int(found[2]) if found else None
        elif marker in _SOF and frame is None:
            if seg + 6 > n:
                return None
            _, height, width, comps = struct.unpack_from(">BHHB", data, seg)
            if width == 0 or height == 0:
                return None
            frame = (width, height, comps, marker in _PROGRESSIVE)
        i += 2 + length
    if frame is None:  # a scan before any frame header, or none at all
        return None
    orientation = exif if exif is not None else xmp if xmp is not None else 1
    return JpegInfo(*frame, orientation if 1 <= orientation <= 8 else 1, scan)


# Pillow reads an XMP packet's tiff:Orientation when the EXIF has none (Image.getexif), and
# PIL's reference decode rotates by it: so must the header's answer.
_XMP = b"http://ns.adobe.com/xap/1.0/\x00"
_XMP_ORIENTATION = re.compile(rb'tiff:Orientation(="|>)([0-9])')


def _exif_orientation(tiff: bytes) -> int | None:
    """The orientation tag of an EXIF block, None without one. Its value is read by its
    type: a SHORT in the first two bytes of the value field, a LONG in all four (the first
    two of a big-endian LONG are its high half)."""
    if tiff.startswith(b"Exif\x00\x00"):  # written twice by some tools; PIL reads past it
        tiff = tiff[6:]
    try:
        endian = {b"II": "<", b"MM": ">"}[tiff[:2]]
        (ifd,) = struct.unpack_from(endian + "I", tiff, 4)
        (count,) = struct.unpack_from(endian + "H", tiff, ifd)
        for k in range(count):
            entry = ifd + 2 + 12 * k
            tag, kind = struct.unpack_from(endian + "HH", tiff, entry)
            if tag == 0x0112:
                (value,) = struct.unpack_from(endian + ("I" if kind == 4 else "H"), tiff, entry + 8)
                return value
    except (KeyError, struct.error):
        pass
    return None


def fallback_reason(info: JpegInfo | None, data: bytes | None = None) -> str | None:
    """Why a libjpeg-style JPEG->RGB decoder cannot produce the reference image, or None.
    With `data`, also a file cut short (`unterminated`): a region decode stops reading below
    its box, so crops above the cut decoded and the others failed (a damaged file trained
    on now and then, or a run stopped epochs in), and decoders differ in what they make of
    the missing rows; PIL, the reference, refuses the file, and so it goes there."""
    if info is None:
        return "not_jpeg"
    if info.components not in (1, 3):
        return "cmyk"
    if info.orientation != 1:
        return "exif_rotated"
    if data is not None and not info.terminated(data):
        return "unterminated"
    return None


def dct_scale(box, size: int) -> int:
    """The largest DCT-domain reduction (8, 4, 2, else 1) after which the crop box still
    covers `size` pixels in both directions, so the final resize still only shrinks."""
    _, _, w, h = box
    for s in (8, 4, 2):
        if w >= s * size and h >= s * size:
            return s
    return 1


class Counts:
    """Per-process counters a backend reports through the dataset: `pop()` returns the
    increments since the last call (every key, zeros included, so each batch carries the
    same keys and the engine can reduce them across ranks)."""

    def __init__(self, *keys: str):
        self._zero = dict.fromkeys(keys, 0)
        self._counts = dict(self._zero)

    def add(self, key: str, n: int = 1) -> None:
        self._counts[key] += n

    def pop(self) -> dict:
        out, self._counts = self._counts, dict(self._zero)
        return out
