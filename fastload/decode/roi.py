"""Region-of-interest JPEG decode for backend=turbo: which decoder, and which region.

RandomResizedCrop keeps about half of the image area on average, so most of a whole-image
decode is wasted. A region decode skips it: rows above the region are only entropy-decoded,
rows below it are never read, columns outside it skip IDCT, upsampling and colour conversion
(libjpeg's jpeg_skip_scanlines / jpeg_crop_scanline).

Two decoders give the same pixels (`backend.roi` picks; `auto` / `on` take the first that
loads: roi_decoders.py):

* `libjpeg` (roi_libjpeg.py): fastload's small C extension over the libjpeg-turbo release
  that Pillow ships (3.2 with Pillow 13): it writes the region's rows straight into the
  output array and can DCT-scale the region in the same pass. Built at install time where
  a C compiler and libjpeg's headers are present.
* `nvimgcodec` (roi_nvimgcodec.py): NVIDIA nvImageCodec's CPU decoder (libjpeg-turbo 3.1
  inside, a pip wheel, no compiler needed); 10-18 % slower a sample (its per-call set-up and
  copies) and no DCT scaling.

Pixel contract: decoding a region gives the pixels of the whole-image decode except in the
region's first and last columns and rows, where chroma upsampling lacks its neighbour
(up to +-16 levels there only). `region_for` pads the region by a margin the crop never
samples, so the crop of a region equals the crop of the whole image exactly.
"""

from __future__ import annotations

import math


class RoiDecodeError(ValueError):
    """The region decoder refused the image (corrupt data, an unsupported layout)."""


def margins(box, size: int) -> tuple[int, int]:
    """Pixels kept around the box on each side (x, y): the crop's antialias step averages
    floor(w / size) pixel blocks and its bilinear step reads one pixel beyond the box, and
    the region's outer columns differ from a full decode (upsampling context); kx + 2
    pixels keep all three inside."""
    _, _, w, h = box
    return max(1, int(w / size)) + 2, max(1, int(h / size)) + 2


def rows_for(box, height: int, size: int) -> tuple[int, int]:
    """The first and one-past-last image row a region for `box` needs."""
    _, my = margins(box, size)
    top, h = box[1], box[3]
    return max(0, math.floor(top) - my), min(height, math.ceil(top + h) + my)


def columns_for(box, width: int, size: int) -> tuple[int, int]:
    """The first and one-past-last image column a region for `box` needs (before the
    decoder aligns the first one down to an iMCU boundary)."""
    mx, _ = margins(box, size)
    left, w = box[0], box[2]
    return max(0, math.floor(left) - mx), min(width, math.ceil(left + w) + mx)


def worth_a_region(box, height: int, size: int, tall_share: float) -> bool:
    """Whether decoding a region beats the whole image for this box: not when it spans
    `tall_share` of the rows or more (the decoder's measured break-even)."""
    y0, y1 = rows_for(box, height, size)
    return y1 - y0 < tall_share * height


def region_for(box, width: int, height: int, size: int, mcu: int, band_share: float = 2.0):
    """The decode region (x, y, w, h) that holds everything the crop of `box` (left, top,
    width, height) to `size` px samples, and the box mapped into that region: columns from
    an iMCU boundary (where libjpeg-turbo can start a row), or whole rows when the region
    would span `band_share` of the width or more."""
    left, top, w, h = box
    y0, y1 = rows_for(box, height, size)
    x0, x1 = columns_for(box, width, size)
    x0 = x0 // mcu * mcu
    if x1 - x0 >= band_share * width:
        x0, x1 = 0, width
    return (x0, y0, x1 - x0, y1 - y0), (left - x0, top - y0, w, h)
