"""ImageFolder indexing with torchvision's rules, held in numpy arrays.

Rules (torchvision.datasets.ImageFolder): classes are the sub-folders of the split folder,
sorted by name, class_to_idx = their position; samples are the files with an image
extension, walked in sorted order, following symlinks -- but never into a folder already
indexed (by real path: a link loop or a second path to the same images is skipped and named
in a warning). Paths are stored as one fixed-width numpy bytes array (not a list of str) so
that DataLoader workers do not copy the whole list page by page through reference counting
(pytorch#13246): the file system's bytes of each name (os.fsencode, so a name that is not
UTF-8 comes back as os.walk gave it), 1 byte a character where a '<U' array took 4 (its
longest path sets every row's width: ~150 MB per rank for ImageNet's 1.28M, now ~40 MB).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastload.errors import DatasetError, NotAnImageFolder

log = logging.getLogger("fastload")

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


_FS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()  # os.fsdecode's


@dataclass(frozen=True)
class FolderIndex:
    root: Path
    classes: tuple[str, ...]
    paths: np.ndarray  # relative paths as bytes (os.fsencode), dtype 'S…': `name(i)` decodes
    targets: np.ndarray  # int64
    skipped: tuple[str, ...] = ()  # linked folders not followed (already indexed elsewhere)
    width: int = 0  # the longest relative path in characters (`names_text`)

    def __len__(self) -> int:
        return len(self.targets)

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}

    def name(self, i: int) -> str:
        """Record i's path relative to the split folder, as os.walk spelled it."""
        return self.paths[i].decode(*_FS)

    def names(self, start: int, stop: int) -> list[str]:
        return [p.decode(*_FS) for p in self.paths[start:stop].tolist()]

    def path(self, i: int) -> Path:
        return self.root / self.name(i)

    def names_text(self) -> TextColumn:
        """The relative paths as the '<U' array of them that the index held before it held
        bytes, for digests (fastload/agreement.py), made a chunk at a time."""
        return TextColumn(self, self.width)


class TextColumn:
    """A FolderIndex's names as a fixed-width '<U{width}' numpy array would feed a digest
    (`digest_into(h)`: the header and bytes agreement.feed gives an array), without the
    whole array (4 bytes a character) in memory at once: split fingerprints kept in
    checkpoints stay those of the '<U' index."""

    CHUNK = 1 << 16

    def __init__(self, index: FolderIndex, width: int):
        self.index, self.dtype = index, np.dtype(f"U{max(1, width)}")

    def digest_into(self, h) -> None:
        n = len(self.index.paths)
        h.update(f"{self.dtype.str}{(n,)}\0".encode())
        for a in range(0, n, self.CHUNK):
            h.update(np.array(self.index.names(a, a + self.CHUNK), self.dtype))


def walk_once(top, seen: set[str], skipped: list[str]):
    """os.walk(top, followlinks=True) in sorted order that never enters a folder whose real
    path is in `seen` (adding each one it enters): without it a link back up the tree
    (`ln -s .. class0/loop`) repeats the tree ~40 levels deep until the kernel's ELOOP, and a
    second link to a folder indexes its files twice. The links not followed go to `skipped`."""
    seen.add(os.path.realpath(top))

    def unreadable(exc: OSError) -> None:  # os.walk skipped such a folder without a word
        raise NotAnImageFolder(
            f"cannot read the folder {exc.filename} ({exc.strerror}): its images would be left "
            f"out of the dataset (or its whole class). Make it readable (chmod -R u+rX) or "
            f"move it out of the dataset."
        )

    for dirpath, dirnames, filenames in os.walk(top, followlinks=True, onerror=unreadable):
        for name in sorted(dirnames):
            real = os.path.realpath(os.path.join(dirpath, name))
            if real in seen:
                dirnames.remove(name)
                skipped.append(os.path.join(dirpath, name))
            seen.add(real)
        dirnames.sort()
        yield dirpath, dirnames, filenames


def warn_skipped(where, skipped: list[str]) -> None:
    if skipped:
        shown = ", ".join(skipped[:5]) + (" ..." if len(skipped) > 5 else "")
        log.warning(
            "%s: skipped %d linked folder(s) that lead to a folder already indexed (a symlink "
            "loop or a second path to the same images): %s",
            where, len(skipped), shown,
        )  # fmt: skip


# What names the folder, for the fixes below: train.py's option, or the pack command's SRC.
CHECK = "dataset.root (train.py) or SRC (python -m fastload.pack)"


def index_image_folder(split_dir: str | os.PathLike) -> FolderIndex:
    split_dir = Path(split_dir)
    if not split_dir.is_dir():
        raise DatasetError(
            f"dataset folder {split_dir} does not exist. Point dataset.root at a folder holding "
            f"'{split_dir.name}/<class>/<image>' (torchvision ImageFolder layout)."
        )
    classes = sorted(e.name for e in os.scandir(split_dir) if e.is_dir())
    if not classes:
        raise NotAnImageFolder(
            f"{split_dir} has no class folders. Expected {split_dir}/<class_name>/<image>.jpg "
            f"(torchvision ImageFolder layout); check {CHECK}."
        )
    paths: list[str] = []
    targets: list[int] = []
    # The split folder and every class folder count as seen from the start, so a link back up
    # the tree (`ln -s .. class0/loop`) or into another class is what gets skipped; a class
    # folder that is a link to another class keeps its index and gets no images.
    seen = {os.path.realpath(split_dir)}
    skipped: list[str] = []
    class_dirs = []
    for cls in classes:
        real = os.path.realpath(split_dir / cls)
        class_dirs.append(None if real in seen else split_dir / cls)
        if real in seen:
            skipped.append(str(split_dir / cls))
        seen.add(real)
    for idx, class_dir in enumerate(class_dirs):
        if class_dir is None:
            continue
        for dirpath, _, filenames in walk_once(class_dir, seen, skipped):
            rel = os.path.relpath(dirpath, split_dir)
            for name in sorted(filenames):
                if name.lower().endswith(IMG_EXTENSIONS):
                    paths.append(os.path.join(rel, name))
                    targets.append(idx)
    if not paths:
        raise NotAnImageFolder(
            f"{split_dir} has class folders ({', '.join(classes[:5])}…) but no image files "
            f"with extensions {', '.join(IMG_EXTENSIONS)}; check {CHECK}."
        )
    warn_skipped(split_dir, skipped)
    width = max(map(len, paths))
    names = np.array([os.fsencode(p) for p in paths], np.bytes_)
    del paths
    return FolderIndex(split_dir, tuple(classes), names, np.array(targets, np.int64),
                       tuple(skipped), width)  # fmt: skip
