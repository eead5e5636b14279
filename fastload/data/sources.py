"""One split of a dataset as it lies on disk: what storage=disk reads, tmpfs stages and
`python -m fastload.pack` packs. One small class per layout (fastload/data/layouts.py builds
them from the dataset config).

Every source has the same face, backed by numpy arrays (no per-worker copy-on-access growth):
`name` (the split folder a pack gets), `classes`, `root`, `schema` (its records' named
fields, fastload/data/records.py), `len()`, `file(i, name)` (the file of an image field;
`file_paths(name, start, stop)` of a run of records, `stated(i, name)` its annotated size),
`value(i, name)` (any other field), `column(name)` (an int field of every record, int64)
and `record(i)` -> {name: value}, image fields as `ImageFile`s, all in a fixed order.
Packing never decodes here; the pack workers read and (re-)encode the files.

* `ImageFolderSource(split_dir)`: torchvision ImageFolder rules (fastload/data/folder.py);
  fields: image, label (the class index).
* `CocoSource(annotations, images, subset=None)`: COCO instances json (read with
  pycocotools); one record per image, sorted by image id (the first `subset` of them when
  set); fields: image, image_id, boxes = its annotations' [x, y, w, h] (float32, pixels,
  clipped to the image), labels = their category_id (int64). Crowd annotations and
  degenerate boxes (no area inside the image) are dropped and counted (`dropped`); an image
  may have zero boxes. classes = category names in category-id order (`category_ids`).
  A file whose image or annotation ids repeat, or with an annotation of a category it does
  not list, is refused (DatasetError naming it) when it is read.
* `Div2kSource(hr, lr=None, scale=None)`: super-resolution pairs; records = the HR images
  (sorted by name); fields: image, position (the record's place); with `lr` also lr, the LR
  image of the same stem (`0001x2.png`, DIV2K's naming, or `0001.png`) in the LR folder.

A missing input is a DatasetError that names the path and says how to fix it in the words of
whoever named the path: the pack command's flags by default (`COCO_PACK_FIXES`,
`DIV2K_PACK_FIXES`); a layout, which train.py builds from the config, passes the config's
keys instead (fastload/data/layouts.py).
"""

from __future__ import annotations

import math
import os
from itertools import chain, repeat
from operator import itemgetter
from pathlib import Path

import numpy as np

from fastload.data.folder import IMG_EXTENSIONS, index_image_folder
from fastload.data.records import Field, ImageFile, Schema
from fastload.errors import DatasetError

IMAGE_FIELD = Field("image", "encoded", ext="")  # <key>.jpg / .png in WebDataset shards


class Source:
    """What the sources share: a record is its image files and the values of its other
    fields (`_values`: name -> a per-record array, or a function of the index)."""

    schema: Schema
    _files: dict  # image field name -> function i -> path
    _values: dict  # other field name -> np.ndarray (one value per record) or i -> value

    def file(self, i: int, name: str = "image") -> str:
        return self._files[name](i)

    def file_paths(self, name: str, start: int, stop: int) -> list[str]:
        """`file(i, name)` of records start..stop-1 (a source may list them faster)."""
        return [self.file(i, name) for i in range(start, stop)]

    def stated(self, i: int, name: str) -> tuple[int, int] | None:
        """The (width, height) the annotations state for record i's image field `name`
        (`ImageFile.stated`); None where they state none."""
        return None

    def path(self, i: int) -> str:
        """The record's image file (where it lives, for errors)."""
        return self.file(i, "image")

    def value(self, i: int, name: str):
        v = self._values[name]
        return v(i) if callable(v) else v[i]

    def column(self, name: str) -> np.ndarray:
        return self._values[name]

    def rows(self, name: str) -> np.ndarray | None:
        """The length of array field `name` of every record (int64), where the source holds
        it without building the values; None where it does not."""
        return None

    def record(self, i: int) -> dict:
        out = {}
        for f in self.schema:
            if f.name in self._files:
                out[f.name] = ImageFile(
                    self.file(i, f.name), self._divide.get(f.name, 1), self.stated(i, f.name)
                )
            else:
                out[f.name] = self.value(i, f.name)
        return out

    _divide: dict = {}  # image field -> how many times smaller its sides are (DIV2K LR)

    def pack_metadata(self) -> dict:
        """What a pack of this source records of it besides its fields (meta["params"])."""
        return {}

    def identity(self) -> list:
        """Its records' files by their names inside the source, in order (not where the
        source lies: a node's own copy of the dataset has the same names), and what else a
        record holds that its int fields do not show; nothing is read or stat'ed."""
        return []

    def check_packing(self, resized: bool) -> None:
        """Refuse (DatasetError) a pack this source cannot be packed into; `resized`: its
        images are stored smaller than the files."""


