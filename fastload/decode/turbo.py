"""backend=turbo: libjpeg-turbo through simplejpeg, straight to a numpy array, with
DCT-domain downscaling.

Per image: read the header (size, components, EXIF orientation), sample the crop box on the
full-resolution size (the same RNG draw, hence the same box, as backend=pil), pick the
largest reduction s in {8, 4, 2} after which the box still covers the output size, decode at
1/s (libjpeg-turbo skips most of the IDCT work), map the box by 1/s, then crop + resize +
flip.

`roi` (auto | on | off | libjpeg | nvimgcodec): only the region the crop samples is decoded
(fastload/decode/roi.py): rows below it are never entropy-decoded, columns and rows outside it
skip IDCT, upsampling and colour conversion; RandomResizedCrop keeps about half the image on
average. The pixels are those of the whole-image path. `libjpeg` (fastload's C extension over
Pillow's libjpeg-turbo release) decodes every box as a region, DCT-scaled by 1/s in the same
pass where the box allows; `nvimgcodec` (NVIDIA nvImageCodec's CPU decoder) cannot DCT-scale,
so boxes twice the output size decode the whole image at 1/s, and a box spanning most rows
decodes the whole image too (counted decode_whole_tall). `auto` / `on` take the first that
loads, in that order. Progressive JPEGs, no region decoder and decoder errors take the
whole-image simplejpeg path, counted as decode_roi_fallback_*.

Where simplejpeg cannot give the reference image (not a JPEG, CMYK/YCCK, EXIF-rotated, cut
short: PIL refuses such a file, where a region above the cut would decode) or fails, the image
goes through PIL's `open_rgb` with the same box, and the fallback is counted by reason.

`resize` picks the crop+resize+flip of the decoded array:

* `pil`: PIL's antialiased bilinear resize(box=...), the reference (~1.1 ms per 224 crop:
  more than the decode itself);
* `cv2`: OpenCV on the numpy array (~0.15 ms). After DCT reduction the remaining downscale
  factor per axis is almost always < 2; then one cv2.warpAffine with INTER_LINEAR maps every
  output pixel centre to its exact (sub-pixel) source position, PIL's own mapping
  `src = left + (i + 0.5) * w / size - 0.5`, with the flip folded into the matrix (no extra
  pass). Where a factor is >= 2 (dct_scale off, or a box narrow on one axis and tall on the
  other), bilinear sampling would skip pixels and alias, so the box is first averaged down by
  the integer factor floor(factor) per axis (cv2.resize INTER_AREA on an integer-aligned
  region, which is exact block averaging), then warped the same way.
* `auto`: cv2 when importable, else pil, said once per process in a warning that names
  OpenCV's import error (an opencv-python without libGL in a slim container, say).

OpenCV's thread pool is switched off (cv2.setNumThreads(0)) when the cv2 path is set up: one
224 px resize is too small to split, and N loader workers x N OpenCV threads oversubscribe
the cores (the loader's worker_init does the same for any cv2 user).
"""

from __future__ import annotations

import logging
import math
import threading

import numpy as np
from PIL import Image

from fastload.data.transforms import resized_crop
from fastload.decode import roi as roi_decode
from fastload.decode import roi_decoders
from fastload.decode.base import JpegOnlyBackend, Need, load_with_box
from fastload.decode.jpeg_header import (
    FALLBACK_REASONS,
    Counts,
    dct_scale,
)
from fastload.decode.pil import pillow_name
from fastload.errors import ConfigError

log = logging.getLogger("fastload")

RESIZE_CHOICES = ("auto", "pil", "cv2")
ROI_CHOICES = ("auto", "on", "off", *roi_decoders.KINDS)
# Why a JPEG went through the whole-image decode although ROI decode was asked for.
ROI_FALLBACK_REASONS = ("no_library", "progressive", "error")


def make_roi_decoder(roi, fastdct: bool, fastupsample: bool):
    """(the region decoder or None, why none): None when `roi` is off, or auto and no region
    decoder loads (the reason kept for `info` and the doctor); ConfigError when one was
    asked for by name (or `on`) and cannot load."""
    roi = {True: "on", False: "off"}.get(roi, roi)
    if roi not in ROI_CHOICES:
        raise ConfigError(f"backend.roi={roi!r}: use one of {', '.join(ROI_CHOICES)}.")
    if roi == "off":
        return None, "backend.roi=off"
    try:
        return roi_decoders.make_decoder(roi, fastdct, fastupsample), ""
    except ImportError as e:
        if roi != "auto":
            raise ConfigError(f"backend.roi={roi}: {e} (or set backend.roi=auto / off)") from None
        return None, str(e)


