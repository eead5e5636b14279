"""python -m fastload.bench backends: decode + RandomResizedCrop(224) + flip, per backend.

For every backend that can start here: images/s on one core (an in-process loop over the
bytes already in memory) and on all usable cores (a fork pool, one process per core). Beside
them, measured in the same run on the same files (the JPEGs of ROOT/train, the training
split the DataLoader rows load; validation images are not read):

* ceiling "read bytes": reading the files (page cache), nothing else;
* ceiling "bare decode": full-size decode with the fastest decoder (simplejpeg), no crop;
* "textbook": torchvision ImageFolder + RandomResizedCrop(224) + RandomHorizontalFlip +
  ToTensor + Normalize through a DataLoader (usable-cores workers, batch 64);
* "fastload loader": the same DataLoader setup with fastload's dataset + the best CPU
  backend of this run + uint8 collate, as a training run feeds the GPU with it: epochs
  streamed back to back (loader.cross_epoch, the default); once more with a new DataLoader
  iteration per epoch (loader.cross_epoch=false, the textbook row's way), to show what the
  ramp at each epoch's start and end costs;
* optionally the peers, each from its own environment: FFCV's JPEG pipeline (--ffcv-python,
  scripts/bench_ffcv.py) and NVIDIA DALI's CPU pipeline (--dali-python, scripts/bench_dali.py:
  file reader, region-decoding random crop, resize, flip); and nvJPEG batched decode when
  CUDA is available.

The targets printed at the end, each on same-round ratios (--rounds N: every side once per
round, the order rotating; the verdict on the median, "every round" where it says so): the
fastload DataLoader ahead of FFCV's and DALI's loaders in every round, and at >= 0.95 of the
"bare decode" ceiling (the entropy-decoding floor on photographs: no crop skips it), timed
again in each round for it. The "x textbook" column divides each row by the textbook row,
timed once: a guide, not a target (figures minutes apart differ by up to +-30 % here).

Backends are built from the config as train.py builds them: --backends takes every
conf/backend/*.yaml name (backend=nvjpeg decodes on the GPU: its row is the nvJPEG one) and
the variants below (VARIANTS: a config name plus overrides).

Every DataLoader row is measured the same way (`warm_epochs`): persistent workers, a first
untimed epoch, then whole epochs, each from its start to its last batch. A training set with
fewer than 4 x workers x prefetch_factor (2) batches per epoch is refused: its epoch would be
mostly the batches already in flight when it starts. The default dataset is the synthetic
ImageNet-style set (photo-like JPEGs, ~450 px, 10 classes, 25 validation images per class),
with 100 training images per class or as many as the DataLoader rows need.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from fastload.bench.common import (
    add_peer_options,
    at_least,
    check_output,
    check_root,
    compose,
    config_names,
    default_dataset,
    format_table,
    machine,
    pick_names,
    run_dali,
    run_ffcv,
    same_round_target,
    target_text,
    write_json,
)
from fastload.errors import user_error
from fastload.host import usable_cores

# --backends takes every conf/backend/<name>.yaml as is (backend=<name>) and these variants
# of them (backend=<config> + overrides); those that cannot start here are reported, skipped.
VARIANTS = {
    "pil+draft": ("pil", ["backend.draft=true"]),
    "turbo+pilresize": ("turbo", ["backend.resize=pil"]),
    "turbo+cv2": ("turbo", ["backend.resize=cv2"]),
    "turbo+cv2+fast": (
        "turbo",
        ["backend.resize=cv2", "backend.fastdct=true", "backend.fastupsample=true"],
    ),
    # Region decode through nvImageCodec (where fastload's own C region decoder is not built).
    "turbo+cv2+nvimgcodec": ("turbo", ["backend.resize=cv2", "backend.roi=nvimgcodec"]),
    # Whole-image decode (simplejpeg), as before ROI decode: the same run shows what it gains.
    "turbo+cv2+noroi": ("turbo", ["backend.resize=cv2", "backend.roi=off"]),
    "turbo+cv2+fast+noroi": (
        "turbo",
        [
            "backend.resize=cv2",
            "backend.fastdct=true",
            "backend.fastupsample=true",
            "backend.roi=off",
        ],
    ),
}
DEFAULT_BACKENDS = (
    "pil,pil+draft,pillow-simd,accimage,turbo+pilresize,turbo+cv2+noroi,turbo+cv2,"
    "turbo+cv2+fast+noroi,turbo+cv2+fast"
)
# The DataLoader rows time whole warm epochs; the batches in flight at an epoch's start
# (workers x prefetch_factor) must be at most this share of an epoch for that to measure
# the pipeline rather than its start.
PREFETCH_FACTOR, EPOCH_PER_IN_FLIGHT = 2, 4


def backend_names() -> dict[str, tuple[str, list[str]]]:
    """Every name --backends accepts -> (conf/backend/ name, overrides)."""
    return {**{n: (n, []) for n in config_names("backend")}, **VARIANTS}


_JOB: dict = {}  # set before forking the pool: the children inherit it (nothing pickled)


def build(name: str):
    """Backend `name` as train.py builds it: from its yaml, through the Hydra config."""
    from hydra.errors import InstantiationException

    from fastload.pipeline import build_backend

    group, overrides = backend_names()[name]
    try:
        return build_backend(compose([f"backend={group}", *overrides]))
    except InstantiationException as exc:
        raise (user_error(exc) or exc) from None


def _run_backend(indices) -> int:
    from fastload.data.dataset import sample_rng

    backend, transform, datas = _JOB["backend"], _JOB["transform"], _JOB["datas"]
    for i in indices:
        backend.load(datas[i], transform, sample_rng(0, 0, i))
    return len(indices)


def _run_decode(indices) -> int:
    import simplejpeg

    for i in indices:
        simplejpeg.decode_jpeg(_JOB["datas"][i], colorspace="RGB")
    return len(indices)


def _run_read(indices) -> int:
    for i in indices:
        with open(_JOB["paths"][i], "rb") as f:
            f.read()
    return len(indices)


def timed(fn, n: int, workers: int, repeats: int) -> float:
    """Best images/s over `repeats` passes of fn over n items; workers > 1: a fork pool."""
    chunks = [range(k, min(n, k + 16)) for k in range(0, n, 16)]
    best = 0.0
    if workers <= 1:
        for _ in range(repeats):
            t0 = time.perf_counter()
            done = sum(fn(c) for c in chunks)
            best = max(best, done / (time.perf_counter() - t0))
        return best
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        pool.map(fn, chunks[: workers * 2])  # start-up and warm caches out of the timing
        for _ in range(repeats):
            t0 = time.perf_counter()
            done = sum(pool.map(fn, chunks, chunksize=4))
            best = max(best, done / (time.perf_counter() - t0))
    return best


def min_train_images(workers: int, batch_size: int) -> int:
    """The smallest training set whose epoch the DataLoader rows can time: an epoch of at
    least EPOCH_PER_IN_FLIGHT x the batches in flight (workers x prefetch_factor)."""
    return EPOCH_PER_IN_FLIGHT * max(1, workers) * PREFETCH_FACTOR * batch_size


def warm_epochs(run_epoch, repeats: int) -> float:
    """Best images/s of whole epochs, after one untimed epoch (worker start, page cache):
    `run_epoch(e)` iterates epoch e and returns its image count; every DataLoader row is
    measured by this one function, each epoch timed from its start to its last batch."""
    run_epoch(0)
    best = 0.0
    for e in range(1, 1 + max(1, repeats)):
        t0 = time.perf_counter()
        n = run_epoch(e)
        best = max(best, n / (time.perf_counter() - t0))
    return best


def textbook_rate(root: Path, size: int, workers: int, batch_size: int, repeats: int) -> float:
    """torchvision ImageFolder + RandomResizedCrop + flip + ToTensor + Normalize through a
    DataLoader with persistent workers (as the fastload row), whole warm epochs."""
    import torch
    import torchvision
    from torchvision import transforms as T

    from fastload.torch_internals import stop_persistent_workers

    tf = T.Compose(
        [
            T.RandomResizedCrop(size),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ]
    )
    ds = torchvision.datasets.ImageFolder(str(root / "train"), transform=tf)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=PREFETCH_FACTOR if workers > 0 else None,
        drop_last=True,
    )
    try:
        return warm_epochs(lambda e: sum(len(images) for images, _ in loader), repeats)
    finally:
        stop_persistent_workers(loader)


def fastload_loader_rate(
    root: Path, backend, size: int, workers: int, batch_size: int, repeats, cross_epoch=True
):
    """loader=baseline's host stage as training runs it (reused batch slots, persistent
    workers, epochs streamed back to back), whole warm epochs; cross_epoch=False: a new
    iteration per epoch, as the textbook row's DataLoader."""
    from fastload.bench.common import compose, data_overrides, product_loader

    cfg = compose(
        data_overrides(root, crop=size, batch_size=batch_size)
        + [f"loader.num_workers={workers}", f"loader.persistent_workers={workers > 0}"]
        + [f"loader.prefetch_factor={PREFETCH_FACTOR}", f"loader.cross_epoch={cross_epoch}"]
        # the plan's epochs: the stream runs on into every timed epoch (warm_epochs)
        + [f"trainer.epochs={1 + max(1, repeats)}"]
    )
    loader = product_loader(cfg, backend=backend)

    def run_epoch(epoch: int) -> int:
        loader.set_epoch(epoch)
        return sum(len(batch["target"]) for batch in loader.host_batches())

    try:
        return warm_epochs(run_epoch, repeats)
    finally:
        loader.close()


