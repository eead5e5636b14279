"""The decode stage's contract: bytes -> the transformed uint8 image a worker collates.

A backend (one module + one conf/backend/<name>.yaml) is a `DecodeBackend`:

    load(data, transform, rng)    required: encoded bytes -> uint8 HWC numpy array, cropped
                                  and flipped by `transform` with the sample's `rng` (the box
                                  comes from `transform.sample(width, height, rng)`, so every
                                  backend crops the same box for the same draw); or a
                                  `DeferredSample` when the decode happens in device prep;
    info()                        required: what actually decodes, for the run's records
                                  ({"decoder": "simplejpeg-1.8", "decoder_fallback": ...});
    pop_counts()                  optional: per-sample counters since the last call
                                  ({"decode_fallback_cmyk": 1, ...}), summed per batch;
    decode_rgb(data, exif=True)   optional: encoded bytes -> the whole image, uint8 HWC RGB,
                                  for tasks that transform whole images themselves
                                  (detection, super-resolution); default: `open_rgb`;
    load_pixels(pixels, transform, rng)
                                  optional: already-decoded HWC pixels (raw-pixel shards)
                                  -> the same crop, resized this backend's way (default: PIL);
    crop_pixels(pixels, box, flip, size, out=None)
                                  optional: the same for a box already drawn, written into
                                  `out` (a sample's place in its batch) when given; what
                                  raw-pixel batches use (fastload/data/dataset.py);
    device_decoder                optional: a callable (cpu_images, encoded, device) -> uint8
                                  NCHW batch on `device`, set by backends whose `load` returns
                                  `DeferredSample`s (backend=nvjpeg); None otherwise.

`open_rgb` is the project's reference decode: every backend falls back to it for what its
own decoder cannot do (PNG, palette, CMYK, EXIF rotation, undecodable bytes), and the tests
compare every backend against it. `JpegOnlyBackend` is the shared front of the decoders that
read JPEG only (accimage, turbo, nvjpeg).
"""

from __future__ import annotations

import abc
import io
from collections.abc import Callable

import numpy as np
from PIL import Image, ImageOps

from fastload.data.transforms import resized_crop
from fastload.decode.jpeg_header import Counts, fallback_reason, jpeg_info
from fastload.host import Need  # noqa: F401  (backends import it from here)


class DeferredSample(abc.ABC):
    """A sample a backend leaves encoded for device prep to decode (backend=nvjpeg). The
    worker's collate batches a batch's deferred samples with their class's `collate`, under
    the batch key "encoded" (fastload/data/batch.py). The dataset sets its `index` on it:
    a sample the device cannot decode either is then named by the dataset's reader, and
    skipped and counted or stopping the run (dataset.skip_corrupt), as in a worker."""

    index: int

    @staticmethod
    @abc.abstractmethod
    def collate(samples: list, positions: list[int]) -> dict:
        """The batch form of `samples`, which sit at `positions` within their batch."""


# (cpu_images | None, encoded: dict, device) -> NCHW; device prep calls its `decode` where it
# has one: the same arguments -> (NCHW, {batch position: (dataset index, why)} of the samples
# it could not decode)
DeviceDecoder = Callable[..., "object"]


def undecodable_where(lost: dict, describe=None) -> list[str]:
    """What names each of `lost` ({batch position: (dataset index, why)}): the reader's
    `describe` of its index, else its place in the batch."""
    return [describe(i) if describe and i >= 0 else f"sample {pos} of the batch"
            for pos, (i, _) in lost.items()]  # fmt: skip


def undecodable_message(lost: dict, describe=None) -> str:
    """The error for samples that neither the device decoder nor PIL could decode, naming
    the first, with the fix (as the workers' CPU decoders say it)."""
    where, (_, why) = undecodable_where(lost, describe)[0], next(iter(lost.values()))
    others = f" and {len(lost) - 1} more in the batch" if len(lost) > 1 else ""
    return (
        f"cannot decode image {where} ({why}) by the device decoder or PIL{others}. Remove or "
        "replace the file, or set dataset.skip_corrupt=true to skip and count such files."
    )


