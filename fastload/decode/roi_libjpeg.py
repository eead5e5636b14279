"""Region decode through the libjpeg-turbo release that Pillow ships (backend.roi=libjpeg).

`_jpeg_region.c` is a ~250-line C extension built at install time (it needs a C compiler and
libjpeg's headers: Debian's libjpeg62-turbo-dev). It brings no JPEG library of its own: it
binds at run time to the libjpeg that Pillow's `_imaging` loaded (found in /proc/self/maps;
Pillow's wheels bundle a libjpeg-turbo release and update it with every Pillow release) and
drives libjpeg's API directly:

* the region's rows are written straight into the output array (no intermediate buffer, no
  per-line copy), from an iMCU boundary on the left (jpeg_crop_scanline), rows above skipped
  (jpeg_skip_scanlines), rows below never decoded;
* DCT scaling by 1/2, 1/4, 1/8 applies to the region in the same pass (a box twice the output
  size decodes a region at 1/s, not the whole image). libjpeg's other M/8 scales are not
  used: their IDCTs have no SIMD code, so on the synthetic set (~400x380 px) a whole image
  took 1.25x (5/8), 1.36x (6/8) and 1.8x (7/8) the time of a full-size decode (1/2: 0.77x);
* libjpeg's warnings ("Corrupt JPEG data") end the decode as errors and print nothing, so a
  damaged file takes the whole-image path, which names it;
* ~2 us of fixed cost per call, the GIL released while libjpeg runs.

Only a libjpeg-turbo release >= 3.0.0 is used: an older or pre-release library (libjpeg-turbo
numbers its betas x.y.9x) leaves this decoder unavailable, with the reason.
"""

from __future__ import annotations

import math
import os
import re

import numpy as np

from fastload.decode.roi import RoiDecodeError, columns_for, rows_for

MIN_VERSION = (3, 0, 0)
BUILD_HINT = (
    "fastload's region decoder (fastload/decode/_jpeg_region.c) is not built: install a C "
    "compiler and libjpeg's headers (Debian/Ubuntu: apt-get install gcc libjpeg62-turbo-dev; "
    "Fedora: dnf install gcc libjpeg-turbo-devel), then pip install -e . again"
)
UNAVAILABLE_REASON = ""
# iMCU width is at most 32 px (4:1:1 at full size): a region's left edge moves left by less.
ALIGN_SLACK = 32
# Every box decodes as a region, however tall (~2 us of fixed cost a call, no copies): sending
# boxes spanning 80 % or 100 % of the rows to a whole-image decode instead measured within
# 1 % (noise) on both benchmark sets, one core, 11 rounds; so the simplest rule.
TALL_SHARE = math.inf

_EXT = None
_LOADED = False
_LIBRARY: tuple[str, str] | None = None  # (path, version)


def pillow_libjpeg() -> tuple[str, str]:
    """(path, libjpeg-turbo version) of the libjpeg Pillow loaded; ImportError naming why
    there is none to use."""
    from PIL import Image, features  # noqa: F401  (Image loads _imaging and its libjpeg)

    version = features.version("libjpeg_turbo")
    if not version:
        raise ImportError(f"Pillow {features.version('pil')} is not built with libjpeg-turbo")
    # libjpeg-turbo's patch releases may carry a fourth number (Pillow 12.3: 3.1.4.1)
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(?:\.\d+)?", version)
    if m is None or tuple(map(int, m.groups())) < MIN_VERSION or int(m.group(3)) >= 90:
        raise ImportError(
            f"Pillow's libjpeg-turbo is {version}, not a release >= "
            f"{'.'.join(map(str, MIN_VERSION))}: pip install -U pillow"
        )
    try:
        with open("/proc/self/maps") as f:
            mapped = {line.split()[-1] for line in f if "libjpeg" in line and ".so" in line}
    except OSError:
        raise ImportError("no /proc/self/maps to find Pillow's libjpeg (Linux only)") from None
    pil_root = os.path.dirname(os.path.dirname(Image.__file__))
    jpeg62 = sorted(p for p in mapped if re.search(r"/libjpeg[^/]*\.so\.62", p))
    ours = [p for p in jpeg62 if p.startswith(pil_root + os.sep)]
    if not (ours or jpeg62):
        raise ImportError(f"Pillow {features.version('pil')} loaded no libjpeg.so.62")
    return (ours or jpeg62)[0], version


