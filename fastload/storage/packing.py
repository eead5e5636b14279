"""Packing a source (ImageFolder split, COCO, DIV2K) into a store: what every packed store
shares. Each store names its own writer (`LmdbStorage.writer`, `ShardStorage.writer`);
`pack_split` reads and (re-)encodes the source files in a process pool and feeds the records
to that writer in a temporary folder renamed into place when complete (fastload/atomic.py).

Record kinds:
  jpeg, no max_side: the source files' bytes unchanged (bit-identical to storage=disk;
                     with skip_corrupt each is decoded once, and one that fails is left out);
  jpeg, max_side N:  re-encoded JPEG with the longer side at most N (smaller JPEGs are kept
                     as they are), quality Q, 4:2:0: "store less data";
  raw, size S:       decoded RGB pixels, longer side S (aspect kept), no decode at training;
  raw, size null:    decoded RGB pixels at full resolution (super-resolution pairs).
A record is the source's named fields (fastload/data/records.py); the kind applies to
each of its image fields; a resized pair (DIV2K HR and LR) stays exact: the HR's sides
become multiples of the scale and the LR is resized to the HR's size / scale (`make_item`);
raw size null keeps both as they are. LMDB can lz4-compress its values (`compression`,
a store option recorded with the others, so a pack made without it is not reused).
"""

from __future__ import annotations

import abc
import contextlib
import functools
import io
import itertools
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np
import xxhash
from PIL import Image

from fastload.atomic import (
    AlreadyBuilt,
    building,
    folder_id,
    is_disk_full,
    no_space_message,
)
from fastload.data import rawimage
from fastload.data.frames import in_stored_frame
from fastload.data.layouts import as_layout
from fastload.data.records import ImageFile, Schema
from fastload.data.sources import ImageFolderSource
from fastload.decode.base import open_rgb
from fastload.errors import ConfigError, DatasetError, NotAnImageFolder, StorageError
from fastload.host import spawn_pool, usable_cores
from fastload.storage.base import Reader, Storage

log = logging.getLogger("fastload")

KINDS = ("jpeg", "raw")


class PackWriter(Protocol):
    """What a store's writer offers `pack_split` (LmdbWriter, ShardWriter, WdsWriter): built
    with the pack's `Schema`, it takes each record as {field name: value} (image fields as
    bytes) and writes every field by the schema's codecs."""

    def add(self, values: dict, *, path: str = "") -> None: ...

    def close(self, *, classes, params: dict, source: str = "") -> dict: ...


def _resized(img: Image.Image, max_side: int | None, multiple: int = 1, to=None) -> Image.Image:
    """`img` with its longer side at most `max_side`, each side a multiple of `multiple`
    (a pair's HR image: its LR image is then exactly its size / scale); `to`: exactly this
    (width, height) instead."""
    w, h = img.size
    if to is None and (not max_side or max(w, h) <= max_side):
        return img
    if to is None:
        s = max_side / max(w, h)
        to = tuple(multiple * max(1, round(side * s / multiple)) for side in (w, h))
    img.draft("RGB", to)  # JPEG DCT-domain downscale when it is at least 2x
    return img.resize(to, Image.LANCZOS, reducing_gap=3.0)


def make_record(task, multiple: int = 1, to=None) -> tuple[bytes, int, int, float, float]:
    """Worker: source file -> (record bytes, height, width, sx, sy) for the requested kind;
    (sx, sy) map source pixel coordinates to the stored image's (boxes are scaled by them).
    `multiple`, `to`: as `_resized`'s, for a pair's images. An image whose boxes are in its
    stored frame (the task's `stated` size, fastload/data/frames.py) is stored so, turned no
    more by its EXIF orientation (re-encoded at quality 95 where the pack copies files).
    `check` (skip_corrupt): a file stored as it is (copied, or a JPEG already small enough)
    is decoded whole first, so that one training cannot decode fails here and is left out."""
    path, kind, max_side, quality, size, stated, check = task
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise NotRead(f"{type(exc).__name__}: {exc}") from None
    stored_frame = bool(stated) and in_stored_frame(data, stated, path)
    if kind == "jpeg" and not max_side and not stored_frame:
        if check:
            open_rgb(data, exif=False).load()
        return data, 0, 0, 1.0, 1.0
    img = Image.open(io.BytesIO(data))
    if (to is None and kind == "jpeg" and img.format == "JPEG" and not stored_frame
            and max(img.size) <= max_side):  # fmt: skip
        if check:
            open_rgb(data, exif=False).load()
        return data, img.height, img.width, 1.0, 1.0
    quality = quality if max_side else 95
    img = open_rgb(data, exif=not stored_frame)
    w0, h0 = img.size
    img = _resized(img, size if kind == "raw" else max_side, multiple, to)
    sx, sy = img.width / w0, img.height / h0
    if kind == "raw":
        return rawimage.encode(np.asarray(img, dtype=np.uint8)), img.height, img.width, sx, sy
    out = io.BytesIO()
    img.save(out, "JPEG", quality=quality, subsampling=2)
    return out.getvalue(), img.height, img.width, sx, sy