class ImageFolderSource(Source):
    kind = "imagefolder"
    schema = Schema(IMAGE_FIELD, Field("label", "int", ext="", classes=True))

    def __init__(self, split_dir):
        split_dir = Path(split_dir).absolute()  # as spelled (messages); a pack digests real paths
        self.index = index_image_folder(split_dir)
        self.root = str(split_dir)
        self.name = split_dir.name
        self.classes = self.index.classes
        self._files = {"image": self._path}
        self._values = {"label": self.index.targets}

    def __len__(self) -> int:
        return len(self.index)

    def identity(self) -> list:
        return [self.index.names_text()]

    def _path(self, i: int) -> str:
        # str(index.path(i)) as a string join: a pathlib Path per read was ~3 % of a worker's
        # time on JPEGs (the index root is a normalised Path, the names are plain relative).
        return os.path.join(self.index.root, self.index.name(i))

    def file_paths(self, name: str, start: int, stop: int) -> list[str]:
        root = os.path.join(self.index.root, "")  # = _path's, a concatenation per file
        return [root + p for p in self.index.names(start, stop)]


def _load_coco(ann_path: Path):
    """pycocotools' COCO index of an instances file, quietly, and its `_Columns` (None when
    a field is not of its plain JSON type); DatasetError naming the file when it is not one,
    or its ids do not fit together (`_check_ids`)."""
    import contextlib
    import io

    from pycocotools.coco import COCO

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints timings
            coco = COCO(str(ann_path))
        columns = _Columns.read(coco.dataset)
        if columns is None:  # one of the checks below fails, or passes another type
            _check_fields(coco.dataset)
        _check_ids(ann_path, coco.dataset, columns)
    except (ValueError, KeyError, TypeError, AssertionError) as exc:
        raise DatasetError(
            f"{ann_path} is not a COCO instances file ({type(exc).__name__}: {exc}); it needs "
            f"'images' (id, file_name), 'annotations' (image_id, bbox [x, y, w, h], "
            f"category_id) and 'categories' (id, name)."
        ) from None
    return coco, columns


class _Columns:
    """An instances file's fields as arrays, read only when every one is of its plain JSON
    type (ids and category ids ints that fit int64, file names strings, boxes lists of four
    finite ints or floats, image sizes ints, floats or null), which `_check_fields` and
    CocoSource's per-annotation reading pass exactly as these arrays give them: ~10x less
    CPU than those loops on COCO's 860k annotations. `read` gives None for any other file,
    which the loops then refuse (with their first error, in file order) or read."""

    def __init__(self, data: dict):
        images, cats = data["images"], data["categories"]
        anns = data.get("annotations", [])
        if not (type(images) is list and type(cats) is list and type(anns) is list and cats):
            raise TypeError
        for items in (images, cats, anns):
            _of_types(items, dict)
        self.image_ids = _ints(map(itemgetter("id"), images))
        self.file_names = list(map(itemgetter("file_name"), images))
        _of_types(self.file_names, str)
        self.widths = [im.get("width") for im in images]
        self.heights = [im.get("height") for im in images]
        _of_types(self.widths, int, float, type(None))
        _of_types(self.heights, int, float, type(None))
        # the sides boxes are clipped to (_clip_xywh: none where 0 or not stated)
        self.sides = np.stack(
            [_floats([v or 0 for v in x]) for x in (self.widths, self.heights)], 1
        )
        self.sides[self.sides == 0] = np.inf
        self.category_ids = _ints(map(itemgetter("id"), cats))
        self.ann_ids = _ints(map(itemgetter("id"), anns))
        self.ann_images = _ints(map(itemgetter("image_id"), anns))
        self.ann_categories = _ints(map(itemgetter("category_id"), anns))
        boxes = list(map(itemgetter("bbox"), anns))
        _of_types(boxes, list)
        if not set(map(len, boxes)) <= {4}:
            raise ValueError
        flat = list(chain.from_iterable(boxes))
        _of_types(flat, int, float)
        self.boxes = _floats(flat).reshape(-1, 4)
        if not np.isfinite(self.boxes).all():
            raise ValueError
        self.crowd = np.fromiter(
            map(bool, map(dict.get, anns, repeat("iscrowd"), repeat(0))), bool, len(anns)
        )

    @classmethod
    def read(cls, data: dict) -> _Columns | None:
        try:
            return cls(data)
        except Exception:  # noqa: BLE001 - the per-record checks say what is wrong, if anything
            return None