class DecodeBackend(abc.ABC):
    name: str
    device_decoder: DeviceDecoder | None = None
    # What the pre-flight checks of a backend before any data work, stated by the backend
    # (the checks know none by name). Read from the class: nothing here imports a decoder.
    decoder_module = "PIL"  # the module its decoder imports
    install = ""  # how to install that module
    # Other modules of preflight.DECODER_MODULES whose import its `needs` judge (read from
    # facts.decoders): the pre-flight imports these, its decoder module and PIL, and only
    # looks the rest up (a run need not pay for OpenCV's or torchvision's import to check).
    also_imports: tuple[str, ...] = ()

    @classmethod
    def needs(cls, options: dict, facts, on_cuda: bool) -> list[Need]:
        """What this backend needs of the machine beyond its module (CPU flags, a GPU, a
        library), judged on the pre-flight's `facts` (fastload/preflight.py: Facts) and the
        backend's yaml `options`; nothing by default."""
        return []

    @classmethod
    def libraries(cls, options: dict, facts) -> str:
        """Which library decodes this run's JPEGs, for the pre-flight's decoders line."""
        return ""

    @abc.abstractmethod
    def load(self, data: bytes, transform, rng: np.random.Generator):
        """bytes -> transformed uint8 HWC array, or a DeferredSample."""

    @abc.abstractmethod
    def info(self) -> dict:
        """{"decoder": what decodes, ...}: recorded in every epoch row."""

    def pop_counts(self) -> dict:
        return {}

    def decode_rgb(self, data, exif: bool = True) -> np.ndarray:
        """The whole image as uint8 HWC RGB (EXIF orientation applied unless `exif` is
        False: the stored frame, fastload/data/frames.py): the reference decode."""
        return np.asarray(open_rgb(bytes(data), exif=exif), dtype=np.uint8)

    def load_pixels(self, pixels: np.ndarray, transform, rng: np.random.Generator) -> np.ndarray:
        """Decoded HWC uint8 pixels -> the transform's crop, the way backend=pil crops."""
        h, w = pixels.shape[:2]
        img = Image.frombuffer("RGB", (w, h), pixels, "raw", "RGB", 0, 1)  # a view, no copy
        return np.array(transform(img, rng), dtype=np.uint8)

    def crop_pixels(self, pixels: np.ndarray, box, flip: bool, size: int, out=None) -> np.ndarray:
        """Decoded HWC uint8 pixels -> `box` resized to size x size and flipped, the PIL way;
        copied into `out` (size x size x 3 uint8) when given, and returned."""
        img = Image.fromarray(pixels)
        got = np.asarray(resized_crop(img, box, size, flip), dtype=np.uint8)
        if out is None:
            return np.array(got)
        out[...] = got
        return out


def open_rgb(data: bytes, exif: bool = True) -> Image.Image:
    """Decode to an RGB image the way real datasets need: EXIF orientation applied (unless
    `exif` is False: the stored frame, for boxes annotated in it, fastload/data/frames.py),
    grayscale (8 or 16 bits) / CMYK / palette / alpha converted to RGB; 32-bit integer and
    float pixels refused (ValueError: their range is unknown)."""
    img = Image.open(io.BytesIO(data))
    if exif and img.getexif().get(0x0112, 1) != 1:
        img = ImageOps.exif_transpose(img)
    if img.mode.startswith("I;16") or (img.mode == "I" and img.format == "PPM"):
        # 16-bit grayscale (PNG, TIFF; a PGM with maxval > 255, which Pillow opens as mode I
        # scaled to 0..65535): convert("RGB") clips every value above 255 to white; keep the
        # top 8 bits instead, as an 8-bit export of the file would.
        levels = np.clip(np.asarray(img).astype(np.int64), 0, 65535)
        img = Image.fromarray((levels >> 8).astype(np.uint8), "L")
    elif img.mode in ("I", "F"):
        # 32-bit integer or float pixels (TIFF): convert("RGB") clips them to 0..255, so a
        # float image in 0..1 would train as black, a 32-bit one as white; their range is the
        # file's convention, not in the file, so it is refused rather than guessed per image.
        kind = "float" if img.mode == "F" else "32-bit integer"
        raise ValueError(
            f"{kind} pixels (Pillow mode {img.mode}, {img.format or 'unknown format'}): their "
            "value range is not 0..255 and the file does not say what it is; export the "
            "images as 8- or 16-bit (PNG, TIFF or JPEG) with the scaling the data needs"
        )
    return img if img.mode == "RGB" else img.convert("RGB")


