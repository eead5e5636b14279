"""python -m fastload.bench storage: images/s of the full training input pipeline per storage.

Pipeline = storage read + decode (--backend, default pil; raw shards: no decode) + RandomResizedCrop 224
+ flip + collate: the host stage of loader=baseline (its DataLoader with usable_cores()
workers and reused batch slots, each batch copied out of its slot as training gets it), on
the train split of the default synthetic set.

    warm: a first untimed pass fills the page cache and starts the workers, then `--repeats`
          timed epochs with persistent workers (FFCV keeps its threads too; --fresh-workers
          starts new ones each epoch, which on a 1,000-image set is most of an epoch);
    cold: before each timed pass the store's files are evicted from the page cache
          (posix_fadvise DONTNEED, what storage.cold_cache=true does), with fresh workers (a
          live worker's mmap keeps its pages); on tmpfs nothing can be evicted (the data IS
          the page cache), so its cold row is the warm number, marked.

webdataset reads tar shards (--wds-shard-mb) where they are; webdataset-http streams the same
shards from Python's http.server on this machine through the node cache (in <--tmpfs-dir>-wds-cache):
warm = the cached epoch, cold = the cache emptied before each pass (every shard fetched).

--ffcv-python runs FFCV (scripts/bench_ffcv.py, in an environment that has it) on the same
files in the same run: raw pixels at --raw-size and full-size JPEG, and the target lines
compare whole epochs against those rows instead of the reference figures below.

--dali-python runs NVIDIA DALI's CPU pipeline (scripts/bench_dali.py) the same way: its file
reader over the JPEGs as they are (beside storage=disk), and its numpy reader over decoded
images capped at --raw-size, one .npy file each (beside shards-raw and FFCV raw).

--rounds N measures every row, FFCV's and DALI's too, N times in turn and judges each target on the
median of the N same-round ratios: this shared machine's speed drifts by +-30 % over minutes,
so a ratio of figures taken a minute apart, not the figures, is what repeats.

Columns: epoch_img_s counts the whole pass (worker start-up included); steady_img_s excludes
the first batch (start-up and first decode); read_mb_s is bytes read / time inside read()
summed over workers (what one reader saw; tells a cold pass from a warm one).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from fastload.bench.backends import backend_names
from fastload.bench.common import (
    add_peer_options,
    at_least,
    check_output,
    check_root,
    compose,
    data_overrides,
    default_dataset,
    format_table,
    pick_names,
    product_loader,
    run_dali,
    run_ffcv,
    same_round_target,
    target_text,
    write_json,
)
from fastload.host import fs_type, usable_cores
from fastload.measure import host_epoch
from fastload.storage.base import du_bytes

STORES = ("disk", "tmpfs", "lmdb", "shards-jpeg", "shards-raw", "webdataset", "webdataset-http")
COLUMNS = [
    "storage",
    "cache",
    "epoch_img_s",
    "steady_img_s",
    "read_mb_s",
    "size_mb",
    "on_disk_mb",
    "prep_s",
]


def store_overrides(name: str, args) -> list[str]:
    """The storage= options of one row (every store with cold_cache, for the cold rows)."""
    options = {
        "disk": ["storage=disk"],
        "tmpfs": [
            "storage=tmpfs",
            f"storage.target_dir={args.tmpfs_dir}",
            "storage.progress=false",
        ],
        "lmdb": ["storage=lmdb"],
        "shards-jpeg": [
            "storage=shards",
            "storage.kind=jpeg",
            f"storage.max_side={args.max_side}",
            f"storage.quality={args.quality}",
        ],
        "shards-raw": ["storage=shards", "storage.kind=raw", f"storage.size={args.raw_size}"],
        # tar shards read where they are (local files) / streamed from a web server through
        # the node cache: its warm row reads the cached shards, its cold row empties the
        # cache before each epoch (every shard crosses the network again).
        "webdataset": ["storage=webdataset", f"storage.shard_mb={args.wds_shard_mb}"],
        "webdataset-http": [
            "storage=webdataset",
            f"storage.url={getattr(args, 'wds_url', None)}",
            f"storage.cache_dir={args.tmpfs_dir}-wds-cache",
        ],
    }
    return options[name] + ["storage.cold_cache=true"]


def backend_overrides(name: str) -> list[str]:
    """--backend: a conf/backend/ name, or one of bench backends' variants (e.g.
    turbo+cv2+fast: backend=turbo with fast IDCT, as FFCV's decoder uses TJFLAG_FASTDCT)."""
    group, overrides = backend_names()[name]
    return [f"backend={group}", *overrides]