def nvjpeg_rates(datas: list[bytes], size: int, batch_size: int = 256) -> dict | None:
    """backend=nvjpeg's device half in images/s on the GPU, or None without CUDA: batched full
    decode alone (nvImageCodec, the same backends), and the product's path (each image decoded
    into its slot of the padded canvas, then the batched crop/resize/flip to `size`, with
    RandomResizedCrop's boxes), for the hardware decoder's default share and for the CUDA
    decoder alone (hw_load=0). The workers' fallbacks (progressive files, ...) are left out."""
    import torch

    if not torch.cuda.is_available():
        return None
    from fastload.data.transforms import RandomResizedCropFlip
    from fastload.decode.nvjpeg import NvjpegDecoder, encoded_batch

    device = torch.device("cuda", torch.cuda.current_device())
    t, rng = RandomResizedCropFlip(size), np.random.default_rng(0)
    batches = [datas[k : k + batch_size] for k in range(0, len(datas), batch_size)]
    encoded = [e for b in batches if (e := encoded_batch(b, t, [rng] * len(b))) is not None]
    # The full-decode row reads the same JPEGs: each encoded batch's bytes.
    jpegs = [np.split(e["data"].numpy(), e["offsets"][1:-1].tolist()) for e in encoded]
    images = sum(map(len, jpegs))

    def measure(hw_load: float) -> tuple[float, float]:
        dec = NvjpegDecoder(hw_load)
        nvdec, nv = dec.state(device).decoder, dec._nv
        stream = torch.cuda.current_stream(device).cuda_stream

        def full():
            for batch in jpegs:
                streams = [nv.CodeStream(d) for d in batch]
                nvdec.decode(streams, params=dec.params, cuda_stream=stream)

        def product():
            for enc in encoded:
                dec(None, enc, device)

        def rate(fn) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            return images / (time.perf_counter() - t0)

        full(), product()  # warm-up: nvImageCodec's buffers, the resize's kernels
        return max(rate(full) for _ in range(3)), max(rate(product) for _ in range(3))

    return {hw_load: measure(hw_load) for hw_load in (NvjpegDecoder().hw_load, 0.0)}


def parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m fastload.bench backends",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--root", help="dataset root holding train/ (default: the synthetic set)")
    p.add_argument(
        "--backends",
        default=DEFAULT_BACKENDS,
        help=f"comma-separated, of: {', '.join(backend_names())}",
    )
    p.add_argument("--size", type=at_least(1), default=224, help="RandomResizedCrop output size")
    p.add_argument("--workers", type=at_least(1), default=usable_cores(),
                   help="'all cores' count: processes of the pool (and DataLoader workers); "
                   "the 1-core column is the in-process figure")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=64, help="the DataLoader rows' batch")
    p.add_argument("--repeats", type=int, default=2, help="passes per figure; best is kept")
    p.add_argument("--no-loaders", action="store_true", help="skip the DataLoader rows")
    add_peer_options(p, "its row in the same run")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time the fastload DataLoader and the peers' rows this many times in turn; the "
        "targets are judged on the same-round ratios",
    )
    p.add_argument("--json", default="outputs/bench/backends.json", help="where to write JSON")
    args = p.parse_args(argv)
    args.backends = ",".join(pick_names(p, "--backends", args.backends, list(backend_names())))
    if args.batch_size < 1 or args.repeats < 1 or args.rounds < 1:
        p.error("--batch-size, --repeats and --rounds must be >= 1")
    check_root(p, args.root)
    check_output(p, "--json", args.json)
    if args.root and not args.no_loaders:
        check_loader_set(p, Path(args.root), args.workers, args.batch_size)
    return args


