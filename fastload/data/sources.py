"""What `python -m fastload.pack` reads: one small class per source layout.

Every source has the same face: `name` (the split folder the pack gets), `classes`, `root`
(recorded in the pack's metadata), `len()`, and `record(i)` -> `SourceRecord` (the image path,
an int64 target, optional detection boxes + labels, optional paired image path), in a fixed
order. Packing never decodes here; the pack workers read and (re-)encode the files.

* `ImageFolderSource(split_dir)`: torchvision ImageFolder rules (fastload/data/folder.py);
  target = class index.
* `CocoSource(annotations, images)`: COCO instances json; one record per image, sorted by
  image id; target = the COCO image id; boxes = every annotation's [x, y, w, h] (float32,
  pixels of the stored image), labels = its category_id (int64); zero boxes is allowed.
  classes = category names in category-id order (`category_ids` holds the ids).
* `Div2kSource(hr, lr=None, scale=None)`: super-resolution pairs; records = the HR images
  (sorted by name), target = the record's position; with `lr` each record's pair is the LR
  image of the same stem (`0001x2.png`, DIV2K's naming, or `0001.png`) in the LR folder.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastload.data.folder import IMG_EXTENSIONS, index_image_folder
from fastload.errors import DatasetError


@dataclass(frozen=True)
class SourceRecord:
    path: str
    target: int
    boxes: np.ndarray | None = None  # (n, 4) float32 x, y, w, h
    labels: np.ndarray | None = None  # (n,) int64 category ids
    pair: str | None = None  # the paired image (DIV2K LR)


class ImageFolderSource:
    kind = "imagefolder"
    has_boxes = has_pairs = False

    def __init__(self, split_dir):
        self.index = index_image_folder(split_dir)
        self.root = str(Path(split_dir).absolute())
        self.name = Path(split_dir).absolute().name
        self.classes = self.index.classes

    def __len__(self) -> int:
        return len(self.index)

    def record(self, i: int) -> SourceRecord:
        return SourceRecord(str(self.index.path(i)), int(self.index.targets[i]))


class CocoSource:
    kind = "coco"
    has_boxes, has_pairs = True, False

    def __init__(self, annotations, images):
        ann_path, self.images = Path(annotations).absolute(), Path(images).absolute()
        if not ann_path.is_file():
            raise DatasetError(
                f"COCO annotation file {ann_path} does not exist. Pass --annotations "
                f"<coco>/annotations/instances_<split>.json (unzip annotations_trainval2017.zip)."
            )
        if not self.images.is_dir():
            raise DatasetError(
                f"COCO image folder {self.images} does not exist. Pass --images <coco>/<split> "
                f"(the folder holding the .jpg files listed in {ann_path.name})."
            )
        try:
            doc = json.loads(ann_path.read_text(encoding="utf-8"))
            images = sorted(doc["images"], key=lambda im: int(im["id"]))
            cats = sorted(doc.get("categories", []), key=lambda c: int(c["id"]))
            anns = doc.get("annotations", [])
        except (ValueError, KeyError, TypeError) as exc:
            raise DatasetError(
                f"{ann_path} is not a COCO instances file ({type(exc).__name__}: {exc}); "
                f"it needs 'images' (id, file_name) and 'annotations' (image_id, bbox, "
                f"category_id)."
            ) from None
        self.root = str(self.images)
        stem = ann_path.stem
        self.name = stem[len("instances_") :] if stem.startswith("instances_") else stem
        self.classes = tuple(str(c.get("name", c["id"])) for c in cats)
        self.category_ids = np.array([int(c["id"]) for c in cats], np.int64)
        self.ids = np.array([int(im["id"]) for im in images], np.int64)
        self.files = np.array([str(im["file_name"]) for im in images])
        by_image: dict[int, list] = {}
        for a in anns:
            by_image.setdefault(int(a["image_id"]), []).append(a)
        self._boxes, self._labels = [], []
        for image_id in self.ids:
            group = by_image.get(int(image_id), [])
            self._boxes.append(np.array([a["bbox"] for a in group], np.float32).reshape(-1, 4))
            self._labels.append(np.array([a["category_id"] for a in group], np.int64))
        missing = [f for f in self.files if not (self.images / f).is_file()]
        if missing:
            raise DatasetError(
                f"{len(missing)} image(s) listed in {ann_path} are missing from {self.images}, "
                f"first: {self.images / missing[0]}. Point --images at the folder of this "
                f"split, or finish the download/unzip."
            )

    def __len__(self) -> int:
        return len(self.ids)

    def record(self, i: int) -> SourceRecord:
        return SourceRecord(
            str(self.images / self.files[i]), int(self.ids[i]), self._boxes[i], self._labels[i]
        )


class Div2kSource:
    kind = "div2k"
    has_boxes = False

    def __init__(self, hr, lr=None, scale=None):
        self.hr = Path(hr).absolute()
        if not self.hr.is_dir():
            raise DatasetError(
                f"DIV2K HR folder {self.hr} does not exist. Pass --hr <div2k>/DIV2K_train_HR."
            )
        self.files = np.array(
            sorted(n for n in os.listdir(self.hr) if n.lower().endswith(IMG_EXTENSIONS))
        )
        if not len(self.files):
            raise DatasetError(f"{self.hr} holds no images ({', '.join(IMG_EXTENSIONS)}).")
        self.root, self.name, self.classes = str(self.hr), self.hr.name, ()
        self.lr, self.scale = (Path(lr).absolute() if lr else None), scale
        self.has_pairs = self.lr is not None
        self.pairs = None
        if self.lr is not None:
            if scale not in (2, 3, 4, 8):
                raise DatasetError(f"--lr {self.lr} needs --scale 2|3|4|8 (got {scale}).")
            if not self.lr.is_dir():
                raise DatasetError(
                    f"DIV2K LR folder {self.lr} does not exist. Pass --lr "
                    f"<div2k>/DIV2K_train_LR_bicubic/X{scale}."
                )
            pairs = []
            for name in self.files:
                stem, ext = os.path.splitext(name)
                for cand in (f"{stem}x{scale}{ext}", name):
                    if (self.lr / cand).is_file():
                        pairs.append(cand)
                        break
                else:
                    raise DatasetError(
                        f"no LR image for {self.hr / name} in {self.lr} (looked for "
                        f"{stem}x{scale}{ext} and {name}); check --lr and --scale."
                    )
            self.pairs = np.array(pairs)

    def __len__(self) -> int:
        return len(self.files)

    def record(self, i: int) -> SourceRecord:
        pair = None if self.pairs is None else str(self.lr / self.pairs[i])
        return SourceRecord(str(self.hr / self.files[i]), i, pair=pair)
