"""python -m fastload.bench storage: images/s of the full training input pipeline per storage.

Pipeline = storage read + decode (--backend, default pil; raw shards: no decode) + RandomResizedCrop 224
+ flip + collate, through a DataLoader with usable_cores() workers (fresh workers each pass,
the default persistent_workers=false), on the train split of the default synthetic set.

    warm: a first untimed pass fills the page cache, then `--repeats` timed passes;
    cold: before each timed pass the store's files are evicted from the page cache
          (posix_fadvise DONTNEED, what storage.cold_cache=true does); on tmpfs nothing can
          be evicted (the data IS the page cache), so its cold row is the warm number, marked.

Columns: epoch_img_s counts the whole pass (worker start-up included); steady_img_s excludes
the first batch (start-up and first decode); read_mb_s is bytes read / time inside read()
summed over workers (what one reader saw; tells a cold pass from a warm one).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import torch

from fastload.bench.common import default_dataset, format_table, write_json
from fastload.data.dataset import ImageDataset, collate
from fastload.data.sampling import EpochSampler
from fastload.data.transforms import RandomResizedCropFlip
from fastload.loaders.baseline import usable_cores, worker_init
from fastload.storage.base import du_bytes, fs_type

STORES = ("disk", "tmpfs", "lmdb", "shards-jpeg", "shards-raw")
# FFCV on this 2-core machine (issue 5's reference figures; not re-measured here unless an
# FFCV venv is available): raw pixels ~1,800 img/s, full-size JPEG ~830 img/s, RRC 224 + flip.
FFCV_RAW, FFCV_JPEG = 1800.0, 830.0


def open_store(name: str, root: Path, split: str, args):
    """(storage, files that make up the store for the size column, seconds spent packing)."""
    from fastload.storage import lmdb_store, shards, tmpfs
    from fastload.storage.disk import DiskStorage

    t0 = time.perf_counter()
    if name == "disk":
        s = DiskStorage(root, split, cold_cache=True)
        return s, root / split, 0.0
    if name == "tmpfs":
        final = tmpfs.stage(root, [split], args.tmpfs_dir, progress=False)
        s = tmpfs.TmpfsStorage(root, split, target_dir=args.tmpfs_dir, cold_cache=True)
        return s, final / split, time.perf_counter() - t0
    if name == "lmdb":
        lmdb_store.LmdbStorage.prepare(root=root, splits=[split])
        s = lmdb_store.LmdbStorage(root, split, cold_cache=True)
        return s, s.dir, time.perf_counter() - t0
    kind = "jpeg" if name == "shards-jpeg" else "raw"
    opts = dict(
        kind=kind,
        max_side=args.max_side if kind == "jpeg" else None,
        quality=args.quality,
        size=args.raw_size,
    )
    shards.ShardStorage.prepare(root=root, splits=[split], **opts)
    s = shards.ShardStorage(root, split, cold_cache=True, **opts)
    return s, s.dir, time.perf_counter() - t0


def make_backend(name: str):
    """The decode backend as `backend=<name>` builds it (conf/backend/<name>.yaml)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[2] / "conf" / "backend" / f"{name}.yaml"
    return instantiate(OmegaConf.load(conf))


