"""backend=accimage: torchvision's accimage backend (libjpeg-turbo + Intel IPP), JPEG only.

accimage (github.com/pytorch/accimage, conda-forge only, no wheels) offers `Image(path)`,
`crop`, `resize`, `transpose(FLIP_LEFT_RIGHT)` and `copyto(buffer)`. Its constructor takes a
file *path* only, while storage hands us bytes (files, LMDB, shards alike), so the bytes are
written to one scratch file per process on tmpfs (/dev/shm when present): a memory copy of
~30-150 KB, small beside the decode. The file is unlinked as soon as it is made and accimage
opens it as /proc/self/fd/<fd>, so nothing is left behind however the process ends (DataLoader
workers end with os._exit, past atexit); without /proc it keeps its name and multiprocessing's
finalizers, which workers run too, remove it at the process's exit. The crop box is sampled
on the header's full size (the same draw as backend=pil); non-JPEG, CMYK, EXIF-rotated,
cut-short or undecodable files go through PIL's `open_rgb` with the same box, counted by
reason. Note: accimage's resize takes the size tuple as (height, width); the output here is
square, so the order cannot bite.
"""

from __future__ import annotations

import os
import tempfile
from multiprocessing.util import Finalize

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
        # (pid, fd, path) of this process's scratch file: created lazily, never pickled; a
        # forked worker sees its parent's and makes its own (the parent writes to that one)
        self._scratch: tuple[int, int, str] | None = None
        self.counts = Counts(*(f"decode_fallback_{r}" for r in FALLBACK_REASONS))

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("accimage", "_scratch")}

    def __setstate__(self, state):
        self.__dict__.update(state, _scratch=None)
        self.accimage = import_accimage()

    def info(self) -> dict:
        version = getattr(self.accimage, "__version__", "unknown")
        return {"decoder": f"accimage-{version}", "decoder_fallback": pillow_name()}

    def _scratch_path(self) -> tuple[int, str]:
        """(fd, path accimage opens) of this process's scratch file."""
        if self._scratch is None or self._scratch[0] != os.getpid():
            if self._scratch is not None:
                os.close(self._scratch[1])  # the parent's file, inherited through fork
            self._scratch = None
            fd, path = tempfile.mkstemp(
                prefix="fastload-accimage-", suffix=f"-{os.getpid()}.jpg", dir=self.scratch_dir
            )
            proc = fd_path(fd)
            if proc is not None:
                os.unlink(path)
                path = proc
            else:
                Finalize(None, _unlink, args=(path,), exitpriority=0)
            self._scratch = (os.getpid(), fd, path)
        return self._scratch[1:]

    def __del__(self):
        scratch = getattr(self, "_scratch", None)
        if scratch is not None and scratch[0] == os.getpid():
            os.close(scratch[1])

    def load_jpeg(self, data: bytes, info, box, flip: bool, transform) -> np.ndarray:
        left, top, w, h = (round(v) for v in box)  # whole pixels only (the evaluation box is not)
        size = transform.size
        fd, path = self._scratch_path()
        try:
            _rewrite(fd, data)
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


def fd_path(fd: int) -> str | None:
    """A path that opens the file behind `fd` even once it has no name (Linux's
    /proc/self/fd), or None where there is none."""
    path = f"/proc/self/fd/{fd}"
    return path if os.path.exists(path) else None


def _rewrite(fd: int, data: bytes) -> None:
    """The file behind `fd` holds `data` and nothing else."""
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], done)
    os.ftruncate(fd, len(view))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