def _of_types(values: list, *types) -> None:
    if not set(map(type, values)) <= set(types):
        raise TypeError


def _floats(values: list) -> np.ndarray:
    return np.fromiter(map(float, values), np.float64, len(values))  # OverflowError: huge int


def _ints(values) -> np.ndarray:
    values = list(values)
    _of_types(values, int)
    return np.array(values, np.int64).reshape(-1)  # OverflowError past int64


def _check_fields(data: dict) -> None:
    """Each field read is there and of a type its use takes (ValueError, KeyError,
    TypeError naming the first that is not); one record at a time, in file order."""
    for im in data["images"]:
        int(im["id"]), str(im["file_name"])
    for c in data["categories"]:
        int(c["id"])
    if not data["categories"]:
        raise ValueError("'categories' is empty")
    for a in data.get("annotations", []):
        int(a["image_id"]), int(a["category_id"])
        _check_bbox(a)


def _repeated(values) -> list:
    seen, twice = set(), []
    for v in values:
        if v in seen and v not in twice:
            twice.append(v)
        seen.add(v)
    return twice


def _distinct(ids: np.ndarray) -> bool:
    ids = np.sort(ids)
    return not (ids[1:] == ids[:-1]).any()


def _ids_fit(c: _Columns) -> bool:
    return (
        _distinct(c.image_ids)
        and _distinct(c.ann_ids)
        and bool(np.isin(c.ann_categories, c.category_ids).all())
    )


def _check_ids(ann_path: Path, data: dict, columns: _Columns | None = None) -> None:
    """DatasetError naming the file when its ids do not each name one thing: pycocotools
    keeps the last image of a repeated id (one file vanishes and the other gets both
    images' boxes) and the last annotation of a repeated id (COCOeval's ground truth then
    differs from the training targets); an annotation's unknown category_id would fail only
    when its image is read (for a validation image, after a whole training epoch).
    `columns` (when read) pass a file whose ids all fit without a loop."""
    if columns is not None and _ids_fit(columns):
        return
    for what, items in (("image", data["images"]), ("annotation", data.get("annotations", []))):
        twice = _repeated(int(x["id"]) for x in items)
        if twice:
            raise DatasetError(
                f"{ann_path}: repeated {what} id(s) {', '.join(map(str, twice[:5]))}"
                f"{' ...' if len(twice) > 5 else ''}: pycocotools keeps only the last {what} "
                f"of an id. Give each {what} its own id."
            )
    known = {int(c["id"]) for c in data["categories"]}
    for a in data.get("annotations", []):
        if int(a["category_id"]) not in known:
            raise DatasetError(
                f"{ann_path}: annotation {a['id']} (image {a['image_id']}) has category_id "
                f"{a['category_id']}, which is not among its 'categories' (ids "
                f"{sorted(known)[:8]}{' ...' if len(known) > 8 else ''}). Fix the "
                f"annotation's category_id or add the category."
            )


def _check_bbox(annotation: dict) -> None:
    """A box is four finite numbers: anything else is a broken file, not a box to drop."""
    box = annotation["bbox"]
    ok = isinstance(box, (list, tuple)) and len(box) == 4
    ok = ok and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in box)
    if not (ok and all(math.isfinite(v) for v in box)):
        raise ValueError(f"annotation {annotation.get('id')!r} has bbox {box!r}")