def one_pass(storage, args, cold: bool, epoch: int) -> dict:
    if cold:
        storage.before_epoch()  # evicts (cold_cache=True) and resets the read counters
    else:
        storage._stats.zero_()
    data = ImageDataset(
        storage, make_backend(args.backend), RandomResizedCropFlip(args.crop), seed=0
    )
    sampler = EpochSampler(len(data), rank=0, world_size=1, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    loader = torch.utils.data.DataLoader(
        data,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        collate_fn=collate,
        worker_init_fn=worker_init if args.workers else None,
        prefetch_factor=2 if args.workers else None,
        drop_last=False,
    )
    t0 = time.perf_counter()
    t_first, n, n_first = None, 0, 0
    for batch in loader:
        n += len(batch["target"])
        if t_first is None:
            t_first, n_first = time.perf_counter(), n
    t1 = time.perf_counter()
    stats = storage.epoch_stats()
    return {
        "epoch_img_s": n / (t1 - t0),
        "steady_img_s": (n - n_first) / (t1 - t_first) if t1 > t_first else None,
        "read_mb_s": stats["read_mb_per_s"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fastload.bench storage",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--root", default=None, help="ImageFolder root (default: the synthetic set)")
    p.add_argument("--split", default="train")
    p.add_argument("--stores", default=",".join(STORES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=usable_cores())
    p.add_argument("--crop", type=int, default=224)
    p.add_argument(
        "--backend", default="pil", help="decode backend (conf/backend/*.yaml): pil, turbo, ..."
    )
    p.add_argument("--max-side", type=int, default=256, help="shards-jpeg: re-encode side")
    p.add_argument("--quality", type=int, default=90)
    p.add_argument("--raw-size", type=int, default=256, help="shards-raw: stored longer side")
    p.add_argument("--tmpfs-dir", default="/dev/shm/fastload-bench")
    p.add_argument("--keep-tmpfs", action="store_true")
    p.add_argument("--json", default="outputs/bench/storage.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    root = Path(args.root) if args.root else default_dataset()
    rows = []
    for name in args.stores.split(","):
        storage, where, pack_s = open_store(name, root, args.split, args)
        apparent, allocated = du_bytes(where)
        on_ram = fs_type(storage.store_root()) in ("tmpfs", "ramfs")
        one_pass(storage, args, cold=False, epoch=0)  # warm-up: page cache, imports
        for mode in ("warm", "cold"):
            runs = [
                one_pass(storage, args, cold=mode == "cold", epoch=1 + r)
                for r in range(args.repeats)
            ]
            row = {
                "storage": name,
                "cache": mode + (" (RAM: no-op)" if mode == "cold" and on_ram else ""),
                "epoch_img_s": statistics.median(r["epoch_img_s"] for r in runs),
                "steady_img_s": statistics.median(r["steady_img_s"] or 0 for r in runs),
                "read_mb_s": statistics.median(r["read_mb_s"] or 0 for r in runs),
                "size_mb": apparent / 1e6,
                "on_disk_mb": allocated / 1e6,
                "prep_s": pack_s,
                "images": len(storage),
            }
            rows.append(row)
            print(format_table([row], list(row)).splitlines()[-1], flush=True)
    if not args.keep_tmpfs and "tmpfs" in args.stores:
        shutil.rmtree(args.tmpfs_dir, ignore_errors=True)

    cols = [
        "storage",
        "cache",
        "epoch_img_s",
        "steady_img_s",
        "read_mb_s",
        "size_mb",
        "on_disk_mb",
        "prep_s",
    ]
    print()
    print(
        f"{root}/{args.split}: {rows[0]['images']} images, batch {args.batch_size}, "
        f"{args.workers} workers, RandomResizedCrop {args.crop} + flip, median of {args.repeats}"
    )
    print(format_table(rows, cols))
    best = {r["storage"]: r["steady_img_s"] for r in rows if r["cache"] == "warm"}
    if "shards-raw" in best:
        print(
            f"shards-raw {best['shards-raw']:,.0f} img/s vs FFCV raw ~{FFCV_RAW:,.0f} "
            f"(reference figure): {'>=' if best['shards-raw'] >= FFCV_RAW else '<'} target"
        )
    if "shards-jpeg" in best:
        goal = 1.5 * FFCV_JPEG
        print(
            f"shards-jpeg {best['shards-jpeg']:,.0f} img/s vs 1.5 x FFCV JPEG ~{goal:,.0f} "
            f"(reference figure): {'>=' if best['shards-jpeg'] >= goal else '<'} target"
        )
    print("prep_s: time to stage / pack the split in this run (0 when reused).")
    path = write_json(args.json, "storage", vars(args) | {"root": str(root)}, rows)
    print(f"wrote {path}")
    return 0