def open_store(name: str, root: Path, args):
    """(config of this row, its storage object, the split's folder for the size column,
    seconds spent staging / packing it in this run)."""
    from fastload.pipeline import build_storage

    cfg = compose(
        data_overrides(root, split=args.split, crop=args.crop, batch_size=args.batch_size)
        + store_overrides(name, args)
        + [
            *backend_overrides(args.backend),
            f"loader.num_workers={args.workers}",
            "loader.drop_last=false",
            f"loader.reuse_batch_memory={not args.no_reuse}",
            # One stream per timed epoch: the cold passes evict between epochs, and the rows
            # stay comparable with FFCV's per-epoch loop (bench train measures pipelining).
            "loader.cross_epoch=false",
        ]
    )
    storage = build_storage(cfg)
    t0 = time.perf_counter()
    storage.prepare(root, [args.split])
    prep_s = time.perf_counter() - t0
    return cfg, storage, Path(storage.open(root, args.split).store_root()), prep_s


@contextlib.contextmanager
def removed_after(folder: Path, keep: bool = False):
    """Remove what the benchmark writes into `folder` (--tmpfs-dir, its -wds-cache) once
    done: the folder when this run made it, else only the entries it added, so that a
    --tmpfs-dir of /dev/shm itself, or any folder holding other files, keeps them."""
    from fastload.storage.user_dir import user_folder

    folder = Path(folder)
    # the stores write into this user's folder of it (<folder>/<uid>): what is new there
    # goes too, when that folder was there before
    places = (folder, user_folder(folder))
    before = {p: {e.name for e in p.iterdir()} if p.is_dir() else None for p in places}
    try:
        yield
    finally:
        if keep or not folder.is_dir():
            pass
        elif before[folder] is None:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            for place in places:  # a user folder made by this benchmark goes whole first
                for path in place.iterdir() if place.is_dir() else ():
                    if path.name in (before[place] or ()):
                        continue
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        path.unlink(missing_ok=True)


