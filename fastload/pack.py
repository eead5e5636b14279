"""Pack an ImageFolder, COCO or DIV2K dataset into LMDB or memory-mapped shards.

    python -m fastload.pack lmdb   SRC DST [--max-side N [--quality Q] | --kind raw --size S|full]
                                           [--compression lz4]
    python -m fastload.pack shards SRC DST [--max-side N [--quality Q] | --kind raw --size S|full]
                                           [--shard-mb M]
    python -m fastload.pack {lmdb,shards,webdataset} DST --source coco \
        --annotations instances_train2017.json --images DIR [--subset N]  # -> DST/train2017/
    python -m fastload.pack {lmdb,shards,webdataset} DST --source div2k \
        --hr DIR [--lr DIR --scale 2|4]                          # -> DST/<HR folder name>/
    python -m fastload.pack webdataset SRC DST [--max-side N --quality Q] [--shard-mb M]
                                           [--shard-samples N]   # tar shards + manifest.json
    python -m fastload.pack verify DST            # every record's or shard's checksum

A record holds the source's named fields (fastload/data/records.py). ImageFolder: image,
label. COCO: one record per image (by image id): image, image_id, boxes [x, y, w, h]
(float32, scaled with the image when re-encoded), labels (category ids, int64). DIV2K: one
record per HR image (by name): image, position, and lr, the paired LR image, when --lr is
given (same kind; a pair resized stays exact: LR = HR / scale). See
fastload/data/sources.py and the layouts in fastload/storage/{shards,lmdb_store,webdataset}.py.

SRC is a dataset root holding split folders (train/, val/ in ImageFolder layout) or one split
folder (`--splits .` says which when its class folders hold only subfolders); DST gets one
pack per split (DST/<split>/), in the same sample order as storage=disk.
Each split is written into a temporary sibling folder and renamed into place when complete,
so an interrupted pack is never mistaken for a finished one. Record kinds (jpeg as is, jpeg
re-encoded at --max-side, raw pixels at --size): fastload/storage/packing.py.

`verify` checks every split found at or under DST (shards: each shard's whole-file crc32,
each record's checksum and each int column's (the labels); LMDB: each record's crc32, each
int column's and the pack's overall checksum; webdataset: each tar shard's size, xxh3_64
and headers, and each sample's int members (.cls, the labels) against the manifest's), one
line per split; exit 1 when one is damaged, 2 when DST holds no pack. A pack written before int columns had a checksum is
said so on its line (not checked, not damaged).

An option given where it does nothing (--quality without --max-side, --max-side or
--quality with --kind raw, --size without it, --shard-samples outside webdataset, --subset
or --hr without their --source, any option to verify) is refused, exit 2, not ignored.

This module is the command line only; packing lives in fastload/storage/.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fastload.argtypes import at_least
from fastload.atomic import folder_id
from fastload.data.folder import IMG_EXTENSIONS
from fastload.data.sources import CocoSource, Div2kSource
from fastload.errors import DatasetError, FastloadError, StorageError
from fastload.storage import lmdb_store, shards
from fastload.storage.lmdb_store import LmdbStorage
from fastload.storage.packing import left_out, not_a_pack, pack_split, stale_reason
from fastload.storage.shards import ShardStorage
from fastload.storage.webdataset import WebDatasetStorage
from fastload.storage.webdataset import verify_split as webdataset_verify

SPLIT_NAMES = {"train", "val", "valid", "validation", "test", "train2017", "val2017"}


def split_dirs(src: Path) -> list[Path]:
    """The split folders of a dataset root (train/, val/, ...), or src itself if it is one:
    a root when every subfolder holds folders and no image (a class folder may hold both:
    ImageFolder reads its subfolders too), or when one is named as a split (ImageNet's flat
    test/ holds images only and is left out, said so, not taken for a class). Subfolders
    holding only folders, none named as a split, are ambiguous (splits, or classes whose
    images sit in subfolders): taken as splits, said so with the way to pack SRC as one."""
    subs = sorted(p for p in src.iterdir() if p.is_dir()) if src.is_dir() else []
    splits = [p for p in subs if any(c.is_dir() for c in p.iterdir())]
    if splits and len(splits) == len(subs):
        if any(holds_images(p) for p in splits):
            return [src]
        if not any(p.name.lower() in SPLIT_NAMES for p in splits):
            names = ", ".join(p.name for p in splits[:4]) + (", ..." if len(splits) > 4 else "")
            print(
                f"{src}: packing its folders {names} as splits (none is named like one: "
                f"train, val, ...); if {src} is one split whose class folders hold "
                f"subfolders, pass --splits . to pack it as one."
            )
        return splits
    if any(p.name.lower() in SPLIT_NAMES for p in splits):
        for p in subs:
            if p not in splits:
                print(f"left out {p}: no class folders in it (pass --splits to choose)")
        return splits
    return [src]


def holds_images(folder: Path) -> bool:
    return any(c.is_file() and c.name.lower().endswith(IMG_EXTENSIONS) for c in folder.iterdir())


def make_storage(args):
    """The store whose writer packs: the same object storage=lmdb|shards builds."""
    common = dict(kind=args.kind, max_side=args.max_side, quality=args.quality, size=args.size)
    if args.format == "lmdb":
        return LmdbStorage(**common, compression=args.compression)
    if args.compression:
        raise StorageError("--compression is an LMDB option (shards stay uncompressed).")
    # without --shard-mb: the store's default, storage.shard_mb's (conf/storage/<format>.yaml),
    # so that a pack made here and one made on first use have shards of one size
    size = {} if args.shard_mb is None else {"shard_mb": args.shard_mb}
    if args.format == "webdataset":
        return WebDatasetStorage(
            kind=args.kind, max_side=args.max_side, quality=args.quality,
            shard_samples=args.shard_samples, **size,
        )  # fmt: skip
    return ShardStorage(**common, **size)


def check_destination(dst: Path, outs: list[Path], store) -> None:
    """StorageError, before anything is packed, when a split's pack cannot go to its folder
    in `outs` (DST/<split>): DST or that folder is a file, or the folder holds files that
    are not a pack (a pack replaces its folder)."""
    for path in (dst, *outs):
        if path.exists() and not path.is_dir():
            raise StorageError(
                f"{path} is a file, not a folder: the packs go into {dst}/<split>/. Give an "
                f"output folder that is new, empty or holds packs."
            )
    for out in outs:
        held = not_a_pack(out, store.marker)
        if held is not None:
            raise StorageError(
                f"{out} holds files that are not a pack ({held}); a pack replaces its folder, "
                f"so they are left as they are. Give an output folder that is new, empty or "
                f"a pack."
            )


def chosen_splits(src: Path, names: str) -> list[Path]:
    """--splits: the named split folders of SRC, each one there (DatasetError naming the
    first that is not, with SRC's folders), so that none is packed before one fails."""
    dirs = [src / name for name in names.split(",")]
    for d in dirs:
        if not d.is_dir():
            have = ", ".join(sorted(p.name for p in src.iterdir() if p.is_dir())) or "none"
            raise DatasetError(
                f"--splits {names}: {d} is not a folder of SRC {src} (its folders: {have}); "
                f"name split folders of SRC, or . for SRC itself."
            )
    return dirs


def pack_one(args, src_dir, out, source=None) -> None:
    """Pack one split into `out` with the command line's options; an existing pack is kept
    when it matches its source and options, re-packed (replaced) when it does not."""
    store = make_storage(args)
    check_destination(out.parent, [out], store)
    replacing = folder_id(out) if out.exists() else None  # the pack judged below
    if replacing is not None:
        # COCO / DIV2K: the source built from the command line, checked like a folder
        what = src_dir if source is None else (lambda: source)
        reason = (
            stale_reason(what, out, store.pack_options())
            if (out / store.marker).is_file()
            else f"it holds no {args.format} pack (another format's, or an unfinished one)"
        )
        if reason is None:
            print(f"{out} exists and matches its source: skipped (delete it to re-pack)")
            left = [] if args.skip_corrupt else left_out(out)
            if left:  # a pack without --skip-corrupt would stop at those files
                more = " ..." if len(left) > 3 else ""
                print(
                    f"{out} was packed with --skip-corrupt and left out {len(left)} file(s) "
                    f"that could not be decoded ({', '.join(left[:3])}{more}). Mend or remove "
                    f"them in the dataset and the next pack includes every file."
                )
            return
        print(f"{out} is out of date ({reason}): re-packing")
    t0 = time.perf_counter()
    meta = pack_split(
        store.writer,
        src_dir,
        out,
        **store.pack_options(),
        workers=args.workers,
        source=source,
        what=args.format,
        skip_corrupt=args.skip_corrupt,
        replacing=replacing,
    )
    skipped = f", {len(meta['skipped'])} undecodable file(s) left out" if meta["skipped"] else ""
    print(f"{out}: {meta['count']} records in {time.perf_counter() - t0:.1f} s{skipped}")


# The pack formats `verify` recognises: a split folder holding the store's marker file, and
# the store module's check of one split (-> records checked, problems).
PACK_CHECKS = (
    (ShardStorage, shards.verify_split),
    (LmdbStorage, lmdb_store.verify_split),
    (WebDatasetStorage, webdataset_verify),
)


def find_packs(root: Path) -> list[tuple[Path, object]]:
    """Every pack split at or under `root`: (folder, its check). Temporary folders of a pack
    being written (or interrupted: fastload/atomic.py) are skipped, and said so."""
    if not root.exists():
        raise StorageError(
            f"{root} does not exist: give verify the folder a pack was written to "
            f"(DST of `python -m fastload.pack shards|lmdb SRC DST`, or one of its splits)."
        )
    found = []
    for store, check in PACK_CHECKS:
        for marker in sorted(root.glob(f"**/{store.marker}")):
            rel = marker.parent.relative_to(root).parts
            if any(part.startswith(".") and ".tmp-" in part for part in rel):
                print(f"skipped {marker.parent}: a pack being written or interrupted (temporary)")
                continue
            found.append((marker.parent, check))
    if not found:
        raise StorageError(
            f"no pack in {root}: expected a shard pack (a folder with meta.json) or an LMDB "
            f"pack (a folder with data.mdb) or a webdataset pack (a folder with manifest.json) there or below it (`python -m fastload.pack "
            f"shards|lmdb SRC DST` writes one per split into DST)."
        )
    return sorted(found, key=lambda f: str(f[0]))


def verify(root: Path) -> int:
    """Check every pack split under `root`: one line per split; 1 when one is damaged."""
    damaged = 0
    for folder, check in find_packs(root):
        records, problems, *rest = check_apart(check, folder)
        notes = rest[0] if rest else []  # what it could not check (webdataset: nothing)
        if not problems:
            print("; ".join([f"checked {folder}: {records} records, ok", *notes]))
            continue
        damaged += 1
        print(f"checked {folder}: {records} records, {len(problems)} problem(s)")
        for line in problems:
            print(f"CORRUPT {line}", file=sys.stderr)
    if damaged:
        print(
            f"{damaged} pack split(s) damaged: delete them and re-pack "
            f"(python -m fastload.pack shards|lmdb SRC DST).",
            file=sys.stderr,
        )
    return 1 if damaged else 0


def _check_and_send(check, folder, conn) -> None:
    try:
        conn.send(check(folder))
    except Exception as exc:  # noqa: BLE001  (reported as the split's problem)
        conn.send((0, [f"{folder}: {type(exc).__name__}: {exc}"]))


def check_apart(check, folder) -> tuple:
    """`check(folder)` in a forked child: a memory-mapped reader that meets damaged
    structure (LMDB trusts its B-tree pages) may die of SIGBUS or SIGSEGV, which must become
    this split's verdict, not the end of the whole verify without a word."""
    import multiprocessing
    import signal

    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_check_and_send, args=(check, folder, send))
    child.start()
    send.close()
    try:
        result = receive.recv()
    except EOFError:
        result = None
    child.join()
    if result is not None:
        return result
    code = child.exitcode or 0
    how = signal.Signals(-code).name if code < 0 else f"exit code {code}"
    return 0, [f"{folder}: reading it crashed the reader ({how}): its internal structure is "
               f"damaged."]  # fmt: skip


