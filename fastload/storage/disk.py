"""storage=disk: read each image file where it is."""

from __future__ import annotations

import os

from fastload.data.folder import FolderIndex, index_image_folder


class DiskStorage:
    """`(bytes, target)` for an index of an ImageFolder split; never decodes."""

    def __init__(self, root: str | os.PathLike, split: str):
        self.index: FolderIndex = index_image_folder(os.path.join(root, split))

    def __len__(self) -> int:
        return len(self.index)

    @property
    def classes(self) -> tuple[str, ...]:
        return self.index.classes

    @property
    def targets(self):
        return self.index.targets

    def describe(self, i: int) -> str:
        """Where sample i lives, for error messages."""
        return str(self.index.path(i))

    def read(self, i: int) -> tuple[bytes, int]:
        with open(self.index.path(i), "rb") as f:
            return f.read(), int(self.index.targets[i])
