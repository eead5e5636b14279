"""ImageFolder indexing with torchvision's rules, held in numpy arrays.

Rules (torchvision.datasets.ImageFolder): classes are the sub-folders of the split folder,
sorted by name, class_to_idx = their position; samples are the files with an image
extension, walked in sorted order, following symlinks. Paths are stored as one fixed-width
numpy string array (not a list of str) so that DataLoader workers do not copy the whole list
page by page through reference counting (pytorch#13246).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastload.errors import DatasetError

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclass(frozen=True)
class FolderIndex:
    root: Path
    classes: tuple[str, ...]
    paths: np.ndarray  # relative paths, dtype '<U…'
    targets: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.targets)

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}

    def path(self, i: int) -> Path:
        return self.root / str(self.paths[i])


def index_image_folder(split_dir: str | os.PathLike) -> FolderIndex:
    split_dir = Path(split_dir)
    if not split_dir.is_dir():
        raise DatasetError(
            f"dataset folder {split_dir} does not exist. Point dataset.root at a folder holding "
            f"'{split_dir.name}/<class>/<image>' (torchvision ImageFolder layout)."
        )
    classes = sorted(e.name for e in os.scandir(split_dir) if e.is_dir())
    if not classes:
        raise DatasetError(
            f"{split_dir} has no class folders. Expected {split_dir}/<class_name>/<image>.jpg "
            f"(torchvision ImageFolder layout); check dataset.root."
        )
    paths: list[str] = []
    targets: list[int] = []
    for idx, cls in enumerate(classes):
        for dirpath, dirnames, filenames in os.walk(split_dir / cls, followlinks=True):
            dirnames.sort()
            rel = os.path.relpath(dirpath, split_dir)
            for name in sorted(filenames):
                if name.lower().endswith(IMG_EXTENSIONS):
                    paths.append(os.path.join(rel, name))
                    targets.append(idx)
    if not paths:
        raise DatasetError(
            f"{split_dir} has class folders ({', '.join(classes[:5])}…) but no image files "
            f"with extensions {', '.join(IMG_EXTENSIONS)}; check dataset.root."
        )
    return FolderIndex(split_dir, tuple(classes), np.array(paths), np.array(targets, np.int64))