def pixel_size(text: str) -> int | None:
    """--size N (a whole number >= 1), or `full` (also null, none, 0): keep the full
    resolution."""
    if text.lower() in ("full", "null", "none", "0"):
        return None
    try:
        return at_least(1)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: use a whole number >= 1, or full (the full resolution)"
        ) from None


def parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m fastload.pack",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("format", choices=["lmdb", "shards", "webdataset", "verify"])
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
    p.add_argument(
        "--subset", type=at_least(1), default=None, help="coco: only the first N images by id"
    )
    p.add_argument("--hr", type=Path, help="div2k: the HR image folder")
    p.add_argument("--lr", type=Path, help="div2k: the paired LR folder (optional)")
    p.add_argument("--scale", type=int, help="div2k: the LR scale (2, 3, 4, 8) with --lr")
    p.add_argument("--kind", choices=["jpeg", "raw"], default="jpeg")
    p.add_argument(
        "--max-side", type=at_least(1), default=None, help="re-encode JPEGs to this longer side"
    )
    p.add_argument("--quality", type=at_least(1, at_most=100), help="with --max-side (default 90)")
    p.add_argument(
        "--size",
        type=pixel_size,
        default=UNSET,
        help="raw: longer side of the stored pixels (default 256); full: as they are "
        "(super-resolution)",
    )
    p.add_argument("--compression", choices=["lz4"], help="lmdb: lz4-compress every value")
    p.add_argument(
        "--shard-mb",
        type=at_least(1),
        help="shards, webdataset: MB per shard (default: storage.shard_mb's, shards 1024, "
        "webdataset 256)",
    )
    p.add_argument(
        "--shard-samples", type=at_least(1), help="webdataset: at most N samples per shard"
    )
    p.add_argument(
        "--splits",
        default=None,
        help="comma-separated split folders of SRC (default: all); '.' packs SRC as one split",
    )
    p.add_argument(
        "--split-name", help="coco/div2k: the pack's split folder (default: the source's name)"
    )
    p.add_argument(
        "--workers", type=at_least(1), default=None, help="packing processes (default: the cores)"
    )
    p.add_argument(
        "--skip-corrupt", action="store_true", help="leave out files that cannot be decoded"
    )
    args = p.parse_args(argv)
    refuse_unused(p, args)
    defaults = {"quality": 90, "size": 256}
    for key, value in defaults.items():
        if getattr(args, key) in (None, UNSET):
            setattr(args, key, value)
    return p, args


