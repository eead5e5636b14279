"""Region decode through NVIDIA nvImageCodec's CPU backend (backend.roi=nvimgcodec).

nvImageCodec (`nvidia-nvimgcodec-cu13` on PyPI, maintained with DALI) decodes JPEGs on the
CPU with a statically linked libjpeg-turbo 3.1 release, regions included (fastload/decode/
roi.py says what a region skips). Its CPU backend needs no GPU, driver or CUDA library, and
no compiler at install: the region decoder for installs where fastload's own (roi_libjpeg.py)
was not built.

Set-up, once per process, before nvImageCodec is imported:

* only its libjpeg-turbo extension is loaded, plus its nvJPEG one where a GPU is visible (a
  folder holding links to them, given as NVIMGCODEC_EXTENSIONS_PATH): the other extensions
  would each print "Failed to load nvJPEG2000 / nvTIFF" on a machine without those optional
  libraries, and are not used;
* its logging is off (PYNVIMGCODEC_VERBOSITY=0): a file it refuses takes the simplejpeg /
  PIL path, whose error names the file, so its own lines would only be noise.

A user who sets either variable keeps their value.

libjpeg's warnings ("Corrupt JPEG data: ...") bypass that logging: its default message
handler writes them to file descriptor 2 and the decode returns an image anyway. A region
decode therefore runs with fd 2 pointed at a pipe (`_StderrTrap`, ~5 us): a warning makes it
a RoiDecodeError, so a damaged file takes the whole-image path as before (simplejpeg refuses
it, PIL decodes what it can, the fallback is counted) and the user sees no library noise. The
trap is process-wide: text another thread writes to fd 2 during a decode (~0.5 ms) is taken
with it; decodes run in the loader's worker processes, which write nothing else there.

Per call: the output array is allocated here and the decoder writes into it (`as_image`):
an Image that nvImageCodec allocates costs a fresh buffer per call (~80 us a photo).

Which boxes get a region at all, and which get whole rows: BAND_SHARE / TALL_SHARE below.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import tempfile
import threading

import numpy as np

from fastload.decode.roi import RoiDecodeError, region_for
from fastload.host import ctrl_c_after

EXTENSION = "libjpeg_turbo_ext.so"
UNAVAILABLE_REASON = ""
INSTALL = "pip install nvidia-nvimgcodec-cu13 (Linux x86_64 and aarch64 wheels, no GPU needed)"


class _StderrTrap:
    """fd 2 into a non-blocking pipe while at least one decode runs (nested and concurrent
    decodes share one redirection); `exit` of the last one points fd 2 back and returns what
    was written meanwhile. The pipe is made once per process (a forked worker makes its own);
    fd 2 itself is copied on each entry, since whoever owns it may point it elsewhere between
    decodes (a log file, a test's capture)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.depth = 0
        self.pid = -1
        self.real = self.read_end = self.write_end = -1

    def enter(self) -> None:
        with self.lock:
            if self.depth == 0:
                if self.pid != os.getpid():
                    self.read_end, self.write_end = os.pipe()
                    os.set_blocking(self.read_end, False)
                    self.pid = os.getpid()
                self.real = os.dup(2)
                os.dup2(self.write_end, 2)
            self.depth += 1

    def exit(self) -> bytes:
        with self.lock:
            self.depth -= 1
            if self.depth:
                return b""
            os.dup2(self.real, 2)
            os.close(self.real)
            caught = b""
            while True:
                try:
                    chunk = os.read(self.read_end, 65536)
                except BlockingIOError:
                    break
                caught += chunk
                if len(chunk) < 65536:
                    break
            return caught


_TRAP = _StderrTrap()


def _package_dir() -> str | None:
    """Where nvidia.nvimgcodec is installed (found without importing it), or None."""
    try:
        spec = importlib.util.find_spec("nvidia.nvimgcodec")
    except (ImportError, ValueError):  # no `nvidia` namespace package at all
        return None
    return os.path.dirname(spec.origin) if spec is not None and spec.origin else None


def package_version() -> str | None:
    """The installed nvImageCodec distribution's version, or None."""
    for dist in ("nvidia-nvimgcodec-cu13", "nvidia-nvimgcodec-cu12"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


GPU_EXTENSION = "libnvjpeg_ext.so"


def gpu_present() -> bool:
    """An NVIDIA GPU is visible to this process (its device files; no CUDA call, which a
    forked worker must not make)."""
    return os.path.exists("/dev/nvidiactl") and any(
        n.startswith("nvidia") and n[6:].isdigit() for n in os.listdir("/dev")
    )


def _extensions_folder(package: str) -> str:
    """A folder that holds only links to the nvImageCodec extensions this process uses: the
    libjpeg-turbo one, and the nvJPEG one where a GPU is visible (backend=nvjpeg decodes with
    it in the training process; extensions are chosen once per process, at import). Under the
    fastload cache, one per installed package and set; under the temp directory where the
    cache is read-only."""
    ext_dir = os.path.join(package, "extensions")
    wanted = [EXTENSION] + ([GPU_EXTENSION] if gpu_present() else [])
    targets = []
    for prefix in wanted:
        names = sorted(n for n in os.listdir(ext_dir) if n.startswith(prefix))
        if not names and prefix == EXTENSION:
            raise ImportError(f"{ext_dir} has no {EXTENSION}*: reinstall nvImageCodec ({INSTALL})")
        targets += [os.path.join(ext_dir, names[-1])] if names else []
    cache = os.environ.get("FASTLOAD_CACHE", os.path.expanduser("~/.cache/fastload"))
    digest = hashlib.sha256("\n".join(map(os.path.realpath, targets)).encode()).hexdigest()[:12]
    key = f"{package_version() or 'unknown'}-{digest}"
    folder = os.path.join(cache, "nvimgcodec-extensions", key)
    links = [os.path.join(folder, os.path.basename(t)) for t in targets]
    if all(
        os.path.realpath(lk) == os.path.realpath(t) for lk, t in zip(links, targets, strict=True)
    ):
        return folder
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:  # a read-only home: the same folder under the temp directory
        folder = os.path.join(tempfile.gettempdir(), f"fastload-nvimgcodec-extensions-{key}")
        os.makedirs(folder, exist_ok=True)
    for target in targets:
        link = os.path.join(folder, os.path.basename(target))
        # Published by rename: concurrent workers never see a half-made link.
        tmp = f"{link}.tmp-{os.getpid()}-{threading.get_ident()}"
        os.symlink(target, tmp)
        os.replace(tmp, link)
    return folder


_MODULE = None
_LOADED = False


def load():
    """The nvidia.nvimgcodec module set up for CPU decoding, or None (the reason in
    UNAVAILABLE_REASON). Cached per process."""
    global _MODULE, _LOADED, UNAVAILABLE_REASON
    if _LOADED:
        return _MODULE
    _LOADED = True
    package = _package_dir()
    if package is None:
        UNAVAILABLE_REASON = f"nvImageCodec is not installed: {INSTALL}"
        return None
    try:
        os.environ.setdefault("NVIMGCODEC_EXTENSIONS_PATH", _extensions_folder(package))
        os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")
        with ctrl_c_after():  # its initialisation would turn a Ctrl-C into an ImportError
            from nvidia import nvimgcodec
    except (ImportError, OSError) as e:
        UNAVAILABLE_REASON = f"nvImageCodec did not load ({e}): {INSTALL}"
        return None
    _MODULE = nvimgcodec
    return _MODULE


def _mcu_widths(nv) -> dict:
    """iMCU width in pixels per chroma subsampling: 8 x the largest horizontal factor."""
    css = nv.ChromaSubsampling
    return {
        css.CSS_444: 8,
        css.CSS_440: 8,
        css.CSS_GRAY: 8,
        css.CSS_422: 16,
        css.CSS_420: 16,
        css.CSS_411: 32,
        css.CSS_410: 32,
    }


# Where a region pays with this decoder (measured on the photo set and the synthetic set, 500
# RandomResizedCrop boxes each at 224 px, one core, every box decoded all three ways; the
# rule below costs 528 / 503 us a sample, region-only 580 / 535, whole-image-only 584 / 572,
# the best of the three per box 518 / 492):
# * nvImageCodec decodes a region that starts right of column 0 line by line into a scratch
#   row and copies it out (it widens every interior region by a pixel each side, so its
#   left edge is never iMCU-aligned), then copies the region again from its own buffer into
#   ours. Full-width rows need neither realignment, so a region at least BAND_SHARE of the
#   image wide is decoded as the whole rows it spans (a band): the extra columns' IDCT and
#   colour conversion cost less than the copy.
# * Rows below the region are never decoded, rows above are only entropy-decoded; a region
#   spanning TALL_SHARE of the rows or more saves too little for the fixed cost of the call
#   (~25 us) and the copies, and the whole image through simplejpeg is faster.
BAND_SHARE = 0.4
TALL_SHARE = 0.8


class Decoder:
    """One nvImageCodec CPU decoder per calling thread, each with a single executor thread
    (max_num_cpu_threads=1: a decode runs there while the caller waits; the loader's workers
    are the parallelism); picklable: the decoders are made again in each worker process.

    `fastdct` and `fastupsample` are libjpeg-turbo's fast integer IDCT and merged ("fast")
    upsampling, the same options as simplejpeg's."""

    def __init__(self, fastdct: bool = False, fastupsample: bool = False):
        nv = load()
        if nv is None:
            raise ImportError(UNAVAILABLE_REASON)
        self.nv = nv
        self.fastdct, self.fastupsample = bool(fastdct), bool(fastupsample)
        self.version = package_version() or nv.__version__
        self.name = f"nvimgcodec-{self.version} ROI"
        self.tall_share = TALL_SHARE
        self.scales = (1,)  # no DCT scaling: boxes for 1/s decode whole (simplejpeg)
        self.mcu_widths = _mcu_widths(nv)
        self.params = nv.DecodeParams(apply_exif_orientation=False, color_spec=nv.ColorSpec.SRGB)
        self._local = threading.local()

    def __getstate__(self):
        return {"fastdct": self.fastdct, "fastupsample": self.fastupsample}

    def __setstate__(self, state):
        self.__init__(**state)

    def _decoder(self):
        dec = getattr(self._local, "decoder", None)
        if dec is None:
            nv = self.nv
            options = (
                f"libjpeg_turbo_decoder:fast_idct={int(self.fastdct)} "
                f"libjpeg_turbo_decoder:fancy_upsampling={int(not self.fastupsample)}"
            )
            dec = nv.Decoder(
                device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY,
                max_num_cpu_threads=1,
                backends=[nv.Backend(nv.BackendKind.CPU_ONLY)],
                options=options,
            )
            self._local.decoder = dec
        return dec

    def open(self, data: bytes):
        """(code stream, width, height, iMCU width) of a JPEG; RoiDecodeError if unreadable."""
        try:
            stream = self.nv.CodeStream(data)
            width, height = stream.width, stream.height
            mcu = self.mcu_widths.get(stream.chroma_subsampling)
        except Exception as e:  # nvImageCodec raises RuntimeError/ValueError on bad bytes
            raise RoiDecodeError(f"header: {e}") from None
        if stream.codec_name != "jpeg" or mcu is None:
            raise RoiDecodeError(f"{stream.codec_name} {stream.chroma_subsampling}")
        return stream, width, height, mcu

    def decode(self, stream, region: tuple[int, int, int, int]) -> np.ndarray:
        """Decode `region` (x, y, w, h; x a multiple of the iMCU width) of an opened JPEG."""
        x, y, w, h = region
        out = np.empty((h, w, 3), np.uint8)
        nv = self.nv
        _TRAP.enter()
        try:
            sub = stream.get_sub_code_stream(region=nv.Region(y, x, y + h, x + w))
            got = self._decoder().decode(sub, image=nv.as_image(out), params=self.params)
        except Exception as e:
            got = e
        finally:
            warning = _TRAP.exit()
        if isinstance(got, Exception):
            raise RoiDecodeError(f"region {region}: {got}")
        if got is None:
            raise RoiDecodeError(f"region {region}: nvImageCodec could not decode it")
        if warning:
            raise RoiDecodeError(warning.decode(errors="replace").strip())
        return out

    def region(self, data: bytes, width: int, height: int, box, size: int, scale: int = 1):
        """(the decoded region, `box` mapped into it) for a crop of `box` to `size` px of
        a width x height JPEG (its parsed header); RoiDecodeError when refused."""
        if scale != 1:
            raise RoiDecodeError(f"nvImageCodec does not DCT-scale (scale 1/{scale})")
        stream, got_w, got_h, mcu = self.open(data)
        if (got_w, got_h) != (width, height):
            raise RoiDecodeError(f"header {got_w}x{got_h}, parsed {width}x{height}")
        region, local_box = region_for(box, width, height, size, mcu, BAND_SHARE)
        return self.decode(stream, region), local_box
