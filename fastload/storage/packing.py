"""Packing a source (ImageFolder split, COCO, DIV2K) into a store: what every packed store
shares. Each store names its own writer (`LmdbStorage.writer`, `ShardStorage.writer`);
`pack_split` reads and (re-)encodes the source files in a process pool and feeds the records
to that writer in a temporary folder renamed into place when complete (fastload/atomic.py).

Record kinds:
  jpeg, no max_side: the source files' bytes unchanged (bit-identical to storage=disk);
  jpeg, max_side N:  re-encoded JPEG with the longer side at most N (smaller JPEGs are kept
                     as they are), quality Q, 4:2:0: "store less data";
  raw, size S:       decoded RGB pixels, longer side S (aspect kept), no decode at training.
"""

from __future__ import annotations

import abc
import io
import logging
import multiprocessing
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np
from PIL import Image

from fastload.atomic import AlreadyBuilt, building
from fastload.data import rawimage
from fastload.data.sources import ImageFolderSource
from fastload.decode.base import open_rgb
from fastload.errors import StorageError
from fastload.host import usable_cores
from fastload.storage.base import Reader, Storage

log = logging.getLogger("fastload")

KINDS = ("jpeg", "raw")


class PackWriter(Protocol):
    """What a store's writer offers `pack_split` (LmdbWriter, ShardWriter)."""

    def add(
        self,
        record: bytes,
        target: int,
        *,
        height: int = 0,
        width: int = 0,
        path: str = "",
        boxes=None,
        labels=None,
        pair: bytes | None = None,
        pair_hw=(0, 0),
    ) -> None: ...

    def close(self, *, classes, params: dict, source: str = "") -> dict: ...


def _resized(img: Image.Image, max_side: int) -> Image.Image:
    w, h = img.size
    if max(w, h) <= max_side:
        return img
    s = max_side / max(w, h)
    size = (max(1, round(w * s)), max(1, round(h * s)))
    img.draft("RGB", size)  # JPEG DCT-domain downscale when it is at least 2x
    return img.resize(size, Image.LANCZOS, reducing_gap=3.0)


def make_record(task) -> tuple[bytes, int, int, float, float]:
    """Worker: source file -> (record bytes, height, width, sx, sy) for the requested kind;
    (sx, sy) map source pixel coordinates to the stored image's (boxes are scaled by them)."""
    path, kind, max_side, quality, size = task
    with open(path, "rb") as f:
        data = f.read()
    if kind == "jpeg" and not max_side:
        return data, 0, 0, 1.0, 1.0
    img = Image.open(io.BytesIO(data))
    if kind == "jpeg" and img.format == "JPEG" and max(img.size) <= max_side:
        return data, img.height, img.width, 1.0, 1.0
    img = open_rgb(data)
    w0, h0 = img.size
    img = _resized(img, size if kind == "raw" else max_side)
    sx, sy = img.width / w0, img.height / h0
    if kind == "raw":
        return rawimage.encode(np.asarray(img, dtype=np.uint8)), img.height, img.width, sx, sy
    out = io.BytesIO()
    img.save(out, "JPEG", quality=quality, subsampling=2)
    return out.getvalue(), img.height, img.width, sx, sy


def make_item(task):
    """Worker: one pack record and, for paired sources (DIV2K LR), its pair's record."""
    main, pair = task
    return make_record(main), (None if pair is None else make_record(pair))


def _records(tasks, workers: int):
    if workers <= 1 or all(not t[0][2] and t[0][1] == "jpeg" for t in tasks[:1]):
        yield from map(make_item, tasks)
        return
    ctx = multiprocessing.get_context("spawn")  # the caller may hold threads or CUDA
    with ctx.Pool(workers) as pool:
        yield from pool.imap(make_item, tasks, chunksize=16)


def pack_params(source, kind: str, max_side, quality: int, size: int) -> dict:
    """What a pack records of how it was made (meta["params"])."""
    if kind == "raw":
        params = {"kind": "raw", "size": size}
    else:
        params = {"kind": kind, "max_side": max_side, "quality": quality if max_side else None}
    params["source"] = source.kind
    if hasattr(source, "category_ids"):
        params["category_ids"] = source.category_ids.tolist()  # labels are these ids
    if source.has_pairs:
        params["pair_scale"] = getattr(source, "scale", None) or 1
    return params


