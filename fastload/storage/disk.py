"""storage=disk: read each file where it is, through the dataset's layout; storage=slow_disk:
the same with an emulated slow disk's latency and bandwidth (`ReadThrottle`)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from fastload.data.layouts import as_layout
from fastload.data.sources import ImageFolderSource
from fastload.errors import ConfigError, StorageError
from fastload.host import Need, is_network_fs
from fastload.storage.base import DATASET_FS, Reader, Storage


class SourceReader(Reader):
    """The fields of each record of a Source (fastload/data/sources.py): image fields read
    from their files, the others from the source's arrays; never decodes."""

    def __init__(self, source, cold_cache: bool = False, throttle=None):
        self.source = source
        self.schema = source.schema
        self.cold_cache = bool(cold_cache)
        self.throttle = throttle  # a ReadThrottle (storage=slow_disk), or None
        self._images = frozenset(f.name for f in self.schema if f.coder.image)
        self._init_stats()

    def __len__(self) -> int:
        return len(self.source)

    @property
    def classes(self) -> tuple[str, ...]:
        return tuple(self.source.classes)

    def identity(self) -> tuple[str, list]:
        return "files", self.source.identity()

    @property
    def index(self):
        """The folder index of an ImageFolder source."""
        return self.source.index

    def describe(self, i: int, name: str | None = None) -> str:
        if name in self._images:
            return self.source.file(i, name)
        return self.source.path(i) if name is None else f"field {name} of {self.source.path(i)}"

    def store_root(self) -> str:
        return str(self.source.root)

    def store_files(self) -> list[str]:
        return [self.source.file(i, n) for n in sorted(self._images) for i in range(len(self))]

    def get(self, i: int, name: str):
        if name not in self._images:
            self.field(name)  # a field this source has
            return self.source.value(i, name)
        t0 = time.perf_counter()
        with open(self.source.file(i, name), "rb") as f:
            data = f.read()
        if self.throttle is not None:
            self.throttle.wait(len(data), t0)
        self._account(len(data), t0)
        return data

    def nonempty(self, name: str) -> np.ndarray | None:
        self.field(name)
        rows = self.source.rows(name)
        return None if rows is None else np.asarray(rows) > 0

    def column(self, name: str) -> np.ndarray:
        if not self.field(name).coder.column:
            raise StorageError(f"field {name!r} of {self.store_root()} is not an int column.")
        return self.source.column(name)


@dataclass(frozen=True)
class ReadThrottle:
    """An emulated slow disk: each file read takes at least `latency_ms` + its size at
    `mb_per_s` (a seek plus the transfer of a spinning disk), by sleeping out the rest
    after the real read. Per reading process, like one disk queue per worker: it models
    the latency and bandwidth one reader sees, not a disk shared by all of them."""

    latency_ms: float
    mb_per_s: float

    def wait(self, nbytes: int, t0: float) -> None:
        due = t0 + self.latency_ms / 1000 + nbytes / (self.mb_per_s * 1e6)
        left = due - time.perf_counter()
        if left > 0:
            time.sleep(left)


class DiskReader(SourceReader):
    """An ImageFolder split folder read in place."""

    def __init__(self, split_dir: str | os.PathLike, cold_cache: bool = False):
        super().__init__(ImageFolderSource(split_dir), cold_cache)


class DiskStorage(Storage):
    """The files in place, laid out as the dataset's layout says."""

    def needs(self, dataset_fs: str) -> list[Need]:
        """Every epoch reads every file where it is: on a network file system each image is
        a round trip."""
        if not is_network_fs(dataset_fs):
            return []
        return [Need(DATASET_FS, "warn",
                     f"a network file system ({dataset_fs}): storage=disk reads every image "
                     "from it each epoch, a round trip each, and many workers' small reads "
                     "queue on the server",
                     "Stage it to local RAM once per node (storage=tmpfs), or pack it into a "
                     "few large files read sequentially (storage=shards, or storage=lmdb); "
                     "storage=shards storage.max_side=256 also stores less data.")]  # fmt: skip

    def __init__(self, cold_cache: bool = False, latency_ms=None, mb_per_s=None):
        # Evict the split's pages from the page cache before each epoch (measure the disk).
        self.cold_cache = bool(cold_cache)
        self.throttle = None
        if latency_ms is not None or mb_per_s is not None:
            for key, value in (("latency_ms", latency_ms), ("mb_per_s", mb_per_s)):
                if (
                    not isinstance(value, (int, float))
                    or value < 0
                    or (key == "mb_per_s" and value == 0)
                ):
                    raise ConfigError(
                        f"storage.{key}={value!r}: an emulated slow disk needs both "
                        f"storage.latency_ms >= 0 and storage.mb_per_s > 0 (or neither)."
                    )
            self.throttle = ReadThrottle(float(latency_ms), float(mb_per_s))

    def open(self, root, split: str) -> SourceReader:
        """`root`: a layout (fastload/data/layouts.py) or an ImageFolder dataset root."""
        source = as_layout(root).source(split)
        return SourceReader(source, cold_cache=self.cold_cache, throttle=self.throttle)
