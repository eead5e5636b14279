"""Pack an ImageFolder, COCO or DIV2K dataset into LMDB or memory-mapped shards.

    python -m fastload.pack lmdb   SRC DST [--max-side N --quality Q]
    python -m fastload.pack shards SRC DST [--kind jpeg|raw --max-side N --quality Q --size S]
    python -m fastload.pack {lmdb,shards} DST --source coco \
        --annotations instances_train2017.json --images DIR      # -> DST/train2017/
    python -m fastload.pack {lmdb,shards} DST --source div2k \
        --hr DIR [--lr DIR --scale 2|4]                          # -> DST/<HR folder name>/
    python -m fastload.pack verify DST            # whole-file crc32 of every shard

COCO: one record per image (by image id), target = image id, plus its boxes [x, y, w, h]
(float32, scaled with the image when re-encoded) and category ids (int64). DIV2K: one record
per HR image (by name), target = position, plus the paired LR image when --lr is given (same
kind; re-encoded/raw pairs are resized to max_side / scale, size / scale). See
fastload/data/sources.py and the layouts in fastload/storage/{shards,lmdb_store}.py.

SRC is a dataset root holding split folders (train/, val/ in ImageFolder layout) or one split
folder; DST gets one pack per split (DST/<split>/), in the same sample order as storage=disk.
Each split is written into a temporary sibling folder and renamed into place when complete,
so an interrupted pack is never mistaken for a finished one.

Record kinds:
  jpeg, no --max-side: the source files' bytes unchanged (bit-identical to storage=disk);
  jpeg --max-side N:   re-encoded JPEG with the longer side at most N (smaller images are kept
                       as they are if already JPEG), quality Q, 4:2:0: "store less data";
  raw --size S:        decoded RGB pixels, longer side S (aspect kept), no decode when training.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from fastload.data import rawimage
from fastload.data.sources import CocoSource, Div2kSource, ImageFolderSource
from fastload.decode.pil import open_rgb
from fastload.errors import FastloadError, StorageError


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


def pack_split(
    fmt: str,
    src,
    dst,
    *,
    kind: str = "jpeg",
    max_side: int | None = None,
    quality: int = 90,
    size: int = 256,
    shard_mb: int = 1024,
    initial_map_size: int = 64 << 20,
    workers: int | None = None,
    progress: bool | None = None,
    source=None,
) -> dict:
    """Pack one split into `dst` (atomically); returns the metadata. The records come from
    `source` (fastload/data/sources.py: COCO, DIV2K, ...), by default the ImageFolder split
    `src`. progress=None: a progress bar when stderr is a terminal."""
    from tqdm import tqdm

    from fastload.loaders.baseline import usable_cores

    if kind not in ("jpeg", "raw"):
        raise StorageError(f"pack --kind {kind!r}: use jpeg or raw.")
    if fmt == "lmdb" and kind != "jpeg":
        raise StorageError(
            "LMDB packs hold encoded images; raw pixels: use `fastload.pack shards --kind raw`."
        )
    dst = Path(dst).absolute()
    if source is None:
        source = ImageFolderSource(src)
    src = source.root
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.packing-{os.getpid()}"
    for stale in dst.parent.glob(f".{dst.name}.packing-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    params = {
        "kind": kind,
        "max_side": max_side,
        "quality": quality if (max_side or kind == "raw") else None,
    }
    if kind == "raw":
        params = {"kind": "raw", "size": size}
    records = [source.record(i) for i in range(len(source))]
    scale = getattr(source, "scale", None) or 1
    pair_side = max_side and max(1, max_side // scale)  # pairs keep the HR/LR ratio
    tasks = [
        (
            (r.path, kind, max_side, quality, size),
            None if r.pair is None else (r.pair, kind, pair_side, quality, max(1, size // scale)),
        )
        for r in records
    ]
    params["source"] = source.kind
    if hasattr(source, "category_ids"):
        params["category_ids"] = source.category_ids.tolist()  # labels are these ids
    if source.has_pairs:
        params["pair_scale"] = scale
    workers = workers or usable_cores()
    try:
        if fmt == "lmdb":
            from fastload.storage.lmdb_store import LmdbWriter

            writer = LmdbWriter(tmp, initial_map_size=initial_map_size)
        elif fmt == "shards":
            from fastload.storage.shards import ShardWriter

            writer = ShardWriter(tmp, kind, shard_bytes=shard_mb << 20)
        else:
            raise StorageError(f"unknown pack format {fmt!r}: use lmdb or shards.")
        bar = tqdm(
            total=len(tasks),
            desc=f"packing {src} -> {dst} ({fmt})",
            unit="img",
            file=sys.stderr,
            disable=not (sys.stderr.isatty() if progress is None else progress),
        )
        with bar:
            for r, ((record, h, w, sx, sy), pair) in zip(
                records, _records(tasks, workers), strict=True
            ):
                boxes = r.boxes
                if boxes is not None and (sx, sy) != (1.0, 1.0):
                    boxes = boxes * np.array([sx, sy, sx, sy], np.float32)  # x, y, w, h
                extra = dict(boxes=boxes, labels=r.labels, pair=pair and pair[0])
                if fmt == "lmdb":
                    writer.add(record, r.target, path=r.path, **extra)
                else:
                    ph, pw = (pair[1], pair[2]) if pair else (0, 0)
                    writer.add(
                        record, r.target, height=h, width=w, path=r.path, pair_hw=(ph, pw), **extra
                    )
                bar.update()
        meta = writer.close(classes=source.classes, params=params, source=str(src))
        if dst.exists():
            raise StorageError(
                f"{dst} appeared while packing (another packer?); delete it and retry."
            )
        os.rename(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def split_dirs(src: Path) -> list[Path]:
    """The split folders of a dataset root (train/, val/, ...), or src itself if it is one."""
    subs = sorted(p for p in src.iterdir() if p.is_dir()) if src.is_dir() else []
    splits = [p for p in subs if any(c.is_dir() for c in p.iterdir())]
    if splits and len(splits) == len(subs):
        return splits
    return [src]


def pack_one(args, src_dir, out, source=None) -> None:
    """Pack one split into `out` with the command line's options (skipped if it exists)."""
    if out.exists():
        print(f"{out} exists: skipped (delete it to re-pack)")
        return
    t0 = time.perf_counter()
    meta = pack_split(
        args.format,
        src_dir,
        out,
        kind=args.kind,
        max_side=args.max_side,
        quality=args.quality,
        size=args.size,
        shard_mb=args.shard_mb,
        workers=args.workers,
        source=source,
    )
    print(f"{out}: {meta['count']} records in {time.perf_counter() - t0:.1f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fastload.pack",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("format", choices=["lmdb", "shards", "verify"])
    p.add_argument(
        "src",
        type=Path,
        help="dataset root (or one split folder); for verify: the pack; "
        "with --source coco|div2k: the pack folder (DST)",
    )
    p.add_argument("dst", type=Path, nargs="?", help="pack folder (one sub-folder per split)")
    p.add_argument("--source", choices=["imagefolder", "coco", "div2k"], default="imagefolder")
    p.add_argument("--annotations", type=Path, help="coco: instances_<split>.json")
    p.add_argument("--images", type=Path, help="coco: the folder of that split's images")
    p.add_argument("--hr", type=Path, help="div2k: the HR image folder")
    p.add_argument("--lr", type=Path, help="div2k: the paired LR folder (optional)")
    p.add_argument("--scale", type=int, help="div2k: the LR scale (2, 3, 4, 8) with --lr")
    p.add_argument("--kind", choices=["jpeg", "raw"], default="jpeg")
    p.add_argument("--max-side", type=int, default=None, help="re-encode JPEGs to this longer side")
    p.add_argument("--quality", type=int, default=90)
    p.add_argument("--size", type=int, default=256, help="raw: longer side of the stored pixels")
    p.add_argument("--shard-mb", type=int, default=1024)
    p.add_argument("--splits", default=None, help="comma-separated split folders (default: all)")
    p.add_argument("--workers", type=int, default=None)
    args = p.parse_args(argv)
    try:
        if args.format == "verify":
            from fastload.storage.shards import verify_pack

            bad = []
            for meta in sorted(args.src.glob("**/meta.json")):
                bad += verify_pack(meta.parent)
                print(f"checked {meta.parent}")
            for line in bad:
                print(f"CORRUPT {line}", file=sys.stderr)
            return 1 if bad else 0
        if args.source != "imagefolder":
            if args.dst is not None:
                p.error(f"--source {args.source} takes one positional folder: DST")
            if args.source == "coco":
                if args.annotations is None or args.images is None:
                    p.error("--source coco needs --annotations FILE and --images DIR")
                source = CocoSource(args.annotations, args.images)
            else:
                if args.hr is None:
                    p.error("--source div2k needs --hr DIR (and optionally --lr DIR --scale S)")
                source = Div2kSource(args.hr, args.lr, args.scale)
            pack_one(args, None, args.src / source.name, source=source)
            return 0
        if args.dst is None:
            p.error("DST is required")
        dirs = split_dirs(args.src)
        if args.splits:
            dirs = [args.src / s for s in args.splits.split(",")]
        for d in dirs:
            pack_one(args, d, args.dst / d.name)
    except FastloadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