def reference_load(data: bytes, transform, rng: np.random.Generator) -> np.ndarray:
    """The PIL path: full decode, then the transform (which samples the box itself)."""
    return np.array(transform(open_rgb(data), rng), dtype=np.uint8)


def load_with_box(data: bytes, box, flip: bool, size: int) -> np.ndarray:
    """The PIL path for a box already sampled on this image's full-resolution size (used
    when a faster decoder fails after the RNG draw, so the crop stays the same)."""
    return np.array(resized_crop(open_rgb(data), box, size, flip), dtype=np.uint8)


def check_pixel_count(info) -> None:
    """PIL's decompression-bomb limit for the JPEG-only decoders too: a header claiming more
    than twice Image.MAX_IMAGE_PIXELS (a damaged SOF, a bomb) is refused before any decoder
    allocates the image, as PIL refuses it (DecompressionBombError)."""
    limit = Image.MAX_IMAGE_PIXELS
    if limit and info.width * info.height > 2 * limit:
        raise Image.DecompressionBombError(
            f"the JPEG header says {info.width}x{info.height} pixels, more than twice PIL's "
            f"Image.MAX_IMAGE_PIXELS ({limit}): a damaged header or a decompression bomb"
        )


class JpegOnlyBackend(DecodeBackend):
    """The shared front of the JPEG-only decoders (accimage, turbo, nvjpeg): read the header,
    send what they cannot decode (not a JPEG, CMYK, EXIF-rotated, cut short) to PIL and count
    it, else draw the crop once from the full-size header dimensions (the same box as every
    other backend for the same RNG draw) and hand over to the subclass's
    `load_jpeg(data, info, box, flip, transform)`."""

    counts: Counts

    def load(self, data: bytes, transform, rng: np.random.Generator):
        return self.load_with(self.load_jpeg, data, transform, rng)

    def load_with(self, load_jpeg, data: bytes, transform, rng: np.random.Generator):
        """`load`'s front with another `load_jpeg` behind it (turbo's `decode_region`)."""
        info = jpeg_info(data)
        reason = fallback_reason(info, data)
        if reason is not None:
            self.counts.add(f"decode_fallback_{reason}")
            return reference_load(data, transform, rng)
        check_pixel_count(info)
        box, flip = transform.sample(info.width, info.height, rng)
        return load_jpeg(data, info, box, flip, transform)

    def decode_rgb(self, data, exif: bool = True) -> np.ndarray:
        """Whole-image decode: the subclass's `decode_jpeg_rgb` for the JPEGs it handles,
        the reference decode (counted) for the rest; exif=False (an image whose boxes are in
        its stored frame, rare): the reference decode, not counted."""
        if not exif:
            return super().decode_rgb(data, exif=False)
        info = jpeg_info(data)
        reason = fallback_reason(info, data)
        if reason is None:
            check_pixel_count(info)
            try:
                return self.decode_jpeg_rgb(data)
            except (ValueError, RuntimeError):
                reason = "decode_error"
        self.counts.add(f"decode_fallback_{reason}")
        return super().decode_rgb(data)

    def decode_jpeg_rgb(self, data) -> np.ndarray:
        """A JPEG this decoder handles -> uint8 HWC RGB (default: the reference decode)."""
        return DecodeBackend.decode_rgb(self, data)

    @abc.abstractmethod
    def load_jpeg(self, data: bytes, info, box, flip: bool, transform):
        """Decode a JPEG the header says this decoder handles, crop `box`, flip."""

    def pop_counts(self) -> dict:
        return self.counts.pop()