UNSET = object()  # --size not given (None is `full`)

# The options that only some packs use: (option, what uses it), by what decides.
SOURCE_OPTIONS = {
    "imagefolder": ("--splits",),
    "coco": ("--annotations", "--images", "--subset", "--split-name"),
    "div2k": ("--hr", "--lr", "--scale", "--split-name"),
}
FORMAT_OPTIONS = {"shards": ("--shard-mb",), "webdataset": ("--shard-mb", "--shard-samples")}


def refuse_unused(p, args) -> None:
    """argparse's error (exit 2) for an option given where it does nothing (a --quality
    without --max-side, a --subset without --source coco, ...): taken silently, it would
    make the user believe the pack was made with it."""
    given = {
        "--" + k.replace("_", "-")
        for k, v in vars(args).items()
        if k not in ("format", "src", "dst") and v != p.get_default(k)
    }
    if args.format == "verify":
        if args.dst is not None:
            p.error(f"verify takes one folder, the pack: {args.dst} is a second one")
        if given:
            p.error(f"{min(given)} is a packing option: verify takes only the pack folder")
        return
    for option in sorted(given):
        users = [s for s, options in SOURCE_OPTIONS.items() if option in options]
        if users and args.source not in users:
            p.error(
                f"{option} is a --source {'|'.join(users)} option, not of --source {args.source}"
            )
        formats = [f for f, options in FORMAT_OPTIONS.items() if option in options]
        if formats and args.format not in formats:
            p.error(f"{option} is an option of {' and '.join(formats)} packs, not {args.format}")
    raw = args.kind == "raw"
    for option, wrong, why in (
        ("--max-side", raw, "--kind raw stores decoded pixels at --size"),
        ("--quality", raw, "--kind raw stores decoded pixels, not JPEGs"),
        ("--quality", not args.max_side, "it is the quality of JPEGs re-encoded at --max-side; "
                                         "without --max-side the files are stored as they are"),
        ("--size", not raw, "it is the side of --kind raw pixels; JPEGs are resized by --max-side"),
        ("--scale", not args.lr, "it is the scale of the LR images given by --lr"),
    ):  # fmt: skip
        if option in given and wrong:
            p.error(f"{option} does nothing here: {why}")