def _clip_xywh(bbox, width, height) -> tuple[float, float, float, float] | None:
    """The part of an [x, y, w, h] box inside the image; None when it has no area there."""
    x, y, w, h = (float(v) for v in bbox[:4])
    x0, y0 = max(0.0, x), max(0.0, y)
    x1 = min(float(width), x + w) if width else x + w
    y1 = min(float(height), y + h) if height else y + h
    if not (x1 > x0 and y1 > y0):
        return None
    return x0, y0, x1 - x0, y1 - y0


# The fix each missing input's error gives, as `python -m fastload.pack` names the inputs;
# format fields: ann (the annotation file's name), lr and scale (the LR folder and scale given).
COCO_PACK_FIXES = {
    "annotations": "Pass --annotations <coco>/annotations/instances_<split>.json (unzip "
    "annotations_trainval2017.zip).",
    "images": "Pass --images <coco>/<split> (the folder holding the .jpg files listed in {ann}).",
    "files": "Point --images at the folder of this split, or finish the download/unzip.",
}
DIV2K_PACK_FIXES = {
    "hr": "Pass --hr <div2k>/DIV2K_train_HR.",
    "scale": "--lr {lr} needs --scale 2|3|4|8 (got {scale}).",
    "lr": "Pass --lr <div2k>/DIV2K_train_LR_bicubic/X{scale}.",
    "pair": "Check --lr and --scale.",
}


