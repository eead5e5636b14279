"""storage=disk: read each image file where it is."""

from __future__ import annotations

import os
import time

from fastload.data.folder import FolderIndex, index_image_folder
from fastload.storage.base import Reader, Storage


class DiskReader(Reader):
    """`(bytes, target)` for an index of an ImageFolder split folder; never decodes."""

    def __init__(self, split_dir: str | os.PathLike, cold_cache: bool = False):
        self.index: FolderIndex = index_image_folder(split_dir)
        self.cold_cache = bool(cold_cache)
        self._init_stats()

    def __len__(self) -> int:
        return len(self.index)

    @property
    def classes(self) -> tuple[str, ...]:
        return self.index.classes

    @property
    def targets(self):
        return self.index.targets

    def describe(self, i: int) -> str:
        return str(self.index.path(i))

    def store_root(self) -> str:
        return str(self.index.root)

    def store_files(self) -> list[str]:
        return [str(self.index.path(i)) for i in range(len(self.index))]

    def read(self, i: int) -> tuple[bytes, int]:
        t0 = time.perf_counter()
        with open(self.index.path(i), "rb") as f:
            data = f.read()
        self._account(len(data), t0)
        return data, int(self.index.targets[i])


class DiskStorage(Storage):
    """The files in place: `<root>/<split>/<class>/<image>`."""

    def __init__(self, cold_cache: bool = False):
        # Evict the split's pages from the page cache before each epoch (measure the disk).
        self.cold_cache = bool(cold_cache)

    def open(self, root, split: str) -> DiskReader:
        return DiskReader(os.path.join(root, split), cold_cache=self.cold_cache)