def pack_source(p, args) -> None:
    """--source coco|div2k: one pack named after the source's split, under SRC (= DST)."""
    if args.dst is not None:
        p.error(f"--source {args.source} takes one positional folder: DST")
    if args.source == "coco":
        if args.annotations is None or args.images is None:
            p.error("--source coco needs --annotations FILE and --images DIR")
        source = CocoSource(args.annotations, args.images, args.subset)
    else:
        if args.hr is None:
            p.error("--source div2k needs --hr DIR (and optionally --lr DIR --scale S)")
        source = Div2kSource(args.hr, args.lr, args.scale)
    pack_one(args, None, args.src / (args.split_name or source.name), source=source)


def main(argv: list[str] | None = None) -> int:
    p, args = parse(argv)
    try:
        if args.format == "verify":
            return verify(args.src)
        if args.source != "imagefolder":
            pack_source(p, args)
            return 0
        if args.dst is None:
            p.error("DST is required")
        if not args.src.is_dir():
            raise DatasetError(
                f"SRC {args.src} is not a folder: pass a dataset root (SRC/<split>/<class>/"
                f"<image>, e.g. ImageNet's train/ and val/) or one split (SRC/<class>/<image>)."
            )
        dirs = chosen_splits(args.src, args.splits) if args.splits else split_dirs(args.src)
        src = args.src.resolve()
        for d in dirs:  # DST/<split> in SRC: folders of the dataset; SRC in it: replaced
            out = (args.dst / d.name).resolve()
            if src == out or src in out.parents or out in src.parents:
                where = "inside" if src in out.parents else "in place of"
                raise StorageError(
                    f"DST {args.dst} would put the pack {out} {where} SRC {args.src}: its "
                    f"folders would become classes of the dataset, or the dataset's folders "
                    f"part of the pack. Give DST outside SRC, e.g. "
                    f"{src.parent / (src.name + '.packs')}."
                )
        check_destination(args.dst, [args.dst / d.name for d in dirs], make_storage(args))
        created = not args.dst.exists()
        try:
            for d in dirs:
                pack_one(args, d, args.dst / d.name)
        finally:
            if created and args.dst.is_dir() and not any(args.dst.iterdir()):
                args.dst.rmdir()  # a failed first pack leaves no empty DST behind
    except FastloadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C): nothing half-written was kept.", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
