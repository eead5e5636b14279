"""storage=disk: read each file where it is, through the dataset's layout."""

from __future__ import annotations

import os
import time

import numpy as np

from fastload.data.layouts import as_layout
from fastload.data.sources import ImageFolderSource
from fastload.storage.base import Reader, Storage


class SourceReader(Reader):
    """`(bytes, target)` for each record of a Source (fastload/data/sources.py), plus its
    boxes and paired image where the source has them; never decodes."""

    def __init__(self, source, cold_cache: bool = False):
        self.source = source
        self.cold_cache = bool(cold_cache)
        self.has_pairs = bool(source.has_pairs)
        self._init_stats()

    def __len__(self) -> int:
        return len(self.source)

    @property
    def classes(self) -> tuple[str, ...]:
        return tuple(self.source.classes)

    @property
    def targets(self) -> np.ndarray:
        return self.source.targets

    @property
    def index(self):
        """The folder index of an ImageFolder source."""
        return self.source.index

    def describe(self, i: int) -> str:
        return self.source.path(i)

    def store_root(self) -> str:
        return str(self.source.root)

    def store_files(self) -> list[str]:
        pairs = [self.source.pair(i) for i in range(len(self))] if self.has_pairs else []
        return [self.source.path(i) for i in range(len(self))] + pairs

    def _read_file(self, path: str) -> bytes:
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            data = f.read()
        self._account(len(data), t0)
        return data

    def read(self, i: int) -> tuple[bytes, int]:
        return self._read_file(self.source.path(i)), int(self.source.targets[i])

    def boxes(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.source.boxes(i)

    def read_pair(self, i: int) -> bytes:
        if not self.has_pairs:
            return super().read_pair(i)
        return self._read_file(self.source.pair(i))

    def describe_pair(self, i: int) -> str:
        return self.source.pair(i) or super().describe_pair(i)


class DiskReader(SourceReader):
    """An ImageFolder split folder read in place."""

    def __init__(self, split_dir: str | os.PathLike, cold_cache: bool = False):
        super().__init__(ImageFolderSource(split_dir), cold_cache)


class DiskStorage(Storage):
    """The files in place, laid out as the dataset's layout says."""

    def __init__(self, cold_cache: bool = False):
        # Evict the split's pages from the page cache before each epoch (measure the disk).
        self.cold_cache = bool(cold_cache)

    def open(self, root, split: str) -> SourceReader:
        """`root`: a layout (fastload/data/layouts.py) or an ImageFolder dataset root."""
        return SourceReader(as_layout(root).source(split), cold_cache=self.cold_cache)