def import_simplejpeg():
    try:
        import simplejpeg
    except ImportError as exc:
        why = "it is not installed" if isinstance(exc, ModuleNotFoundError) else f"{exc}"
        raise ConfigError(
            f"backend=turbo needs simplejpeg (libjpeg-turbo bindings with wheels for Linux, "
            f"macOS and Windows), which does not import here ({why}): pip install simplejpeg"
        ) from None
    return simplejpeg


_CV2_FALLBACK_SAID = set()  # the import errors already warned about in this process


def import_cv2(required: bool):
    """cv2 with its thread pool off, or None when it does not import and is not required
    (backend.resize=auto: said once per process, with the import's error)."""
    try:
        import cv2
    except Exception as exc:  # ImportError, and what a broken binary module raises
        why = f"{type(exc).__name__}: {exc}"
        if required:
            raise ConfigError(
                f"backend.resize=cv2 needs OpenCV, which does not import here ({why}): pip "
                "install opencv-python-headless (or set backend.resize=pil / auto)"
            ) from None
        if why not in _CV2_FALLBACK_SAID:
            _CV2_FALLBACK_SAID.add(why)
            log.warning(
                "backend=turbo resizes with PIL, not OpenCV (about 7x slower crops): OpenCV "
                "does not import here (%s). Fix: pip install opencv-python-headless (needs "
                "no libGL), or set backend.resize=pil to choose PIL.",
                why,
            )
        return None
    cv2.setNumThreads(0)
    return cv2