def check_loader_set(p, root: Path, workers: int, batch_size: int) -> None:
    """Refuse (argparse's error) a training set too small for the DataLoader rows."""
    from fastload.data.folder import index_image_folder
    from fastload.errors import DatasetError

    try:
        have = len(index_image_folder(root / "train"))
    except DatasetError as exc:
        p.error(f"--root {root}: {exc.user_message}")
    need = min_train_images(workers, batch_size)
    if have < need:
        p.error(
            f"--root {root}: {have} training images are {have // batch_size} batches of "
            f"{batch_size}; the DataLoader rows time whole warm epochs and need at least {need} "
            f"images ({need // batch_size} batches: {EPOCH_PER_IN_FLIGHT} x the "
            f"{max(1, workers)} workers x prefetch_factor {PREFETCH_FACTOR} batches in flight) "
            f"to measure more than an epoch's start. Give --root a set "
            f"of >= {need} training images, or fewer --workers, a smaller --batch-size, or "
            f"--no-loaders."
        )


def default_root(args) -> Path:
    """The synthetic set, with enough training images per class (10 classes) for the
    DataLoader rows at these --workers and --batch-size (100 per class at least)."""
    per_class = 100
    if not args.no_loaders:
        per_class = max(per_class, -(-min_train_images(args.workers, args.batch_size) // 10))
    return default_dataset(train_per_class=per_class)


def measure_backends(names: list[str], n: int, w: int, repeats: int, row):
    """One row per backend (or 'unavailable'); returns the fastest one on all cores."""
    from fastload.errors import FastloadError

    best_name, best_rate, best_backend = None, 0.0, None
    for name in names:
        try:
            backend = build(name)
        except FastloadError as exc:
            print(f"  {name}: not available ({exc.user_message.split('. ')[0]})", file=sys.stderr)
            row(f"backend={name}", "unavailable", None, None)
            continue
        if backend.device_decoder is not None:  # nothing to time on the CPU
            print(
                f"  {name}: decodes on the GPU: see the nvjpeg batched decode row", file=sys.stderr
            )
            continue
        _JOB["backend"] = backend
        one = timed(_run_backend, n, 1, repeats)
        many = timed(_run_backend, n, w, repeats)
        info = backend.info()
        row(
            f"backend={name}",
            "backend",
            one,
            many,
            decoder=info.get("decoder"),
            resize=info.get("resize"),
        )
        if many > best_rate:
            best_name, best_rate, best_backend = name, many, backend
    return best_name, best_backend


PEERS = {
    # side: (row name, the --<side>-python option's attribute)
    "ffcv": ("ffcv JPEG: RRC decoder + flip", "ffcv_python"),
    "dali": ("DALI CPU: file reader + image_random_crop + resize + flip", "dali_python"),
}


def round_order(sides: list[str], r: int) -> list[str]:
    """Round r's order: the sides rotated by r, so a drift within a round favours each in turn."""
    k = r % len(sides) if sides else 0
    return sides[k:] + sides[:k]


def floor_rate(workers: int, repeats: int) -> float:
    """The bare-decode ceiling on all cores: full-size decode of every file, nothing else."""
    return timed(_run_decode, len(_JOB["datas"]), workers, repeats)


def target_rounds(args, root: Path, best_name, best_backend, timing, row) -> list[dict]:
    """The targets' rows (the fastload DataLoader and each peer given) and the bare-decode
    ceiling the loader is judged against, each once per round, --rounds times: this
    machine's speed drifts by +-30 % over minutes, so each ratio is taken within a round
    (`print_targets`; the ceiling timed once, before the rounds, gave one ratio against the
    rounds' median). Adds the rows (their medians)."""
    w = args.workers
    sides = ["ours", "floor"] if not args.no_loaders and best_backend is not None else []
    sides += [side for side, (_, option) in PEERS.items() if getattr(args, option, None)]
    runners = {"ffcv": run_ffcv, "dali": run_dali}
    rounds = []
    for r in range(args.rounds):
        got = {}
        for side in round_order(sides, r):
            if side == "ours":
                got["ours"] = fastload_loader_rate(root, best_backend, *timing)
            elif side == "floor":
                got["floor"] = floor_rate(w, args.repeats)
            else:
                python = getattr(args, PEERS[side][1])
                # the same batch and, like the rows beside them, the best of --repeats
                # timed epochs after an untimed one
                got[side] = runners[side](
                    python, root, args.size, w, "--epochs", str(1 + args.repeats),
                    "--batch-size", str(args.batch_size), timeout=900,
                )  # fmt: skip
        if args.rounds > 1:
            shown = {k: v if k in ("ours", "floor") else v.get("images_per_s")
                     for k, v in got.items()}  # fmt: skip
            print(f"  round {r + 1}: {shown}", file=sys.stderr)
        rounds.append(got)
    mine = [g["ours"] for g in rounds if g.get("ours")]
    if mine:
        name = f"fastload DataLoader, backend={best_name}"
        row(name, "loader", None, statistics.median(mine), rounds_img_s=mine)
    for side, (name, _) in PEERS.items():
        theirs = [g[side].get("images_per_s") for g in rounds if side in g]
        if theirs:
            measured = [t for t in theirs if t]  # a failed peer run has no figure
            rate = statistics.median(measured) if measured else None
            row(name, "loader", None, rate, **{side: rounds[-1][side]}, rounds_img_s=theirs)
    return rounds


def print_targets(rounds: list[dict]) -> dict:
    """The fastload DataLoader vs each peer (ahead in every round) and vs the bare-decode
    ceiling (>= 0.95), on same-round ratios."""
    targets = {}
    for side, (name, _) in PEERS.items():
        both = [g for g in rounds if g.get("ours") and g.get(side, {}).get("images_per_s")]
        if not both:
            continue
        theirs = [g[side]["images_per_s"] for g in both]
        t = same_round_target([g["ours"] for g in both], theirs, 1.0)
        t["met"] = min(t["ratios"]) >= 1.0  # ahead in every round, not on the median
        targets[side] = t
        print(
            f"target: fastload DataLoader vs {name.split(':')[0]} (every round): {target_text(t)}"
        )
    both = [g for g in rounds if g.get("ours") and g.get("floor")]
    if both:
        t = same_round_target([g["ours"] for g in both], [g["floor"] for g in both], 0.95)
        targets["bare_decode"] = t
        print(f"target: fastload DataLoader vs bare full decode: {target_text(t)}")
    for side, (name, _) in PEERS.items():
        errors = [g[side]["error"] for g in rounds if "error" in g.get(side, {})]
        if errors:
            print(f"{name.split(':')[0]} failed: {errors[-1]}", file=sys.stderr)
    return targets


def train_jpegs(root: Path) -> tuple[list[str], int]:
    """The JPEGs of ROOT/train as the DataLoader rows index them (fastload's ImageFolder
    index: the same files, in its order), and how many other images it holds. The decode
    rows time these, so their ratios compare one set of files; validation images are
    neither read nor timed."""
    from fastload.data.folder import index_image_folder

    index = index_image_folder(root / "train")
    paths = [str(index.path(i)) for i in range(len(index))]
    jpegs = [p for p in paths if p.lower().endswith((".jpg", ".jpeg"))]
    return jpegs, len(paths) - len(jpegs)


def main(argv: list[str]) -> int:
    args = parse(argv)
    from fastload.data.transforms import RandomResizedCropFlip
    from fastload.errors import DatasetError

    root = Path(args.root) if args.root else default_root(args)
    paths, others = train_jpegs(root)
    if not paths:
        raise DatasetError(f"--root {root}: no JPEG file in train/; the decode rows time JPEGs.")
    datas = [Path(f).read_bytes() for f in paths]
    n, w = len(datas), args.workers
    _JOB.update(paths=paths, datas=datas, transform=RandomResizedCropFlip(args.size))
    left_out = (
        f" ({others} other images there left out: simplejpeg decodes JPEGs)" if others else ""
    )
    print(
        f"{n} JPEGs of {root}/train, the files the DataLoader rows load{left_out} (mean "
        f"{np.mean([len(d) for d in datas]) / 1024:.0f} KiB), decode + RandomResizedCrop("
        f"{args.size}) + flip; all cores = {w} processes",
        file=sys.stderr,
    )

    rows = []

    def row(name, kind, one, many, **extra):
        rows.append(
            {"pipeline": name, "kind": kind, "1 core img/s": one, f"{w} cores img/s": many, **extra}
        )
        if kind != "unavailable":
            print(f"  {name}: {one or 0:,.0f} / {many or 0:,.0f} img/s", file=sys.stderr)

    row("read bytes", "ceiling", timed(_run_read, n, 1, 1), timed(_run_read, n, w, 1))
    row(
        "bare full decode (simplejpeg)",
        "ceiling",
        timed(_run_decode, n, 1, args.repeats),
        timed(_run_decode, n, w, args.repeats),
    )
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    best_name, best_backend = measure_backends(names, n, w, args.repeats, row)
    gpu = nvjpeg_rates(datas, args.size)
    for hw_load, (full, product) in (gpu or {}).items():
        how = f"hardware decoder {hw_load:g} of each batch" if hw_load else "CUDA decoder only"
        row(f"nvjpeg batched full decode (GPU, {how})", "gpu", None, full)
        row(
            f"backend=nvjpeg: decode + batched crop/resize to {args.size} (GPU, {how})",
            "gpu", None, product, vs_full_decode=product / full,
        )  # fmt: skip
    timing = (args.size, w, args.batch_size, args.repeats)
    if not args.no_loaders:
        rate = textbook_rate(root, *timing)
        row("textbook: ImageFolder+ToTensor+Normalize", "loader", None, rate)
    rounds = target_rounds(args, root, best_name, best_backend, timing, row)
    if rounds and not args.no_loaders and best_backend is not None:
        rate = fastload_loader_rate(root, best_backend, *timing, cross_epoch=False)
        row(f"fastload DataLoader, backend={best_name}, a new iteration per epoch (timed once)",
            "loader", None, rate)  # fmt: skip

    ref = next((r for r in rows if r["pipeline"].startswith("textbook")), None)
    for r in rows:
        rate = r.get(f"{w} cores img/s")
        if ref and rate and ref.get(f"{w} cores img/s"):
            r["x textbook"] = rate / ref[f"{w} cores img/s"]
    columns = ["pipeline", "1 core img/s", f"{w} cores img/s", "x textbook"]
    print(format_table(rows, columns))
    target = print_targets(rounds)
    for hw_load, (full, product) in (gpu or {}).items():
        ratio = product / full
        verdict = "met" if ratio >= 0.85 else "NOT met"
        print(f"target: backend=nvjpeg decode + crop >= 0.85 of full decode alone (hw_load="
              f"{hw_load:g}): {ratio:.2f} ({verdict})")  # fmt: skip
    params = {**vars(args), "images": n, "root": str(root), "machine_note": machine()["cpu"]}
    params["target"] = target
    print(f"wrote {write_json(args.json, 'backends', params, rows)}", file=sys.stderr)
    return 0