def _tasks(records, source, kind, max_side, quality, size) -> list:
    scale = getattr(source, "scale", None) or 1
    pair_side = max_side and max(1, max_side // scale)  # pairs keep the HR/LR ratio
    return [
        (
            (r.path, kind, max_side, quality, size),
            None if r.pair is None else (r.pair, kind, pair_side, quality, max(1, size // scale)),
        )
        for r in records
    ]


def _write_all(writer: PackWriter, records, results, bar) -> None:
    for r, ((record, h, w, sx, sy), pair) in zip(records, results, strict=True):
        boxes = r.boxes
        if boxes is not None and (sx, sy) != (1.0, 1.0):
            boxes = boxes * np.array([sx, sy, sx, sy], np.float32)  # x, y, w, h
        writer.add(
            record,
            r.target,
            height=h,
            width=w,
            path=r.path,
            boxes=boxes,
            labels=r.labels,
            pair=pair and pair[0],
            pair_hw=(pair[1], pair[2]) if pair else (0, 0),
        )
        bar.update()


def pack_split(
    writer: Callable[[Path], PackWriter],
    src,
    dst,
    *,
    kind: str = "jpeg",
    max_side: int | None = None,
    quality: int = 90,
    size: int = 256,
    workers: int | None = None,
    progress: bool | None = None,
    source=None,
    label: str = "pack",
) -> dict:
    """Pack one split into `dst` (atomically) with `writer(folder)`; returns the metadata.
    The records come from `source` (fastload/data/sources.py: COCO, DIV2K, ...), by default
    the ImageFolder split `src`. progress=None: a progress bar when stderr is a terminal."""
    from tqdm import tqdm

    if kind not in KINDS:
        raise StorageError(f"pack --kind {kind!r}: use jpeg or raw.")
    dst = Path(dst).absolute()
    source = source if source is not None else ImageFolderSource(src)
    records = [source.record(i) for i in range(len(source))]
    tasks = _tasks(records, source, kind, max_side, quality, size)
    bar = tqdm(
        total=len(tasks),
        desc=f"packing {source.root} -> {dst} ({label})",
        unit="img",
        file=sys.stderr,
        disable=not (sys.stderr.isatty() if progress is None else progress),
    )
    try:
        with building(dst) as tmp, bar:
            out = writer(tmp)
            _write_all(out, records, _records(tasks, workers or usable_cores()), bar)
            params = pack_params(source, kind, max_side, quality, size)
            meta = out.close(classes=source.classes, params=params, source=str(source.root))
    except AlreadyBuilt:
        raise StorageError(
            f"{dst} appeared while packing (another packer?); delete it and retry."
        ) from None
    return meta


def pack_missing(
    writer: Callable[[Path], PackWriter], root, pack_root: Path, splits, marker: str, **options
) -> None:
    """Pack each split of ROOT whose pack under pack_root lacks `marker` (the file a complete
    pack has), with pack_split's options."""
    for split in dict.fromkeys(splits):
        if (pack_root / split / marker).is_file():
            continue
        t0 = time.perf_counter()
        pack_split(writer, Path(root) / split, pack_root / split, **options)
        log.info(
            "packed %s/%s into %s in %.1f s",
            root,
            split,
            pack_root / split,
            time.perf_counter() - t0,
        )


class PackedStorage(Storage):
    """A store whose splits are packs made from the dataset folder (LMDB, shards): packed on
    first use by `prepare` (storage.auto_pack) or by `python -m fastload.pack`, refused with
    that command when missing. A subclass names its pack format, the file a complete split
    has (`marker`), its writer, its reader, its default location and its pack options."""

    format: str  # the pack command's format argument (lmdb, shards)
    marker: str  # written last into a complete split
    name: str  # storage=<name>

    def __init__(self, path=None, verify=True, auto_pack=True, cold_cache=False):
        self.path = path
        self.verify = bool(verify)  # check each record's checksum at read
        self.auto_pack = bool(auto_pack)  # pack a missing split before training
        self.cold_cache = bool(cold_cache)  # evict the pack's files before each epoch

    @abc.abstractmethod
    def default_path(self, root) -> str:
        """Where the pack lives when storage.path is null: beside the dataset."""

    @abc.abstractmethod
    def writer(self, folder: Path) -> PackWriter: ...

    @abc.abstractmethod
    def reader(self, split_dir: Path) -> Reader: ...

    @abc.abstractmethod
    def pack_options(self) -> dict:
        """pack_split's record options (kind, max_side, quality, size)."""

    @abc.abstractmethod
    def cli_options(self) -> list[str]:
        """The same options as `python -m fastload.pack` flags."""

    def pack_root(self, root) -> Path:
        return Path(self.path or self.default_path(root))

    def pack_command(self, root) -> str:
        return " ".join(
            ["python -m fastload.pack", self.format, str(root), str(self.pack_root(root))]
            + self.cli_options()
        )

    def prepare(self, root, splits) -> None:
        if self.auto_pack:
            options = {**self.pack_options(), "label": self.format}
            pack_missing(self.writer, root, self.pack_root(root), splits, self.marker, **options)

    def open(self, root, split: str) -> Reader:
        split_dir = self.pack_root(root) / split
        if not (split_dir / self.marker).is_file():
            raise StorageError(
                f"no {self.format} pack at {split_dir} (storage={self.name}, storage.path="
                f"{self.path or 'null, derived from dataset.root'}). Pack it with:\n  "
                f"{self.pack_command(root)}\nor set storage.auto_pack=true to pack on first use."
            )
        return self.reader(split_dir)