def decoded_scale(width: int, height: int, got_w: int, got_h: int, asked: int) -> float:
    """The reduction a DCT-scaled decode used: libjpeg-turbo scales by M / 8 (M = 1..16)
    and makes ceil(side x M / 8) pixels of a side, so it is 8 / M for the M that gives both
    decoded sides, the asked one tried first (simplejpeg may pick another). Dividing the
    sides instead rounds wrong for narrow images at 1/8: 89 px decode to 12, and 89 / 12 =
    7.4, not 8."""
    for m in sorted(range(1, 17), key=lambda m: m * asked != 8):
        if -(-width * m // 8) == got_w and -(-height * m // 8) == got_h:
            return 8 / m
    return width / got_w  # no libjpeg-turbo scaling makes these sides: the ratio itself


class _Scratch(threading.local):
    """Per-thread uint16 buffers for `resize_linear`, grown when needed and reused: a new
    300 KB array per sample would be a fresh mmap, page-faulted in every time."""

    buffer = np.empty(0, np.uint16)

    def take(self, n: int) -> np.ndarray:
        if self.buffer.size < n:
            self.buffer = np.empty(n, np.uint16)
        return self.buffer[:n]


_SCRATCH = _Scratch()


def resize_linear(cv2, src: np.ndarray, size: int, out: np.ndarray | None = None) -> np.ndarray:
    """cv2.resize INTER_LINEAR of an HWC uint8 array to size x size (into `out` when given),
    computed on a uint16 copy: OpenCV's 3-channel uint8 bilinear path (fixed point) is
    slower than its 16-bit one (float, AVX2-dispatched) by more than both copies cost;
    measured on 2 cores, OpenCV 4.14 and 5.0, 224 px out: 250x210 in 53 -> 40 us,
    150x120 39 -> 29, 330x300 62 -> 52, 440x400 71 -> 70 (bench notes in BENCHMARKS.md).
    The uint16 result is rounded to nearest and never exceeds the inputs' range, so the
    copy back to uint8 is exact; it differs from the uint8 path's 11-bit fixed point by at
    most one level."""
    h, w, c = src.shape
    scratch = _SCRATCH.take(h * w * c + size * size * c)
    src16 = scratch[: h * w * c].reshape(h, w, c)
    out16 = scratch[h * w * c :].reshape(size, size, c)
    np.copyto(src16, src, casting="unsafe")
    cv2.resize(src16, (size, size), dst=out16, interpolation=cv2.INTER_LINEAR)
    if out is None:
        out = np.empty((size, size, c), np.uint8)
    np.copyto(out, out16, casting="unsafe")
    return out


def cv2_resized_crop(
    cv2, pixels: np.ndarray, box, size: int, flip: bool, out: np.ndarray | None = None
) -> np.ndarray:
    """Crop `box` (left, top, width, height; floats allowed) of an HWC uint8 array, resize
    to size x size and flip, with OpenCV; the same geometry as `resized_crop` (PIL).

    `out`: a C-contiguous size x size x channels uint8 array (e.g. a sample's place in a
    batch slot) that the last pass writes straight into, so the crop is not resized into a
    new array and copied again; returned."""
    left, top, w, h = box
    kx, ky = max(1, int(w / size)), max(1, int(h / size))  # floor of the downscale factors
    if kx > 1 or ky > 1:
        # Antialias: average kx x ky blocks first (INTER_AREA at an integer factor is exact
        # block averaging), on a region aligned to the blocks that covers the box; output
        # pixel j of the reduced region covers source [x0 + j*kx, x0 + (j+1)*kx).
        height, width = pixels.shape[:2]
        x0, y0 = math.floor(left), math.floor(top)
        nx = max(1, math.ceil((left + w - x0) / kx))
        ny = max(1, math.ceil((top + h - y0) / ky))
        x0 = max(0, min(x0, width - nx * kx))  # keep whole blocks inside the image
        y0 = max(0, min(y0, height - ny * ky))
        nx, ny = min(nx, width // kx), min(ny, height // ky)
        region = pixels[y0 : y0 + ny * ky, x0 : x0 + nx * kx]
        pixels = cv2.resize(region, (nx, ny), interpolation=cv2.INTER_AREA)
        left, top, w, h = (left - x0) / kx, (top - y0) / ky, w / kx, h / ky
    if all(float(v).is_integer() for v in (left, top, w, h)):
        # Whole-pixel box (no DCT reduction): cv2.resize of the crop samples output pixel i at
        # source (i + 0.5) * w / size - 0.5 of the crop, exactly PIL's mapping.
        left, top, w, h = int(left), int(top), int(w), int(h)
        out = resize_linear(cv2, pixels[top : top + h, left : left + w], size, out)
        # In place (no second array): torch cannot wrap a negative-stride view.
        return cv2.flip(out, 1, dst=out) if flip else out
    # Sub-pixel box (mapped into a DCT-reduced image): cv2.resize cannot start between pixels,
    # so one warpAffine with the same inverse map (output -> source), PIL's pixel-centre
    # convention, the flip folded in as i -> size - 1 - i (~0.4 ms; still one pass). The map
    # is taken from a pixel left of and above the box, not from the array's corner: OpenCV
    # rounds the map's offset to 1/1024 pixel, so the same box in a decoded region and in the
    # whole image (offsets apart by whole pixels) would round differently by a level.
    ox, oy = max(0, math.floor(left) - 1), max(0, math.floor(top) - 1)
    pixels, left, top = pixels[oy:, ox:], left - ox, top - oy
    fx, fy = w / size, h / size
    if flip:
        m = np.array([[-fx, 0.0, left + (size - 0.5) * fx - 0.5], [0.0, fy, top + 0.5 * fy - 0.5]])
    else:
        m = np.array([[fx, 0.0, left + 0.5 * fx - 0.5], [0.0, fy, top + 0.5 * fy - 0.5]])
    return cv2.warpAffine(
        pixels,
        m,
        (size, size),
        dst=out,
        flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
        borderMode=cv2.BORDER_REPLICATE,
    )


class TurboBackend(JpegOnlyBackend):
    name = "turbo"
    decoder_module, install = "simplejpeg", "pip install simplejpeg"
    also_imports = ("cv2",)  # backend.resize=auto|cv2 (its `needs`)

    @classmethod
    def region_decoder(cls, options: dict, facts) -> str | None:
        """The region decoder backend.roi gets on this machine (the first of its candidates
        that loads, facts.roi_decode), or None: whole-image decodes only."""
        status = facts.roi_decode or {}
        roi = str(options.get("roi", "auto"))
        return next((k for k in roi_decoders.candidates(roi) if status.get(k) == ""), None)

    @classmethod
    def needs(cls, options: dict, facts, on_cuda: bool) -> list[Need]:
        """OpenCV for the resize; a region decoder when backend.roi asks for one (its fix
        otherwise), fastload's own one before nvImageCodec's."""
        out = []
        # (the decoders line names cv2's import error)
        cv2_error, resize = facts.decoders.get("cv2", ""), str(options.get("resize", "auto"))
        fix = ("pip install opencv-python-headless (about 7x faster crops; it needs no libGL), "
               "or backend.resize=pil.")  # fmt: skip
        if cv2_error and resize == "auto":
            out.append(Need("decoders", "warn", "backend=turbo resizes with PIL: OpenCV (cv2) "
                            "does not import", fix))  # fmt: skip
        elif cv2_error and resize == "cv2":  # the backend refuses to start
            out.append(Need("decoders", "fatal", "backend.resize=cv2, but OpenCV (cv2) does not "
                            "import", fix))  # fmt: skip
        roi, status = str(options.get("roi", "auto")), facts.roi_decode
        if roi == "off" or status is None:  # not asked for, or not known
            return out
        kind, libraries = cls.region_decoder(options, facts), cls.libraries(options, facts)
        if kind is None:
            reasons = "; ".join(f"{k}: {status[k]}" for k in status if status[k])
            out.append(Need("decoders", "warn", f"backend=turbo decodes whole images, not crop "
                            f"regions ({reasons}); {libraries}", f"{status.get('libjpeg', '')} "
                            "(crops decode ~1.2x faster with it), or pip install "
                            "nvidia-nvimgcodec-cu13."))  # fmt: skip
        elif kind == "nvimgcodec" and status.get("libjpeg") and roi in ("auto", "on"):
            out.append(Need("decoders", "warn", f"{libraries}; fastload's own region decoder "
                            f"(10-18 % faster a sample) is not available", status["libjpeg"]))  # fmt: skip
        return out

    @classmethod
    def libraries(cls, options: dict, facts) -> str:
        import importlib.metadata

        try:
            whole = f"simplejpeg {importlib.metadata.version('simplejpeg')}"
        except importlib.metadata.PackageNotFoundError:
            whole = "simplejpeg ?"
        off = str(options.get("roi", "auto")) == "off"
        if not off and facts.roi_decode is None:  # asked for, but not known here
            return ""
        kind = None if off else cls.region_decoder(options, facts)
        if kind == "libjpeg":
            from fastload.decode import roi_libjpeg

            return (f"JPEG crop regions (DCT-scaled where the box allows) decoded by fastload's "
                    f"region decoder on {pillow_name()}'s libjpeg-turbo "
                    f"{roi_libjpeg.library_version()}, progressive files whole by {whole}")  # fmt: skip
        if kind == "nvimgcodec":
            from fastload.decode import roi_nvimgcodec

            return (f"JPEG crop regions decoded by nvImageCodec "
                    f"{roi_nvimgcodec.package_version()} (its CPU libjpeg-turbo), whole images "
                    f"(progressive, boxes >= 2x the output) by {whole}")  # fmt: skip
        return f"JPEGs decoded whole by {whole} (no ROI decode)"

    def __init__(
        self,
        dct_scale: bool = True,
        fastdct: bool = False,
        fastupsample: bool = False,
        resize: str = "auto",
        roi: str = "auto",
    ):
        if resize not in RESIZE_CHOICES:
            raise ConfigError(f"backend.resize={resize!r}: use one of {', '.join(RESIZE_CHOICES)}.")
        self.simplejpeg = import_simplejpeg()
        self.resize_option = resize
        self.cv2 = None if resize == "pil" else import_cv2(required=resize == "cv2")
        self.resize = "pil" if self.cv2 is None else "cv2"
        self.dct_scale = bool(dct_scale)
        self.fastdct = bool(fastdct)
        self.fastupsample = bool(fastupsample)
        self.roi_option = roi
        self.roi, self.roi_reason = make_roi_decoder(roi, self.fastdct, self.fastupsample)
        self.counts = Counts(
            "decode_dct_scaled",
            "decode_roi",
            "decode_whole_tall",
            *(f"decode_fallback_{r}" for r in FALLBACK_REASONS),
            *(f"decode_roi_fallback_{r}" for r in ROI_FALLBACK_REASONS),
        )

    def __getstate__(self):  # a module cannot be pickled (spawn-started workers)
        return {k: v for k, v in self.__dict__.items() if k not in ("simplejpeg", "cv2")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.simplejpeg = import_simplejpeg()
        self.cv2 = import_cv2(required=True) if self.resize == "cv2" else None

    def info(self) -> dict:
        resize = f"cv2-{self.cv2.__version__}" if self.cv2 is not None else pillow_name()
        if self.roi is not None:
            decoder = self.roi.name
        elif self.roi_option == "off":
            decoder = f"simplejpeg-{self.simplejpeg.__version__}"
        else:
            decoder = f"simplejpeg-{self.simplejpeg.__version__} (no ROI: {self.roi_reason})"
        return {
            "decoder": decoder,
            "decoder_fallback": pillow_name(),
            "resize": resize,
        }

    def load_jpeg(self, data: bytes, info, box, flip: bool, transform) -> np.ndarray:
        got = self._region_or_crop(data, info, box, flip, transform)
        if isinstance(got, tuple):
            pixels, local_box, flip = got
            return self._resized_crop(pixels, local_box, transform.size, flip)
        return got

    def decode_region(self, data: bytes, transform, rng: np.random.Generator):
        """`load` without its last step where it can: a JPEG decoded through ROI comes back
        as (region pixels, box in them, flip) for the loader's collate to resize straight
        into the batch slot (`crop_pixels(..., out=)`: no 150 KB array per sample and no
        copy); anything else as `load`'s finished crop. Same box, same pixels as `load`."""
        return self.load_with(self._region_or_crop, data, transform, rng)

    def _region_or_crop(self, data: bytes, info, box, flip: bool, transform):
        """(the decoded region, `box` mapped into it, flip) when ROI decode takes this
        JPEG; else the whole-image path's finished crop, the reason counted."""
        size = transform.size
        s = dct_scale(box, size) if self.dct_scale else 1
        roi = self.roi
        if roi is not None and s not in roi.scales:
            # A box at least twice the output size both ways, and a region decoder without
            # DCT scaling (nvImageCodec): the whole image decoded at 1/s (libjpeg-turbo's
            # scaled IDCT, simplejpeg) beats the full-size region (photo set, 112 px crops,
            # one core: 534 us a sample vs 788). Not a fallback: the fast path for such boxes.
            return self._load_whole(data, info, box, flip, transform, s)
        if roi is not None and info.progressive:
            # Progressive files decode every scan of the whole image's coefficients first:
            # a region of them saves little (a half-area region was ~6 % faster, measured on
            # the photo set re-encoded progressive), so they keep the simplejpeg path.
            self.counts.add("decode_roi_fallback_progressive")
        elif roi is not None:
            if s == 1 and not roi_decode.worth_a_region(box, info.height, size, roi.tall_share):
                self.counts.add("decode_whole_tall")  # the faster path for such boxes
                return self._load_whole(data, info, box, flip, transform, 1)
            try:
                return (*self._decode_roi(data, info, box, size, s), flip)
            except roi_decode.RoiDecodeError:
                self.counts.add("decode_roi_fallback_error")
        elif self.roi_option != "off":
            self.counts.add("decode_roi_fallback_no_library")
        return self._load_whole(data, info, box, flip, transform, s)

    def _decode_roi(self, data: bytes, info, box, size: int, s: int = 1):
        """(the region decoded at 1/s, `box` mapped into it), counted; RoiDecodeError when
        the decoder refuses. The region's margin absorbs its edge effects: the crop of it
        is the whole-image path's crop."""
        pixels, local_box = self.roi.region(data, info.width, info.height, box, size, s)
        self.counts.add("decode_roi")
        self.counts.add("decode_dct_scaled", int(s > 1))
        return pixels, local_box

    def _load_whole(self, data: bytes, info, box, flip: bool, transform, s: int) -> np.ndarray:
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
            s = decoded_scale(info.width, info.height, pixels.shape[1], pixels.shape[0], s)
            box = tuple(v / s for v in box)  # output pixel i covers [i*s, (i+1)*s)
            self.counts.add("decode_dct_scaled", int(s > 1))
        return self._resized_crop(pixels, box, transform.size, flip)

    def decode_jpeg_rgb(self, data) -> np.ndarray:
        return self.simplejpeg.decode_jpeg(
            bytes(data), colorspace="RGB", fastdct=self.fastdct, fastupsample=self.fastupsample
        )

    def load_pixels(self, pixels: np.ndarray, transform, rng: np.random.Generator) -> np.ndarray:
        """Already-decoded HWC pixels (raw-pixel shards): the same crop, resized this
        backend's way, so storage=shards kind=raw gets the fast resize too."""
        box, flip = transform.sample(pixels.shape[1], pixels.shape[0], rng)
        return self._resized_crop(pixels, box, transform.size, flip)

    def crop_pixels(self, pixels: np.ndarray, box, flip: bool, size: int, out=None) -> np.ndarray:
        """`load_pixels` for a box already drawn, OpenCV's resize writing into `out`."""
        return self._resized_crop(pixels, box, size, flip, out)

    def _resized_crop(self, pixels, box, size: int, flip: bool, out=None) -> np.ndarray:
        if self.cv2 is not None:
            return cv2_resized_crop(self.cv2, pixels, box, size, flip, out)
        if out is not None:
            return super().crop_pixels(pixels, box, flip, size, out)
        return np.array(resized_crop(Image.fromarray(pixels), box, size, flip), dtype=np.uint8)