class NotRead(Exception):
    """A source file that could not be read (permissions, an I/O error): not a corrupt
    image. Left out as one, it would stay out of the pack once mended, since the file's
    size and time, which the pack's staleness check compares, are unchanged."""


def cannot_read(path, why) -> StorageError:
    """A source file the pack cannot read (gone, a dangling link, permissions, the disk)."""
    return StorageError(
        f"cannot read {path} while packing ({why}). Restore it or make it readable (a link to "
        f"a file that is gone? its permissions? the disk?), or remove it, then pack again."
    )


class Unreadable(NamedTuple):
    """What a pack worker returns for a file it cannot decode (`read`: or cannot read)."""

    path: str
    error: str
    read: bool = True


def make_item(task):
    """Worker: the stored bytes of one record's image fields ({name: make_record's tuple});
    an `Unreadable` for a file that cannot be decoded (truncated, not an image).

    A pair (DIV2K: HR, and LR with `divide` = the scale) resized stays a pair: the HR image
    first, its sides made multiples of the scale, then the LR image resized to exactly the
    HR's size / scale. Resizing each to its own max side would round their sides apart and
    shift the LR grid against the HR's by up to a pixel at the far edge."""
    out, hr = {}, None
    scale = max(divide for _, _, divide in task)
    for name, image_task, divide in sorted(task, key=lambda t: t[2]):
        to = None
        if divide > 1 and hr is not None and hr[3:] != (1.0, 1.0):  # the HR was resized
            to = (hr[2] // divide, hr[1] // divide)
        try:
            out[name] = make_record(image_task, multiple=scale if divide == 1 else 1, to=to)
        except NotRead as exc:
            return Unreadable(image_task[0], str(exc), read=False)
        except DatasetError as exc:  # not the frame its boxes are in: not a corrupt file
            return exc
        except Exception as exc:  # any decoder's failure on bad bytes
            return Unreadable(image_task[0], f"{type(exc).__name__}: {exc}")
        hr = out[name] if divide == 1 else hr
    return {name: out[name] for name, _, _ in task}


DIGEST_CHUNK = 65536  # records source_digest reads from a source at a time


def source_digest(records, source, real_paths: bool = True) -> tuple[str, int]:
    """(fingerprint, total bytes) of what a pack is made from: every record's fields in
    order, image files by path, size and modification time, other values by content. A file
    added, removed, rewritten or relabelled changes it. `real_paths`: each file's path by
    its folder's real path, so that every spelling of the source (relative, with `..`,
    through a symlink) gives one digest; False: as spelled (packs whose sidecar has no
    "source_paths": "real", written before).

    `records`: the source's records (`source.record(i)` in order), or None: read from the
    source field by field, DIGEST_CHUNK records at a time, building no record (the check
    of a pack that is current, every run: a list of 1.28M records was ~0.5 GB). Both give
    the same digest; the bytes hashed are each record's fields' `_file_line`s and
    `_value_line`s in order."""
    n = len(source) if records is None else len(records)
    h, total = xxhash.xxh3_128(), 0
    h.update(f"{source.kind}\0{n}\0{','.join(source.schema.names)}\n".encode())
    real: dict[str, str] = {}  # folder as spelled, with its "/" -> its real path, with "/"

    def file_line(path: str, stated) -> bytes:
        nonlocal total
        try:
            st = os.stat(path)
        except OSError as exc:  # a dangling link, a file removed: the source's fault
            raise cannot_read(path, exc.strerror or exc) from None
        total += st.st_size
        if real_paths:  # os.path.join(realpath(folder), name), a dict look-up per file
            cut = path.rfind(os.sep) + 1
            folder = real.get(path[:cut])
            if folder is None:
                folder = real[path[:cut]] = os.path.join(
                    os.path.realpath(os.path.split(path)[0]), ""
                )
            path = folder + path[cut:]
        stated = f"\0{stated[0]}x{stated[1]}" if stated else ""
        return os.fsencode(f"{path}\0{st.st_size}\0{st.st_mtime_ns}{stated}\n")

    if records is not None:
        for r in records:
            h.update(b"".join(
                file_line(v.path, v.stated) if isinstance(v, ImageFile) else _value_line(v)
                for v in r.values()
            ))  # fmt: skip
        return h.hexdigest(), total
    for start in range(0, n, DIGEST_CHUNK):
        stop = min(n, start + DIGEST_CHUNK)
        columns = []
        for name in source.schema.names:
            if name in source._files:
                columns.append([
                    file_line(path, source.stated(i, name))
                    for i, path in enumerate(source.file_paths(name, start, stop), start)
                ])  # fmt: skip
            else:
                columns.append(_value_lines(source, name, start, stop))
        h.update(b"".join(itertools.chain.from_iterable(zip(*columns, strict=True))))
    return h.hexdigest(), total


def _value_line(value) -> bytes:
    """What source_digest hashes of a field's value that is no image file."""
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{value.shape}".encode() + np.ascontiguousarray(value).tobytes()
    return f"{value!r}\n".encode()


def _value_lines(source, name: str, start: int, stop: int) -> list[bytes]:
    """`_value_line` of field `name` of records start..stop-1; an int column's repr once per
    distinct value (a label: the same few hundred values 1.28M times)."""
    column = source.column(name)
    if not (isinstance(column, np.ndarray) and column.ndim == 1 and column.dtype.kind in "biu"):
        return [_value_line(source.value(i, name)) for i in range(start, stop)]
    lines: dict = {}
    return [
        lines.get(v) or lines.setdefault(v, _value_line(v))
        for v in column[start:stop]  # the scalars source.value gives
    ]


SIDECAR = "fastload-pack.json"  # in every pack folder: what it was made from, and how


def not_a_pack(dst: Path, marker: str) -> str | None:
    """What the folder a split's pack goes to holds when that is neither a pack (of any
    format: its sidecar; an older one: `marker`) nor nothing: a few of its names. Packing
    replaces the folder, so such a folder is refused, not overwritten (it may be the
    user's data: a storage.path or an output folder given by mistake)."""
    if not dst.is_dir() or (dst / SIDECAR).is_file() or (dst / marker).is_file():
        return None
    names = sorted(p.name for p in dst.iterdir())
    if not names:
        return None
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more


def _records(tasks, workers: int):
    first = tasks[0] if tasks else ()
    copies = all(t[1][1] == "jpeg" and not t[1][2] and not t[1][6] for t in first)
    if workers <= 1 or copies:  # the files' bytes as they are, unchecked: nothing worth a pool
        yield from map(make_item, tasks)
        return
    with spawn_pool(workers) as pool:  # spawn: the caller may hold threads or CUDA
        yield from pool.imap(make_item, tasks, chunksize=16)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_pack_numbers(max_side=None, quality=90, size=None, **counts) -> None:
    """ConfigError naming the storage option (storage.max_side=-5) whose value cannot make a
    pack: a side or size below 1 (a 1x1 pixel image for every record), a JPEG quality outside
    1..100, a shard size or count below 1. `counts`: other options that take a whole number
    >= 1 or null (shard_samples) or a number > 0 (shard_mb)."""
    for key, value, what in (
        ("max_side", max_side, "null (the source bytes unchanged) or a whole number >= 1, "
                               "the longer side of the re-encoded JPEGs"),
        ("size", size, "null (full resolution) or a whole number >= 1, the longer side of "
                       "the stored pixels"),
    ):  # fmt: skip
        if value is not None and not (_whole(value) and value >= 1):
            raise ConfigError(f"storage.{key}={value!r}: use {what}.")
    if not (_whole(quality) and 1 <= quality <= 100):
        raise ConfigError(f"storage.quality={quality!r}: use a JPEG quality from 1 to 100.")
    for key, value in counts.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key == "shard_samples" and value is not None and not (_whole(value) and value >= 1):
            raise ConfigError(
                f"storage.shard_samples={value!r}: use null (shards by size only) or a whole "
                f"number >= 1."
            )
        if key == "shard_mb" and not (number and math.isfinite(value) and value > 0):
            raise ConfigError(f"storage.shard_mb={value!r}: use a number of MB > 0.")


def unchecked_note(columns: list[str]) -> list[str]:
    """`verify`'s note on a pack whose int columns carry no checksum (written before they
    had one): they could not be checked, which is no damage; a re-pack adds it."""
    if not columns:
        return []
    return [
        f"its {', '.join(columns)} column{'s' if len(columns) > 1 else ''} carr"
        f"{'y' if len(columns) > 1 else 'ies'} no checksum (packed by an earlier fastload), "
        f"so {'they were' if len(columns) > 1 else 'it was'} not checked; re-pack to have "
        f"{'them' if len(columns) > 1 else 'it'} checked"
    ]


def record_options(
    kind: str, max_side=None, quality: int = 90, size: int | None = 256, compression=None,
    order: str | None = None,
) -> dict:  # fmt: skip
    """The options that decide a pack's records (only those that apply to its kind);
    `compression` and `order` only when set, so packs made before they existed still match."""
    if kind == "raw":
        opts = {"kind": "raw", "size": size}
    else:
        opts = {"kind": kind, "max_side": max_side, "quality": quality if max_side else None}
    if compression:
        opts["compression"] = compression
    if order:
        opts["order"] = order
    return opts


ORDERS = (None, "shuffled")
SHUFFLE_SEED = 0  # order="shuffled": one fixed permutation, so a re-pack gives the same bytes


def pack_order(n: int, order: str | None) -> list[int]:
    """The source records' order in the pack. None: as the source lists them (an image
    folder: class by class). "shuffled": a fixed permutation, for stores read as a stream of
    shards (storage=webdataset), whose training order only permutes shards and shuffles
    within a window of consecutive samples: shards of one class each would give batches of
    a few classes."""
    if order not in ORDERS:
        raise StorageError(f"pack order {order!r}: use null or shuffled.")
    if order is None:
        return list(range(n))
    return np.random.default_rng(SHUFFLE_SEED).permutation(n).tolist()


def pack_params(source, kind: str, max_side, quality: int, size, compression=None,
                order=None) -> dict:  # fmt: skip
    """What a pack records of how it was made (meta["params"]), with what the source adds
    of itself (`pack_metadata`: COCO's category ids and dropped annotations, ...)."""
    params = record_options(kind, max_side, quality, size, compression, order)
    params["source"] = source.kind
    return {**params, **source.pack_metadata()}


def pack_schema(source, kind: str) -> Schema:
    """The pack's fields: the source's, its image fields as stored (kind=raw: pixels)."""
    codec = "pixels" if kind == "raw" else "encoded"
    schema = source.schema
    for f in schema:
        if f.coder.image:
            schema = schema.replace(f.name, codec=codec)
    return schema


def _tasks(records, kind, max_side, quality, size, check: bool = False) -> list:
    # An image with `divide` (a DIV2K LR pair) is resized to the HR's size / divide when the
    # HR is resized (make_item); its max_side / divide, size / divide decide whether it is
    # (an HR too small to resize has an LR too small too). size null keeps every image as
    # it is. `check`: make_record's.
    return [
        [
            (
                name,
                (
                    v.path,
                    kind,
                    max_side and max(1, max_side // v.divide),
                    quality,
                    size and max(1, size // v.divide),
                    v.stated,
                    check,
                ),
                v.divide,
            )  # fmt: skip
            for name, v in r.items()
            if isinstance(v, ImageFile)
        ]
        for r in records
    ]


def _write_all(writer: PackWriter, records, results, bar, skip_corrupt: bool, tally) -> list:
    """Feed the records to the writer; returns the skipped (unreadable) paths. `tally`
    counts records and bytes written (for the space estimate of a full-disk error). Fields
    marked `xywh` are rescaled with the record's first image."""
    skipped = []
    for r, result in zip(records, results, strict=True):
        bar.update()
        if isinstance(result, DatasetError):
            raise result
        if isinstance(result, Unreadable):
            if not result.read:  # never left out: see NotRead
                raise cannot_read(result.path, result.error)
            if not skip_corrupt:
                raise StorageError(
                    f"cannot decode {result.path} while packing ({result.error}). Remove or "
                    f"replace the file, or leave such files out and count them: --skip-corrupt "
                    f"(python -m fastload.pack) or dataset.skip_corrupt=true (train.py)."
                )
            skipped.append(result.path)
            continue
        values = dict(r)
        scale = None
        for name, (record, _h, _w, sx, sy) in result.items():
            values[name] = record
            scale = scale or (sx, sy)
            tally[1] += len(record)
        for f in writer.schema:
            if f.xywh and scale not in (None, (1.0, 1.0)):
                sx, sy = scale
                values[f.name] = values[f.name] * np.array([sx, sy, sx, sy], np.float32)
        writer.add(values, path=next(v.path for v in r.values() if isinstance(v, ImageFile)))
        tally[0] += 1
    return skipped


class PackedMeanwhile(StorageError):
    """Another process completed the pack folder while `pack_split` was writing it."""


def pack_split(
    writer: Callable[[Path, Schema], PackWriter],
    src,
    dst,
    *,
    kind: str = "jpeg",
    max_side: int | None = None,
    quality: int = 90,
    size: int | None = 256,
    compression: str | None = None,
    workers: int | None = None,
    progress: bool | None = None,
    source=None,
    what: str = "pack",
    skip_corrupt: bool = False,
    replacing: tuple[int, int] | None = None,
    order: str | None = None,
) -> dict:
    """Pack one split into `dst` (atomically; `replacing`: over the outdated pack of this
    `atomic.folder_id`, unless another process re-packed it first) with
    `writer(folder, schema)`; returns the metadata. The records come from `source`
    (fastload/data/sources.py: COCO, DIV2K, ...), by default the ImageFolder split `src`.
    progress=None: a progress bar when stderr is a terminal. `compression` is recorded in
    the params; the writer (LmdbStorage.writer) compresses."""
    from tqdm import tqdm

    if kind not in KINDS:
        raise StorageError(f"pack --kind {kind!r}: use jpeg or raw.")
    dst = Path(dst).absolute()
    source = source if source is not None else ImageFolderSource(src)
    source.check_packing(bool(size if kind == "raw" else max_side))
    records = [source.record(i) for i in range(len(source))]
    digest, source_bytes = source_digest(records, source)
    records = [records[i] for i in pack_order(len(records), order)]  # `pack_order`
    tasks = _tasks(records, kind, max_side, quality, size, check=skip_corrupt)
    bar = tqdm(
        total=len(tasks),
        desc=f"packing {source.root} -> {dst} ({what})",
        unit="img",
        file=sys.stderr,
        disable=not (sys.stderr.isatty() if progress is None else progress),
    )
    tally = [0, 0]  # records, bytes written
    params = pack_params(source, kind, max_side, quality, size, compression, order)
    try:
        with building(dst, replacing=replacing) as tmp, bar:
            out = writer(tmp, pack_schema(source, kind))
            results = _records(tasks, workers or usable_cores())
            skipped = _write_all(out, records, results, bar, skip_corrupt, tally)
            meta = out.close(classes=source.classes, params=params, source=str(source.root))
            record = {
                "source": str(source.root),
                "source_digest": digest,
                "source_paths": "real",  # source_digest's real_paths
                "classes": [str(c) for c in source.classes],
                "params": params,
                "schema": out.schema.to_json(),
            }
            (tmp / SIDECAR).write_text(json.dumps({**record, "skipped": skipped}, indent=1))
    except AlreadyBuilt:
        raise PackedMeanwhile(
            f"{dst} appeared (or was re-packed) while packing (another packer?); delete it "
            f"and retry."
        ) from None
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        need = max(source_bytes, tally[1] * len(records) // max(1, tally[0]))
        raise StorageError(no_space_message("the pack", dst, need)) from None
    if skipped:
        log.warning(
            "packing %s: left out %d file(s) that cannot be decoded (dataset.skip_corrupt): %s",
            source.root,
            len(skipped),
            ", ".join(skipped[:5]) + (" ..." if len(skipped) > 5 else ""),
        )
    return {**meta, "skipped": skipped}


OPTION_KEYS = ("kind", "max_side", "quality", "size", "compression", "order")


def stale_reason(make_source, pack_dir: Path, options: dict) -> str | None:
    """Why the pack at `pack_dir` no longer matches the source `make_source()` builds (an
    ImageFolder split folder when given a path) or the asked-for pack options; None when it
    matches, or when the source is not here to compare with."""
    try:
        record = json.loads((pack_dir / SIDECAR).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"it records nothing of what it was made from ({SIDECAR} is missing)"
    if "schema" not in record:
        return "it was packed by an older fastload (its records name no fields)"
    have = {k: v for k, v in record["params"].items() if k in OPTION_KEYS}
    want = record_options(**options)
    if have != want:
        return f"it was packed with {have}, this run asks for {want}"
    params, resized = record["params"], want.get("size" if want["kind"] == "raw" else "max_side")
    if resized and params.get("pair_scale") and not params.get("pairs_exact"):
        return "an older fastload resized its LR/HR pairs apart (up to a pixel at the far edge)"
    if "category_ids" in params and not params.get("frames_checked"):
        return (
            "an older fastload packed its images without checking them against the sizes the "
            "annotation file states (a photo turned by its EXIF orientation may be stored in "
            "another frame than its boxes)"
        )
    if not callable(make_source):
        src_dir = Path(make_source)
        if not src_dir.is_dir():
            log.info("%s: its source %s is not here to compare with; using it", pack_dir, src_dir)
            return None
        make_source = functools.partial(ImageFolderSource, src_dir)
    try:
        source = make_source()
    except NotAnImageFolder as exc:
        # the split folder is there but is no image folder now (its images deleted or
        # converted, its classes reorganised): storage=disk refuses it, so no pack of it holds
        return f"its source no longer reads as an image folder: {exc}"
    except DatasetError as exc:
        log.info("%s: its source is not here to compare with (%s); using it", pack_dir, exc)
        return None
    real_paths = record.get("source_paths") == "real"
    digest, _ = source_digest(None, source, real_paths=real_paths)
    if digest != record.get("source_digest"):
        return (
            f"{source.root} changed since it was packed (files added, removed, rewritten or "
            f"relabelled)"
        )
    # a class folder added after the last or renamed, a COCO category renamed: the files and
    # labels are the same, the names are not (packs from before this was recorded: unchecked)
    if "classes" in record and record["classes"] != [str(c) for c in source.classes]:
        return f"the classes of {source.root} changed since it was packed"
    return None


def left_out(pack_dir: Path) -> list[str]:
    """The files a pack made with skip_corrupt left out (its sidecar's list; [] if none)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return list(json.loads((pack_dir / SIDECAR).read_text(encoding="utf-8")).get("skipped")
                    or [])  # fmt: skip
    return []


def warn_left_out(pack_dir: Path) -> None:
    """A pack made with dataset.skip_corrupt=true left out what it could not decode; a run
    without skip_corrupt, which would stop at such a file, is told that it trains without
    them rather than finding out from a sample count."""
    left = left_out(pack_dir)
    if left:
        log.warning(
            "%s was packed with dataset.skip_corrupt=true and left out %d file(s) that "
            "could not be decoded (%s): this run trains without them. Mend or remove "
            "them in the dataset and the next run re-packs it with every file.",
            pack_dir, len(left), ", ".join(left[:3]) + (" ..." if len(left) > 3 else ""),
        )  # fmt: skip


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
    def writer(self, folder: Path, schema: Schema) -> PackWriter: ...

    @abc.abstractmethod
    def reader(self, split_dir: Path) -> Reader: ...

    @abc.abstractmethod
    def pack_options(self) -> dict:
        """pack_split's record options (kind, max_side, quality, size)."""

    @abc.abstractmethod
    def cli_options(self) -> list[str]:
        """The same options as `python -m fastload.pack` flags."""

    def pack_root(self, root) -> Path:
        layout = as_layout(root)
        return Path(self.path or self.default_path(layout.root) + layout.pack_suffix())

    def pack_command(self, root, split: str | None = None) -> str:
        layout = as_layout(root)
        if split is None:  # every split of an ImageFolder root
            args = [str(layout.root), str(self.pack_root(layout))]
        else:
            args = layout.pack_args(split, self.pack_root(layout))
        return " ".join(["python -m fastload.pack", self.format, *args, *self.cli_options()])

    def prepare(self, root, splits, skip_corrupt: bool = False) -> None:
        """Pack each split that is missing or out of date (auto_pack), or refuse an outdated
        one with the command; a missing one is refused by `open`. `root`: a layout
        (fastload/data/layouts.py) or an ImageFolder dataset root."""
        layout = as_layout(root)
        for split in dict.fromkeys(splits):
            dst = self.pack_root(layout) / split
            held = not_a_pack(dst, self.marker)
            if held is not None:
                raise StorageError(
                    f"storage={self.name} would pack {split} into {dst}, which holds files "
                    f"that are not a pack ({held}); a pack replaces its folder, so they are "
                    f"left as they are. Pass storage.path=<a new or empty folder> (now "
                    f"{self.path or 'null: beside dataset.root'}), or move those files."
                )
            exists = (dst / self.marker).is_file()
            other = not exists and (dst / SIDECAR).is_file()  # another format's pack is there
            replacing = folder_id(dst) if exists or other else None  # the pack judged below
            if exists or other:
                reason = (
                    f"it holds a pack of another format, not {self.format}"
                    if other
                    else stale_reason(lambda s=split: layout.source(s), dst, self.pack_options())
                )
                if reason is None:
                    if not skip_corrupt:
                        warn_left_out(dst)
                    continue
                if not self.auto_pack:
                    raise StorageError(
                        f"the {self.format} pack {dst} is out of date: {reason}. Re-pack it "
                        f"(the new pack replaces the old one):\n  "
                        f"{self.pack_command(layout, split)}\n"
                        f"or set storage.auto_pack=true to re-pack on first use."
                    )
                log.warning("re-packing %s: %s", dst, reason)
            elif not self.auto_pack:
                continue
            t0 = time.perf_counter()
            options = {**self.pack_options(), "what": self.format, "skip_corrupt": skip_corrupt}
            source = layout.source(split)
            try:
                pack_split(self.writer, None, dst, source=source, replacing=replacing, **options)
            except PackedMeanwhile:
                # Each node's local rank 0 packs, and the default folder (beside dataset.root)
                # is on a file system that all nodes share: nodes that start together pack it
                # at the same time and all but the first to finish find it in place. A pack
                # that matches the source and options is as good as ours: train on it.
                if not (dst / self.marker).is_file() or stale_reason(
                    lambda s=split: layout.source(s), dst, self.pack_options()
                ):
                    raise
                log.info(
                    "%s was packed meanwhile by another process (another node?); using it", dst
                )
                continue
            except OSError as exc:
                raise self.unwritable(dst, exc) from None
            log.info("packed %s into %s in %.1f s", source.root, dst, time.perf_counter() - t0)

    def unwritable(self, dst: Path, exc: OSError) -> StorageError:
        """Where auto-packing could not write (a read-only dataset mount, ...) and the fix."""
        if is_disk_full(exc):
            return StorageError(no_space_message(f"the {self.format} pack", dst, 0)
                                + " (storage.path=<a folder with room>)")  # fmt: skip
        where = "beside the dataset" if not self.path else "at storage.path"
        return StorageError(
            f"storage={self.name} packs the dataset on first use into {dst} ({where}), but "
            f"cannot write there: {exc.strerror or exc}. Pass storage.path=<a writable "
            f"folder> (e.g. storage.path=$HOME/packs/{dst.parent.name})."
        )

    def open(self, root, split: str) -> Reader:
        split_dir = self.pack_root(root) / split
        if not (split_dir / self.marker).is_file():
            raise StorageError(
                f"no {self.format} pack at {split_dir} (storage={self.name}, storage.path="
                f"{self.path or 'null, derived from dataset.root'}). Pack it with:\n  "
                f"{self.pack_command(root, split)}\nor set storage.auto_pack=true to pack on "
                f"first use."
            )
        return self.reader(split_dir)
