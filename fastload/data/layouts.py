"""How a dataset lies under `dataset.root`: which folders and files make each split.

A layout (the dataset yaml's `layout:`) builds one `Source` per split
(fastload/data/sources.py) and says which paths a copy of the dataset needs. Storage works
from layouts: storage=disk reads a split's source where it is, storage=tmpfs copies the
layout's paths and reads the copy through the same layout at the new root, storage=lmdb and
storage=shards pack the source. A plain path stands for an ImageFolder layout there.

    ImageFolderLayout(root)          root/<split>/<class>/<image>
    CocoLayout(root, images="{split}", annotations="annotations/instances_{split}.json")
    Div2kLayout(root, hr="DIV2K_{split}_HR", lr="DIV2K_{split}_LR_bicubic/X{scale}", scale=2)
"""

from __future__ import annotations

import abc
import dataclasses
import os
from pathlib import Path

import xxhash

from fastload.data.records import Schema
from fastload.data.sources import CocoSource, Div2kSource, ImageFolderSource

# The fixes a missing input's error gives (fastload/data/sources.py), in the config's words:
# a layout is what train.py builds from the dataset yaml.
COCO_CONFIG_FIXES = {
    "annotations": "Point dataset.root at the COCO folder that holds it (unzip "
    "annotations_trainval2017.zip there), or set dataset.layout.annotations to its path under "
    "dataset.root ('{{split}}' for the split's name, dataset.train_split / val_split).",
    "images": "Point dataset.root at the folder that holds the split's images, or set "
    "dataset.layout.images to their folder under dataset.root ('{{split}}' for the split's "
    "name): the folder of the .jpg files listed in {ann}.",
    "files": "Set dataset.layout.images to the folder of this split's images, or finish the "
    "download/unzip.",
}
DIV2K_CONFIG_FIXES = {
    "hr": "Point dataset.root at a DIV2K folder (DIV2K_train_HR/, DIV2K_valid_HR/, ...), or set "
    "dataset.layout.hr to the HR images' folder under dataset.root (\"dataset.layout.hr='{{split}}'\" "
    "for <root>/<split>/).",
    "scale": "dataset.scale={scale}: use 2, 3, 4 or 8 (HR side / LR side).",
    "lr": "Set dataset.layout.lr to the LR images' folder under dataset.root (DIV2K's: "
    "DIV2K_{{split}}_LR_bicubic/X{{scale}}), or dataset.layout.lr=null to make each LR patch "
    "from its HR patch by bicubic downscale.",
    "pair": "Check dataset.layout.lr and dataset.scale, or set dataset.layout.lr=null to make "
    "the LR patches from the HR ones.",
}


class Layout(abc.ABC):
    root: str

    @abc.abstractmethod
    def source(self, split: str):
        """The split's Source."""

    @property
    @abc.abstractmethod
    def schema(self) -> Schema:
        """The fields of the records its sources make (fastload/data/records.py)."""

    @abc.abstractmethod
    def stage_paths(self, splits) -> list[str]:
        """The folders and files (relative to root) a copy of these splits needs."""

    @abc.abstractmethod
    def pack_args(self, split: str, pack_root) -> list[str]:
        """`python -m fastload.pack FORMAT <these>` packs the split into pack_root/split."""

    def at(self, root) -> Layout:
        """The same layout under another root (a staged copy)."""
        return dataclasses.replace(self, root=str(root))

    def pack_suffix(self) -> str:
        """What tells this layout's packs from those of another layout of the same root (a
        COCO subset, a DIV2K scale), added to a pack's default folder name: "" with every
        option at its default, else e.g. "-subset5000", "-scale4". Without it two configs
        would share one pack folder, each finding the other's pack out of date."""
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "root" or value == f.default:
                continue
            if isinstance(value, int) and not isinstance(value, bool):
                parts.append(f"{f.name}{value}")
            else:  # a path template or null: short, and still one folder per value
                parts.append(f"{f.name}-{xxhash.xxh3_64_hexdigest(repr(value).encode())[:6]}")
        return "".join("-" + p for p in parts)


@dataclasses.dataclass(frozen=True)
class ImageFolderLayout(Layout):
    root: str

    def source(self, split: str) -> ImageFolderSource:
        return ImageFolderSource(Path(self.root) / split)

    @property
    def schema(self) -> Schema:
        return ImageFolderSource.schema

    def stage_paths(self, splits) -> list[str]:
        return list(dict.fromkeys(splits))

    def pack_args(self, split: str, pack_root) -> list[str]:
        return [str(self.root), str(pack_root), "--splits", split]


@dataclasses.dataclass(frozen=True)
class CocoLayout(Layout):
    root: str
    images: str = "{split}"
    annotations: str = "annotations/instances_{split}.json"
    subset: int | None = None  # the first N images by id (the recipes' 5,000-image subset)

    def annotation_file(self, split: str) -> Path:
        return Path(self.root) / self.annotations.format(split=split)

    def source(self, split: str) -> CocoSource:
        images = Path(self.root) / self.images.format(split=split)
        return CocoSource(self.annotation_file(split), images, self.subset, COCO_CONFIG_FIXES)

    @property
    def schema(self) -> Schema:
        return CocoSource.schema

    def stage_paths(self, splits) -> list[str]:
        paths = []
        for s in dict.fromkeys(splits):
            paths += [self.images.format(split=s), self.annotations.format(split=s)]
        return paths

    def pack_args(self, split: str, pack_root) -> list[str]:
        images = Path(self.root) / self.images.format(split=split)
        subset = ["--subset", str(self.subset)] if self.subset else []
        return [str(pack_root), "--source", "coco", "--annotations", str(self.annotation_file(split)),
                "--images", str(images), *subset, "--split-name", split]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Div2kLayout(Layout):
    root: str
    hr: str = "DIV2K_{split}_HR"
    lr: str | None = "DIV2K_{split}_LR_bicubic/X{scale}"  # null: LR made by bicubic downscale
    scale: int = 2

    def _lr(self, split: str) -> str | None:
        return None if not self.lr else self.lr.format(split=split, scale=self.scale)

    def source(self, split: str) -> Div2kSource:
        hr = Path(self.root) / self.hr.format(split=split)
        lr = self._lr(split)
        lr = None if lr is None else Path(self.root) / lr
        return Div2kSource(hr, lr, self.scale, DIV2K_CONFIG_FIXES)

    @property
    def schema(self) -> Schema:
        return Div2kSource.PAIRED if self.lr else Div2kSource.HR

    def stage_paths(self, splits) -> list[str]:
        paths = []
        for s in dict.fromkeys(splits):
            paths += [self.hr.format(split=s)] + ([self._lr(s)] if self._lr(s) else [])
        return paths

    def pack_args(self, split: str, pack_root) -> list[str]:
        args = [
            str(pack_root),
            "--source",
            "div2k",
            "--hr",
            str(Path(self.root) / self.hr.format(split=split)),
        ]
        if self._lr(split):
            args += ["--lr", str(Path(self.root) / self._lr(split)), "--scale", str(self.scale)]
        return args + ["--split-name", split]


def as_layout(root_or_layout) -> Layout:
    """A layout as it is, or a plain dataset root as an ImageFolder layout."""
    if isinstance(root_or_layout, Layout):
        return root_or_layout
    return ImageFolderLayout(os.fspath(root_or_layout) if root_or_layout is not None else "")