class CocoSource(Source):
    kind = "coco"
    schema = Schema(
        IMAGE_FIELD,
        Field("image_id", "int", ext=""),
        Field("boxes", "array", xywh=True),  # (n, 4) float32 x, y, w, h in pixels
        Field("labels", "array"),  # (n,) int64 category ids
    )

    def __init__(self, annotations, images, subset: int | None = None, fixes=COCO_PACK_FIXES):
        ann_path, self.images = Path(annotations).absolute(), Path(images).absolute()
        fix = {k: v.format(ann=ann_path.name) for k, v in fixes.items()}
        if not ann_path.is_file():
            raise DatasetError(
                f"COCO annotation file {ann_path} does not exist. {fix['annotations']}"
            )
        if not self.images.is_dir():
            raise DatasetError(f"COCO image folder {self.images} does not exist. {fix['images']}")
        self.annotations = ann_path
        coco, columns = _load_coco(ann_path)
        self.root = str(self.images)
        stem = ann_path.stem
        self.name = stem[len("instances_") :] if stem.startswith("instances_") else stem
        cats = sorted(coco.dataset.get("categories", []), key=lambda c: int(c["id"]))
        self.classes = tuple(str(c.get("name", c["id"])) for c in cats)
        self.category_ids = np.array([int(c["id"]) for c in cats], np.int64)
        if columns is not None:
            self._read_columns(columns, subset)
        else:
            ids = sorted(int(i) for i in coco.imgs)
            ids = ids[:subset] if subset else ids
            self.ids = np.array(ids, np.int64)
            self.files = np.array([str(coco.imgs[i]["file_name"]) for i in ids])
            # (width, height) as the file states them, 0 where it does not
            self.sizes = np.array(
                [[int(coco.imgs[i].get(k) or 0) for k in ("width", "height")] for i in ids],
                np.int64,
            ).reshape(-1, 2)
            self._index_boxes(coco, ids)
        self._check_files(ann_path, fix["files"])
        self._files = {"image": self._path}  # bound methods: a source crosses spawn
        self._values = {"image_id": self.ids, "boxes": self._box_xywh, "labels": self._box_labels}

    def _index_boxes(self, coco, ids) -> None:
        """Flat box / label arrays with per-image offsets; crowd and degenerate dropped."""
        boxes, labels, offsets = [], [], [0]
        self.dropped = {"crowd": 0, "degenerate": 0}
        for image_id in ids:
            im = coco.imgs[image_id]
            for a in coco.imgToAnns.get(image_id, []):
                if a.get("iscrowd", 0):
                    self.dropped["crowd"] += 1
                    continue
                box = _clip_xywh(a["bbox"], im.get("width"), im.get("height"))
                if box is None:
                    self.dropped["degenerate"] += 1
                    continue
                boxes.append(box)
                labels.append(int(a["category_id"]))
            offsets.append(len(boxes))
        self._boxes = np.array(boxes, np.float32).reshape(-1, 4)
        self._labels = np.array(labels, np.int64)
        self._offsets = np.array(offsets, np.int64)
        self.dropped["images_without_boxes"] = int(np.sum(np.diff(self._offsets) == 0))
        listed = set(coco.imgs)  # annotations of no listed image (a subset's are not such)
        self.dropped["of_no_image"] = sum(
            len(anns) for i, anns in coco.imgToAnns.items() if i not in listed
        )

    def _read_columns(self, c: _Columns, subset: int | None) -> None:
        """What the per-image reading above and `_index_boxes` make, from a file's columns
        (ids unique, every field of its plain JSON type): the same arrays, bit for bit."""
        order = np.argsort(c.image_ids, kind="stable")
        order = order[:subset] if subset else order
        self.ids = c.image_ids[order]
        self.files = np.array([c.file_names[j] for j in order.tolist()])
        width = [c.widths[j] for j in order.tolist()]
        height = [c.heights[j] for j in order.tolist()]
        self.sizes = np.array(
            [[int(w or 0), int(h or 0)] for w, h in zip(width, height, strict=True)], np.int64
        ).reshape(-1, 2)
        # each annotation's place among the images taken (-1: none), in file order
        pos = np.searchsorted(self.ids, c.ann_images)
        pos[pos == len(self.ids)] = 0
        pos = np.where(self.ids[pos] == c.ann_images, pos, -1) if len(self.ids) else pos - 1
        self.dropped = {
            "crowd": int(np.count_nonzero(c.crowd & (pos >= 0))),
            "degenerate": 0,
        }
        # by image, each image's in file order (pycocotools' imgToAnns)
        take = np.flatnonzero((pos >= 0) & ~c.crowd)
        take = take[np.argsort(pos[take], kind="stable")]
        x, y, w, h = c.boxes[take].T
        sides = c.sides[order][pos[take]]
        # _clip_xywh's max(0.0, x) and min(width, x + w): the same float64 operations
        x0, y0 = np.where(x > 0.0, x, 0.0), np.where(y > 0.0, y, 0.0)
        x1, y1 = x + w, y + h
        x1, y1 = (
            np.where(x1 < sides[:, 0], x1, sides[:, 0]),
            np.where(y1 < sides[:, 1], y1, sides[:, 1]),
        )
        kept = (x1 > x0) & (y1 > y0)
        self.dropped["degenerate"] = int(np.count_nonzero(~kept))
        self._boxes = np.stack([x0, y0, x1 - x0, y1 - y0], axis=1)[kept].astype(np.float32)
        self._labels = c.ann_categories[take][kept]
        counts = np.bincount(pos[take][kept], minlength=len(self.ids))
        self._offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.dropped["images_without_boxes"] = int(np.sum(counts == 0))
        self.dropped["of_no_image"] = int(np.count_nonzero(~np.isin(c.ann_images, c.image_ids)))

    def check_packing(self, resized: bool) -> None:
        """A COCO pack stored smaller is scored in the annotation file's frame, which its
        images' width and height give (COCO's own files have them): without them the
        detections would stay in the smaller pixels against boxes in the original ones, a
        silent mAP near 0."""
        if not resized:
            return
        missing = np.flatnonzero((self.sizes <= 0).any(axis=1))
        if len(missing):
            raise DatasetError(
                f"{self.annotations}: {len(missing)} image(s) without width/height (first: id "
                f"{self.ids[missing[0]]}), which a pack stored "
                f"smaller (max_side, raw size) needs to score detections in the annotations' "
                f"frame. Add each image's width and height to the file, or pack without "
                f"resizing (kind jpeg with no max_side, or raw with size null)."
            )

    def _check_files(self, ann_path: Path, fix: str) -> None:
        # one listing of the folder instead of a stat per image (~5x less CPU at 30k): a
        # name that is one of its files is one; any other (in a subfolder, spelled another
        # way, a link) is looked at as before
        listed = self._listed_files() if len(self.files) >= 1000 else set()
        missing = [f for f in self.files.tolist() if f not in listed]
        missing = [f for f in missing if not (self.images / f).is_file()]
        if missing:
            raise DatasetError(
                f"{len(missing)} image(s) listed in {ann_path} are missing from {self.images}, "
                f"first: {self.images / missing[0]}. {fix}"
            )

    def _listed_files(self) -> set[str]:
        try:
            with os.scandir(self.images) as entries:
                return {e.name for e in entries if e.is_file(follow_symlinks=False)}
        except OSError:
            return set()

    def __len__(self) -> int:
        return len(self.ids)

    def identity(self) -> list:
        return [self.files, self.sizes, self.category_ids, self._boxes, self._labels,
                self._offsets]  # fmt: skip

    def _path(self, i: int) -> str:
        return str(self.images / self.files[i])

    def stated(self, i: int, name: str) -> tuple[int, int] | None:
        # the image with the size the file states, to check against (0 where it states none)
        return tuple(map(int, self.sizes[i])) if name == "image" else None

    def pack_metadata(self) -> dict:
        # labels are these category ids; the annotations left out, for the epoch row;
        # frames_checked: every image was decoded in the frame of its boxes (older packs: not
        # checked against the file's sizes, fastload/data/frames.py)
        return {
            "category_ids": self.category_ids.tolist(),
            "dropped": dict(self.dropped),
            "frames_checked": True,
        }

    def boxes(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Image i's boxes (n, 4) float32 x, y, w, h and their category ids (n,) int64."""
        s, e = self._offsets[i], self._offsets[i + 1]
        return self._boxes[s:e].copy(), self._labels[s:e].copy()

    def rows(self, name: str) -> np.ndarray | None:
        """Each image's box count (its boxes' and labels' length), from the offsets."""
        return np.diff(self._offsets) if name in ("boxes", "labels") else None

    def _box_xywh(self, i: int) -> np.ndarray:
        return self.boxes(i)[0]

    def _box_labels(self, i: int) -> np.ndarray:
        return self.boxes(i)[1]


class Div2kSource(Source):
    kind = "div2k"
    HR = Schema(IMAGE_FIELD, Field("position", "int", ext=""))
    PAIRED = Schema(*HR, Field("lr", "encoded"))  # <key>.lr.png in WebDataset shards

    def __init__(self, hr, lr=None, scale=None, fixes=DIV2K_PACK_FIXES):
        self.hr = Path(hr).absolute()
        fix = {k: v.format(lr=lr, scale=scale) for k, v in fixes.items()}
        if not self.hr.is_dir():
            raise DatasetError(f"DIV2K HR folder {self.hr} does not exist. {fix['hr']}")
        self.files = np.array(
            sorted(n for n in os.listdir(self.hr) if n.lower().endswith(IMG_EXTENSIONS))
        )
        if not len(self.files):
            raise DatasetError(f"{self.hr} holds no images ({', '.join(IMG_EXTENSIONS)}).")
        self.root, self.name, self.classes = str(self.hr), self.hr.name, ()
        self.lr, self.scale = (Path(lr).absolute() if lr else None), scale
        self.schema = self.HR if self.lr is None else self.PAIRED
        self._files = {"image": self._hr_path}
        self._values = {"position": np.arange(len(self.files), dtype=np.int64)}
        self.pairs = None
        if self.lr is not None:
            self.pairs = self._find_pairs(scale, fix)
            self._files["lr"] = self._lr_path
            self._divide = {"lr": scale}

    def _find_pairs(self, scale, fix: dict) -> np.ndarray:
        if scale not in (2, 3, 4, 8):
            raise DatasetError(fix["scale"])
        if not self.lr.is_dir():
            raise DatasetError(f"DIV2K LR folder {self.lr} does not exist. {fix['lr']}")
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
                    f"{stem}x{scale}{ext} and {name}). {fix['pair']}"
                )
        return np.array(pairs)

    def __len__(self) -> int:
        return len(self.files)

    def identity(self) -> list:
        return [self.files, *([self.pairs, repr(self.scale)] if self.pairs is not None else [])]

    def pack_metadata(self) -> dict:
        # pairs_exact: a resized pair is exactly scale apart (older packs: up to a pixel off)
        return {"pair_scale": self.scale, "pairs_exact": True} if self.lr is not None else {}

    def _hr_path(self, i: int) -> str:
        return str(self.hr / self.files[i])

    def _lr_path(self, i: int) -> str:
        return str(self.lr / self.pairs[i])