@contextlib.contextmanager
def served_webdataset(root: Path, args):
    """webdataset-http: the split's local webdataset pack (packed now when missing) served
    by Python's threaded http.server in a subprocess on a free port, as a stand-in for a
    web server on the network; sets args.wds_url."""
    from fastload.storage.webdataset import WebDatasetStorage

    store = WebDatasetStorage(shard_mb=args.wds_shard_mb)
    store.prepare(root, [args.split])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = store.pack_root(root)
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    with removed_after(Path(f"{args.tmpfs_dir}-wds-cache")):
        proc = subprocess.Popen([*cmd, "--directory", str(folder)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            for _ in range(200):
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                    break
                time.sleep(0.05)
            args.wds_url, args.wds_folder = f"http://127.0.0.1:{port}", folder / args.split
            yield
        finally:
            proc.terminate()
            proc.wait(10)


def make_loader(cfg, storage, persistent: bool):
    cfg.loader.persistent_workers = persistent
    return product_loader(cfg, storage=storage)


def one_pass(loader, cold: bool, epoch: int) -> dict:
    reader = loader.dataset.reader
    if cold:
        reader.before_epoch()  # evicts (cold_cache=True) and resets the read counters
    else:
        reader.reset_stats()  # a warm pass: counted alone, nothing evicted
    rates = host_epoch(loader, epoch)
    return {**rates, "read_mb_s": reader.epoch_stats()["read_mb_per_s"]}


def peer_row(name: str, result: dict, size_bytes: int | None = None) -> dict | None:
    """A peer's benchmark result (scripts/bench_ffcv.py, bench_dali.py) as a table row, or
    None (its error printed) when the run failed."""
    if "error" in result:
        print(f"{name}: failed: {result['error']}", flush=True)
        return None
    rates = result["epochs_images_per_s"]
    size_mb = size_bytes / 1e6 if size_bytes else None
    row = {
        "storage": name,
        "cache": "warm",
        "epoch_img_s": statistics.median(rates),
        "steady_img_s": None,
        "read_mb_s": None,
        "size_mb": size_mb,
        "on_disk_mb": size_mb,
        "prep_s": None,
        "images": result.get("images_per_epoch"),
        "epochs_img_s": rates,
    }
    print(format_table([row], list(row)[:-1]).splitlines()[-1], flush=True)
    return row


@contextlib.contextmanager
def packs_folder(root: Path):
    """ROOT.packs, where the peers write their packs (.beton, .npy files) beside ours: made
    when missing, and removed again when this run made it and a peer that could not start
    left it empty, so that no empty folder is left beside the user's dataset."""
    cache = Path(f"{root}.packs")
    made = not cache.exists()
    cache.mkdir(parents=True, exist_ok=True)
    try:
        yield cache
    finally:
        if made:
            with contextlib.suppress(OSError):  # not empty: a pack is in it, kept for reuse
                cache.rmdir()


def peer_failed(args, peer: str, result: dict) -> None:
    """Keep a peer's error (the last line of its output) for the targets it leaves unjudged:
    args.peer_errors[peer]."""
    if "error" in result:
        args.peer_errors = {**getattr(args, "peer_errors", {}), peer: result["error"]}


def ffcv_rates(args, root: Path) -> list[dict]:
    """FFCV on the same files in the same run (scripts/bench_ffcv.py in --ffcv-python's env):
    raw pixels at the shards-raw size, and full-size JPEG; whole epochs after the JIT one."""
    size = args.raw_size
    return peer_rates(args, root, "ffcv", run_ffcv, lambda cache: [
        ("raw", f"ffcv-raw-{size}", ["--max-resolution", str(size),
                                     "--beton", str(cache / f"ffcv-raw-{size}.beton")]),
        ("jpg", "ffcv-jpeg-full", ["--max-resolution", "512",
                                   "--beton", str(cache / "ffcv-jpeg-full.beton")]),
    ])  # fmt: skip


def dali_rates(args, root: Path) -> list[dict]:
    """DALI's CPU pipeline on the same files in the same run (scripts/bench_dali.py in
    --dali-python's env): the JPEG files as they are, and decoded pixels at the shards-raw
    size (.npy files, written once beside the other packs); whole epochs after a warm-up."""
    size = ["--max-resolution", str(args.raw_size)]
    return peer_rates(args, root, "dali", run_dali, lambda cache: [
        ("raw", f"dali-raw-{args.raw_size}",
         [*size, "--npy-dir", str(cache / f"dali-npy-{args.raw_size}")]),
        ("jpg", "dali-jpeg", size),
    ])  # fmt: skip


def peer_rates(args, root: Path, peer: str, run, modes) -> list[dict]:
    """A peer's rows, one per (write mode, row name, its options) of `modes(packs folder)`:
    the same crop, workers, batch and epochs (an untimed one, then --repeats) as ours."""
    rows = []
    with packs_folder(root) as cache:
        for mode, name, extra in modes(cache):
            result = run(
                getattr(args, f"{peer}_python"), root, args.crop, args.workers,
                *("--epochs", str(1 + args.repeats), "--write-mode", mode),
                *("--batch-size", str(args.batch_size)), *extra,
            )  # fmt: skip
            peer_failed(args, peer, result)
            rows.append(peer_row(name, result, result.get("beton_bytes")))
    return [r for r in rows if r]


def parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m fastload.bench storage",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--root", default=None, help="ImageFolder root (default: the synthetic set)")
    p.add_argument("--split", default="train")
    p.add_argument(
        "--stores", default=",".join(STORES), help=f"comma-separated, of: {', '.join(STORES)}"
    )
    p.add_argument("--repeats", type=at_least(1), default=3)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every row (FFCV's too) this many times in turn; targets: median ratio",
    )
    p.add_argument("--batch-size", type=at_least(1), default=64)
    p.add_argument("--workers", type=at_least(0), default=usable_cores())
    p.add_argument("--crop", type=at_least(1), default=224)
    p.add_argument(
        "--backend",
        default="pil",
        help="decode backend: conf/backend/*.yaml (pil, turbo, ...) or a bench backends "
        "variant (turbo+cv2+fast, ...)",
    )
    p.add_argument("--max-side", type=at_least(1), default=256, help="shards-jpeg: re-encode side")
    p.add_argument("--quality", type=at_least(1, at_most=100), default=90, help="JPEG quality")
    p.add_argument(
        "--raw-size", type=at_least(1), default=256, help="shards-raw: stored longer side"
    )
    p.add_argument("--wds-shard-mb", type=at_least(1), default=8, help="webdataset: tar shard size")
    p.add_argument("--tmpfs-dir", default="/dev/shm/fastload-bench",
                   help="where the tmpfs row stages its copy; what this run adds there is "
                   "removed at the end (the folder too when this run made it)")  # fmt: skip
    p.add_argument("--keep-tmpfs", action="store_true", help="keep the staged copy")
    p.add_argument(
        "--fresh-workers",
        action="store_true",
        help="warm passes with new workers each epoch (persistent_workers=false)",
    )
    p.add_argument(
        "--no-reuse", action="store_true", help="loader.reuse_batch_memory=false (torch's path)"
    )
    add_peer_options(p, "its rows in the same run")
    p.add_argument("--json", default="outputs/bench/storage.json")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: measure at least one round")
    args.stores = ",".join(pick_names(p, "--stores", args.stores, STORES))
    pick_names(p, "--backend", args.backend, list(backend_names()))
    check_root(p, args.root, args.split)
    check_output(p, "--json", args.json)
    if (args.ffcv_python or args.dali_python) and args.split != "train":
        p.error(f"--split {args.split}: FFCV and DALI read the train split; compare on train")
    return args


def measure_store(name: str, root: Path, args) -> list[dict]:
    """The warm and the cold row of one store."""
    cfg, storage, where, pack_s = open_store(name, root, args)
    if name == "webdataset-http":  # its store root is the (empty) node cache: size the pack
        where = args.wds_folder
    apparent, allocated = du_bytes(where)
    # a streamed store's cold pass empties its node cache (a real cold pass, even on tmpfs)
    on_ram = fs_type(where) in ("tmpfs", "ramfs") and name != "webdataset-http"
    rows = []
    for mode in ("warm", "cold"):
        # Cold passes need fresh workers: a live worker's mmap pins the pages it mapped.
        loader = make_loader(cfg, storage, mode == "warm" and not args.fresh_workers)
        one_pass(loader, cold=False, epoch=0)  # warm-up: page cache, workers
        runs = [one_pass(loader, cold=mode == "cold", epoch=1 + r) for r in range(args.repeats)]
        ring = loader.ring_stats()
        loader.close()  # stops persistent workers
        row = {
            "storage": name,
            "cache": mode + (" (RAM: no-op)" if mode == "cold" and on_ram else ""),
            "epoch_img_s": statistics.median(r["epoch_img_s"] for r in runs),
            "steady_img_s": median_measured(r["steady_img_s"] for r in runs),
            "read_mb_s": median_measured(r["read_mb_s"] for r in runs),
            "size_mb": apparent / 1e6,
            "on_disk_mb": allocated / 1e6,
            "prep_s": pack_s,
            "images": len(loader.dataset),
            "epochs_img_s": [r["epoch_img_s"] for r in runs],
            **ring,
        }
        rows.append(row)
        print(format_table([row], COLUMNS).splitlines()[-1], flush=True)
    return rows


def median_measured(values) -> float | None:
    """The median of the values measured, None (printed n/a) when none was: an epoch of one
    batch has no steady rate, and counted as 0 it showed 0 img/s (and pulled medians down)."""
    measured = [v for v in values if v is not None]
    return statistics.median(measured) if measured else None


def round_rows(r: int, root: Path, args) -> list[dict]:
    """Round r's rows: the stores', then the peers' (FFCV, DALI); in odd rounds the peers'
    first, and their order turns each round too. The sides of a target ratio run minutes
    apart, and this machine's speed drifts over minutes: taking turns at going first keeps a
    drift from favouring the same side in every round."""
    peers = [run for run, option in ((ffcv_rates, "ffcv_python"), (dali_rates, "dali_python"))
             if getattr(args, option, None)]  # fmt: skip
    peers = peers[r % 2 :] + peers[: r % 2] if peers else []
    peers_first = r % 2 == 1
    theirs = [row for run in peers for row in run(args, root)] if peers_first else []
    ours = [row for name in args.stores.split(",") for row in measure_store(name, root, args)]
    if not peers_first:
        theirs = [row for run in peers for row in run(args, root)]
    return ours + theirs


def combine_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One row per (storage, cache) over --rounds: the median of each round's figures, every
    epoch kept (epochs_img_s) and each round's epoch_img_s (rounds_epoch_img_s)."""
    if len(rounds) == 1:
        return rounds[0]
    out = []
    for first in rounds[0]:
        same = [
            r
            for rows in rounds
            for r in rows
            if (r["storage"], r["cache"]) == (first["storage"], first["cache"])
        ]
        row = dict(first)
        for k, v in first.items():
            if not isinstance(v, int | float) or isinstance(v, bool) or k == "prep_s":
                continue
            if any(r[k] != v for r in same):  # a figure; the image count stays what it is
                row[k] = median_measured(r[k] for r in same)
        row["epochs_img_s"] = [e for r in same for e in r.get("epochs_img_s", [])]
        row["rounds_epoch_img_s"] = [r["epoch_img_s"] for r in same]
        out.append(row)
    return out


def target_ratios(rounds: list[list[dict]], args) -> list[dict]:
    """The targets: shards-raw and the disk JPEG path each >= 2x FFCV's raw / full-size
    JPEG path, shards-jpeg >= 1.5x FFCV full-size JPEG, and both ahead of DALI; on whole
    epochs (epoch_img_s, as FFCV's loop reports them). Each round's ratio is taken within
    that round (FFCV and fastload a minute apart: this machine's speed drifts more than that
    between rounds); the verdict is on their median. Without FFCV in the run: the
    reference figures."""
    out = []
    for store, ref_name, factor, label in (
        ("shards-raw", f"ffcv-raw-{args.raw_size}", 2.0, "FFCV raw"),
        ("disk", "ffcv-jpeg-full", 2.0, "FFCV full-size JPEG"),
        ("shards-jpeg", "ffcv-jpeg-full", 1.5, "FFCV full-size JPEG"),
        ("shards-raw", f"dali-raw-{args.raw_size}", 1.0, "DALI raw (.npy files)"),
        ("disk", "dali-jpeg", 1.0, "DALI CPU JPEG"),
    ):
        ours, refs, rows_of_store = [], [], False
        for rows in rounds:
            warm = {r["storage"]: r["epoch_img_s"] for r in rows if r["cache"] == "warm"}
            rows_of_store |= store in warm
            # A round without the peer's row judges nothing: a figure from another machine
            # or day is not a reference (each target is a ratio within one round).
            if store in warm and ref_name in warm:
                ours.append(warm[store])
                refs.append(warm[ref_name])
        peer = ref_name.split("-")[0]  # ffcv, dali
        error = getattr(args, "peer_errors", {}).get(peer)
        if ours:
            target = same_round_target(ours, refs, factor)
            out.append({"store": store, "reference": label, "measured": True, **target})
        elif rows_of_store and error:
            # the peer's python was given: "--ffcv-python runs it" would send the user back
            # to the option they used; say why that interpreter could not
            python = getattr(args, f"{peer}_python")
            why = f"--{peer}-python {python} could not run {peer.upper()}: {error}"
            out.append({"store": store, "reference": label, "measured": False, "why": why})
        elif rows_of_store and peer == "ffcv":
            why = "no FFCV row in this run; --ffcv-python runs it"
            out.append({"store": store, "reference": label, "measured": False, "why": why})
    return out


def print_targets(targets: list[dict]) -> None:
    for t in targets:
        if not t["measured"]:
            print(f"{t['store']} vs {t['reference']}: not judged ({t['why']})")
            continue
        print(f"{t['store']} vs {t['reference']} (measured in the same round): {target_text(t)}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    root = Path(args.root) if args.root else default_dataset()
    rounds = []
    with contextlib.ExitStack() as stack:
        if "tmpfs" in args.stores.split(","):
            stack.enter_context(removed_after(Path(args.tmpfs_dir), keep=args.keep_tmpfs))
        if "webdataset-http" in args.stores.split(","):
            stack.enter_context(served_webdataset(root, args))
        for r in range(args.rounds):
            if args.rounds > 1:
                print(f"round {r + 1} of {args.rounds}", flush=True)
            rounds.append(round_rows(r, root, args))
    rows = combine_rounds(rounds)
    print()
    print(
        f"{root}/{args.split}: {rows[0]['images']} images, batch {args.batch_size}, "
        f"{args.workers} workers ({'fresh' if args.fresh_workers else 'persistent'} when warm, "
        f"fresh when cold), RandomResizedCrop {args.crop} + flip, backend={args.backend}, "
        f"median of {args.repeats} epochs"
        + (f", then of {args.rounds} rounds" if args.rounds > 1 else "")
    )
    print(format_table(rows, COLUMNS))
    targets = target_ratios(rounds, args)
    print_targets(targets)
    print("prep_s: time to stage / pack the split in this run (0 when reused).")
    params = vars(args) | {"root": str(root), "targets": targets}
    path = write_json(args.json, "storage", params, rows)
    print(f"wrote {path}")
    return 0
