"""backend=accimage: torchvision's accimage backend (libjpeg-turbo + Intel IPP), JPEG only.

accimage (github.com/pytorch/accimage, conda-forge only, no wheels) offers `Image(path)`,
`crop`, `resize`, `transpose(FLIP_LEFT_RIGHT)` and `copyto(buffer)`. Its constructor takes a
file *path* only, while storage hands us bytes (files, LMDB, shards alike), so the bytes are
written to one scratch file per process on tmpfs (/dev/shm when present): a memory copy of
~30-150 KB, small beside the decode. The crop box is sampled on the header's full size (the
same draw as backend=pil); non-JPEG, CMYK, EXIF-rotated, cut-short or undecodable files go
through PIL's `open_rgb` with the same box, counted by reason. Note: accimage's resize takes the
size tuple as (height, width); the output here is square, so the order cannot bite.
"""

from __future__ import annotations

import atexit
import os
import tempfile

import numpy as np

from fastload.decode.base import JpegOnlyBackend, load_with_box
from fastload.decode.jpeg_header import FALLBACK_REASONS, Counts
from fastload.decode.pil import pillow_name
from fastload.errors import ConfigError

FLIP_LEFT_RIGHT = 0  # PIL.Image.FLIP_LEFT_RIGHT, the only transpose accimage implements


def import_accimage():
    try:
        import accimage
    except ImportError:
        raise ConfigError(
            "backend=accimage needs accimage, which has no PyPI wheels: install it from "
            "conda-forge with `conda install -c conda-forge accimage` (in a conda env), or use "
            "backend=turbo (libjpeg-turbo from PyPI: pip install simplejpeg) or backend=pil."
        ) from None
    return accimage


class AccimageBackend(JpegOnlyBackend):
    name = "accimage"
    decoder_module, install = "accimage", "conda install -c conda-forge accimage"

    def __init__(self, scratch_dir: str | None = None):
        self.accimage = import_accimage()
        self.scratch_dir = scratch_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        self._scratch: str | None = None  # per process: created lazily, never pickled
        self.counts = Counts(*(f"decode_fallback_{r}" for r in FALLBACK_REASONS))

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("accimage", "_scratch")}

    def __setstate__(self, state):
        self.__dict__.update(state, _scratch=None)
        self.accimage = import_accimage()

    def info(self) -> dict:
        version = getattr(self.accimage, "__version__", "unknown")
        return {"decoder": f"accimage-{version}", "decoder_fallback": pillow_name()}

    def _scratch_path(self) -> str:
        if self._scratch is None or not self._scratch.endswith(f"-{os.getpid()}.jpg"):
            fd, path = tempfile.mkstemp(
                prefix="fastload-accimage-", suffix=f"-{os.getpid()}.jpg", dir=self.scratch_dir
            )
            os.close(fd)
            atexit.register(_unlink, path)
            self._scratch = path
        return self._scratch

    def load_jpeg(self, data: bytes, info, box, flip: bool, transform) -> np.ndarray:
        left, top, w, h = (round(v) for v in box)  # whole pixels only (the evaluation box is not)
        size = transform.size
        path = self._scratch_path()
        try:
            with open(path, "wb") as f:
                f.write(data)
            img = self.accimage.Image(path)
            img.crop((left, top, left + w, top + h))
            img.resize((size, size))
            if flip:
                img.transpose(FLIP_LEFT_RIGHT)
            chw = np.empty((img.channels, img.height, img.width), np.uint8)
            img.copyto(chw)
        except Exception:  # accimage raises plain IOError/ValueError on bytes it cannot read
            self.counts.add("decode_fallback_decode_error")
            return load_with_box(data, box, flip, size)
        return chw.transpose(1, 2, 0)  # HWC view; the dataset permutes it back to CHW


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