def load():
    """The bound extension module, or None (the reason in UNAVAILABLE_REASON). Once per
    process."""
    global _EXT, _LOADED, _LIBRARY, UNAVAILABLE_REASON
    if _LOADED:
        return _EXT
    _LOADED = True
    try:
        from fastload.decode import _jpeg_region
    except ImportError:
        UNAVAILABLE_REASON = BUILD_HINT
        return None
    try:
        path, version = pillow_libjpeg()
        _jpeg_region.load(path)
        _self_test(_jpeg_region)
    except ImportError as e:
        UNAVAILABLE_REASON = str(e)
        return None
    _EXT, _LIBRARY = _jpeg_region, (path, version)
    return _EXT


def _self_test(ext) -> None:
    """One small decode through the bound library, compared with PIL's: a library whose ABI
    does not match the headers the extension was built with (libjpeg checks its version and
    struct size) fails here once, not on every image."""
    import io

    from PIL import Image

    rgb = np.zeros((16, 32, 3), np.uint8)
    rgb[:, 16:] = (200, 40, 90)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=95, subsampling=0)
    out = np.empty(16 * 32 * 3, np.uint8)
    try:
        got = ext.decode(buf.getvalue(), out, 1, 16, 0, 32, 16)
    except ext.RegionError as e:
        raise ImportError(f"fastload's region decoder failed its self-test: {e}") from None
    want = np.asarray(Image.open(buf).convert("RGB"))[:, 16:]
    if got[:4] != (16, 0, 16, 16) or not np.array_equal(
        out[: 16 * 16 * 3].reshape(want.shape), want
    ):
        raise ImportError(f"fastload's region decoder failed its self-test (got region {got[:4]})")


def library_version() -> str | None:
    """The libjpeg-turbo version the decoder is bound to, or None when it is not loaded."""
    return _LIBRARY[1] if load() is not None else None


class Decoder:
    """Picklable: the extension is bound again in each worker process."""

    def __init__(self, fastdct: bool = False, fastupsample: bool = False):
        ext = load()
        if ext is None:
            raise ImportError(UNAVAILABLE_REASON)
        self.ext = ext
        self.fastdct, self.fastupsample = bool(fastdct), bool(fastupsample)
        self.version = _LIBRARY[1]
        self.name = f"libjpeg-turbo-{self.version} ROI"
        self.tall_share = TALL_SHARE
        self.scales = (1, 2, 4, 8)

    def __getstate__(self):
        return {"fastdct": self.fastdct, "fastupsample": self.fastupsample}

    def __setstate__(self, state):
        self.__init__(**state)

    def region(self, data: bytes, width: int, height: int, box, size: int, scale: int = 1):
        """(the decoded region, `box` mapped into it) for a crop of `box` (in full-size
        pixels) to `size` px of a width x height JPEG (its parsed header), decoded at
        1/`scale`; RoiDecodeError when libjpeg refuses the data."""
        sw, sh = math.ceil(width / scale), math.ceil(height / scale)
        if scale > 1:
            box = tuple(v / scale for v in box)  # output pixel i covers [i*s, (i+1)*s)
        y0, y1 = rows_for(box, sh, size)
        x0, x1 = columns_for(box, sw, size)
        out = np.empty((y1 - y0) * (x1 - x0 + ALIGN_SLACK) * 3, np.uint8)
        try:
            x, y, w, h, got_w, got_h = self.ext.decode(
                data, out, scale, x0, y0, x1, y1, self.fastdct, self.fastupsample
            )
        except self.ext.RegionError as e:
            raise RoiDecodeError(str(e)) from None
        if (got_w, got_h) != (sw, sh):
            raise RoiDecodeError(f"decoded {got_w}x{got_h} at 1/{scale}, header {width}x{height}")
        left, top, bw, bh = box
        return out[: w * h * 3].reshape(h, w, 3), (left - x, top - y, bw, bh)
