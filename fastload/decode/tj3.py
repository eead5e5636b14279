"""Region-of-interest JPEG decode through libjpeg-turbo's TurboJPEG 3 API (ctypes).

TurboJPEG 3 (libjpeg-turbo >= 3.0) decompresses a *cropping region* of the (DCT-scaled)
image: rows above the region are skipped without IDCT, rows below are not touched at all,
and columns outside it skip IDCT, upsampling and colour conversion. RandomResizedCrop keeps
about half of the image area on average, so most of that work was wasted before.

Where the library comes from, first found wins:

1. `$FASTLOAD_LIBTURBOJPEG`: a path to libturbojpeg.so (>= 3.0), e.g. a system build;
2. the `turbojpeg` wheel from PyPI (a project dependency on Linux x86_64, Python 3.9-3.13),
   which bundles libturbojpeg 3 in `turbojpeg.libs/`; only its shared library is used;
3. the system's `libturbojpeg` (`ctypes.util.find_library`), if it is version 3 or newer
   (Debian bookworm ships 2.1: no cropping region, so it does not qualify).

None found: `load()` returns None with the reason in `UNAVAILABLE_REASON`, and
backend=turbo decodes whole images with simplejpeg as before (counted per image).

Pixel contract: decoding a region gives the same pixels as decoding the whole image and
cutting the region out, except in the region's first and last column where the horizontal
chroma upsampling lacks its neighbour (measured: up to +-6 levels in those columns only).
`region_for` therefore pads the region by a margin the crop never samples, and aligns its
left edge to the scaled iMCU width, as TurboJPEG requires.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import math
import os
import threading

import numpy as np

# TurboJPEG 3 constants (turbojpeg.h of libjpeg-turbo 3.0).
TJINIT_DECOMPRESS = 1
TJPARAM_SUBSAMP = 4
TJPARAM_JPEGWIDTH = 5
TJPARAM_JPEGHEIGHT = 6
TJPARAM_FASTUPSAMPLE = 9
TJPARAM_FASTDCT = 10
TJPF_RGB = 0
# iMCU width in pixels per chroma subsampling (TJSAMP_444, 422, 420, GRAY, 440, 411, 441).
MCU_WIDTH = (8, 16, 16, 8, 8, 32, 8)

ENV_VAR = "FASTLOAD_LIBTURBOJPEG"
UNAVAILABLE_REASON = ""


class _Scaling(ctypes.Structure):
    _fields_ = [("num", ctypes.c_int), ("denom", ctypes.c_int)]


class _Region(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_int), ("w", ctypes.c_int), ("h", ctypes.c_int)]


class RoiDecodeError(ValueError):
    """TurboJPEG refused the image (corrupt data, an unsupported layout)."""


def _candidates() -> list[str]:
    paths = []
    if os.environ.get(ENV_VAR):
        paths.append(os.environ[ENV_VAR])
    spec = importlib.util.find_spec("turbojpeg")
    if spec is not None and spec.origin:
        libs = os.path.join(os.path.dirname(spec.origin), "turbojpeg.libs")
        paths += sorted(glob.glob(os.path.join(libs, "libturbojpeg*.so*")))
    system = ctypes.util.find_library("turbojpeg")
    if system:
        paths.append(system)
    return paths


def _bind(lib) -> None:
    c_void_p, c_int, c_char_p, c_size_t = (
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_size_t,
    )
    lib.tj3Init.restype, lib.tj3Init.argtypes = c_void_p, [c_int]
    lib.tj3Destroy.restype, lib.tj3Destroy.argtypes = None, [c_void_p]
    lib.tj3Set.restype, lib.tj3Set.argtypes = c_int, [c_void_p, c_int, c_int]
    lib.tj3Get.restype, lib.tj3Get.argtypes = c_int, [c_void_p, c_int]
    lib.tj3DecompressHeader.restype = c_int
    lib.tj3DecompressHeader.argtypes = [c_void_p, c_char_p, c_size_t]
    lib.tj3SetScalingFactor.restype, lib.tj3SetScalingFactor.argtypes = c_int, [c_void_p, _Scaling]
    lib.tj3SetCroppingRegion.restype, lib.tj3SetCroppingRegion.argtypes = c_int, [c_void_p, _Region]
    lib.tj3Decompress8.restype = c_int
    lib.tj3Decompress8.argtypes = [c_void_p, c_char_p, c_size_t, c_void_p, c_int, c_int]
    lib.tj3GetErrorStr.restype, lib.tj3GetErrorStr.argtypes = c_char_p, [c_void_p]


_LIB: tuple[ctypes.CDLL, str] | None = None
_LOADED = False


def load() -> tuple[ctypes.CDLL, str] | None:
    """(library, its path), or None (the reason in UNAVAILABLE_REASON). Cached per process."""
    global _LIB, _LOADED, UNAVAILABLE_REASON
    if _LOADED:
        return _LIB
    _LOADED = True
    tried = []
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path}: {e}")
            continue
        if not hasattr(lib, "tj3SetCroppingRegion"):
            tried.append(f"{path}: TurboJPEG 2 (no cropping region; needs libjpeg-turbo >= 3.0)")
            continue
        _bind(lib)
        _LIB = (lib, path)
        return _LIB
    UNAVAILABLE_REASON = (
        "no libturbojpeg >= 3.0 found ("
        + ("; ".join(tried) if tried else "nothing to try")
        + "): pip install turbojpeg (Linux x86_64 wheels bundle it), or point "
        + f"{ENV_VAR} at a libturbojpeg.so.0 of libjpeg-turbo >= 3.0"
    )
    return None


class RoiDecoder:
    """One TurboJPEG decompressor per thread (handles are not thread-safe); picklable: the
    handles are made again in each worker process."""

    def __init__(self, fastdct: bool = False, fastupsample: bool = False):
        loaded = load()
        if loaded is None:
            raise ImportError(UNAVAILABLE_REASON)
        self.lib, self.path = loaded
        self.fastdct, self.fastupsample = bool(fastdct), bool(fastupsample)
        self._local = threading.local()

    def __getstate__(self):
        return {"fastdct": self.fastdct, "fastupsample": self.fastupsample}

    def __setstate__(self, state):
        self.__init__(**state)

    def _handle(self):
        h = getattr(self._local, "handle", None)
        if h is None:
            h = self.lib.tj3Init(TJINIT_DECOMPRESS)
            if not h:
                raise RoiDecodeError("tj3Init failed")
            self.lib.tj3Set(h, TJPARAM_FASTDCT, int(self.fastdct))
            # Never TJPARAM_FASTUPSAMPLE: merged (fast) upsampling with a cropping region
            # segfaults in the bundled libjpeg-turbo 3.0 beta (2.1.92) on some real photos
            # (found by bench backends on the photo set); the region path always upsamples
            # the accurate way, whatever backend.fastupsample says. Valgrind shows why:
            # jpeg_skip_scanlines -> read_and_discard_scanlines writes out of bounds with
            # merged upsampling, also when the region starts on an iMCU row (tried, as the
            # crashes stopped then); with accurate upsampling, 300 random regions of the
            # photo set at scales 1-4 ran clean under valgrind (2026-11-23).
            self.lib.tj3Set(h, TJPARAM_FASTUPSAMPLE, 0)
            self._local.handle = h
        return h

    def _error(self, h, what: str) -> RoiDecodeError:
        return RoiDecodeError(f"{what}: {self.lib.tj3GetErrorStr(h).decode(errors='replace')}")

    def header(self, data: bytes) -> tuple[int, int, int]:
        """(width, height, subsampling index) of a JPEG; RoiDecodeError if unreadable."""
        h = self._handle()
        if self.lib.tj3DecompressHeader(h, data, len(data)) != 0:
            raise self._error(h, "header")
        get = self.lib.tj3Get
        return get(h, TJPARAM_JPEGWIDTH), get(h, TJPARAM_JPEGHEIGHT), get(h, TJPARAM_SUBSAMP)

    def decode(self, data: bytes, scale: int, region: tuple[int, int, int, int]) -> np.ndarray:
        """Decode `region` (x, y, w, h in the 1/`scale` image; x a multiple of the scaled
        iMCU width) of a JPEG whose header was just read by `header` on this thread."""
        h = self._handle()
        lib = self.lib
        if lib.tj3SetScalingFactor(h, _Scaling(1, scale)) != 0:
            raise self._error(h, f"scaling 1/{scale}")
        x, y, w, hh = region
        if lib.tj3SetCroppingRegion(h, _Region(x, y, w, hh)) != 0:
            raise self._error(h, f"cropping region {region}")
        out = np.empty((hh, w, 3), np.uint8)
        if lib.tj3Decompress8(h, data, len(data), out.ctypes.data, w * 3, TJPF_RGB) != 0:
            raise self._error(h, "decompress")
        return out


def scaled_mcu_width(subsamp: int, scale: int) -> int:
    """TJ_SCALED(tjMCUWidth[subsamp], 1/scale): the alignment of a region's left edge."""
    return (MCU_WIDTH[subsamp] + scale - 1) // scale


def region_for(box, scale: int, width: int, height: int, size: int, mcu: int):
    """The decode region (x, y, w, h in the 1/scale image) that holds everything the crop
    of `box` (full-resolution left, top, width, height) to `size` px samples, and the box
    mapped into that region.

    Margin: the crop's antialias step averages floor(w / size) pixel blocks and its bilinear
    step reads one pixel beyond the box, and the region's outer columns differ from a full
    decode (upsampling context); kx + 2 pixels on every side keep all three inside."""
    sw, sh = math.ceil(width / scale), math.ceil(height / scale)
    left, top, w, h = (v / scale for v in box)
    mx = max(1, int(w / size)) + 2
    my = max(1, int(h / size)) + 2
    x0 = max(0, math.floor(left) - mx) // mcu * mcu
    y0 = max(0, math.floor(top) - my)
    x1 = min(sw, math.ceil(left + w) + mx)
    y1 = min(sh, math.ceil(top + h) + my)
    return (x0, y0, x1 - x0, y1 - y0), (left - x0, top - y0, w, h)
