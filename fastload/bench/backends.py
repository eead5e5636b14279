"""python -m fastload.bench backends: decode + RandomResizedCrop(224) + flip, per backend.

For every backend that can start here: images/s on one core (an in-process loop over the
bytes already in memory) and on all usable cores (a fork pool, one process per core). Beside
them, measured in the same run on the same files:

* ceiling "read bytes": reading the files (page cache), nothing else;
* ceiling "bare decode": full-size decode with the fastest decoder (simplejpeg), no crop;
* "textbook": torchvision ImageFolder + RandomResizedCrop(224) + RandomHorizontalFlip +
  ToTensor + Normalize through a DataLoader (usable-cores workers, batch 64);
* "fastload loader": the same DataLoader setup with fastload's dataset + the best CPU
  backend of this run + uint8 collate (what a training run feeds the GPU with);
* optionally FFCV's JPEG pipeline (--ffcv-python: an environment with ffcv installed, see
  scripts/bench_ffcv.py), and nvJPEG batched decode when CUDA is available.

The default dataset is the synthetic ImageNet-style set (1,250 photo-like JPEGs, ~450 px).
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np

from fastload.bench.common import (
    default_dataset,
    format_table,
    machine,
    run_ffcv,
    write_json,
)
from fastload.host import usable_cores

# name -> (import path, kwargs); those that cannot start here are reported and skipped.
BACKENDS = {
    "pil": ("fastload.decode.pil.PILBackend", {}),
    "pil+draft": ("fastload.decode.pil.PILBackend", {"draft": True}),
    "pillow-simd": ("fastload.decode.pillow_simd.PillowSIMDBackend", {}),
    "accimage": ("fastload.decode.accimage.AccimageBackend", {}),
    "turbo+pilresize": ("fastload.decode.turbo.TurboBackend", {"resize": "pil"}),
    "turbo+cv2": ("fastload.decode.turbo.TurboBackend", {"resize": "cv2"}),
    "turbo+cv2+fast": (
        "fastload.decode.turbo.TurboBackend",
        {"resize": "cv2", "fastdct": True, "fastupsample": True},
    ),
}

_JOB: dict = {}  # set before forking the pool: the children inherit it (nothing pickled)


def build(name: str):
    from hydra.utils import get_class

    target, kwargs = BACKENDS[name]
    return get_class(target)(**kwargs)


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


def loader_rate(dataset, collate_fn, workers: int, batch_size: int = 64, epochs: int = 2):
    """Steady images/s of a DataLoader: the last epoch, from its first batch to its end."""
    import torch

    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        collate_fn=collate_fn,
        persistent_workers=workers > 0,
        drop_last=True,
    )
    rate = 0.0
    for _ in range(epochs):
        n, t0 = 0, None
        for batch in loader:
            if t0 is None:
                t0 = time.perf_counter()
                continue
            image = batch["image"] if isinstance(batch, dict) else batch[0]
            n += len(image)
        rate = n / (time.perf_counter() - t0) if t0 and n else 0.0
    return rate


def textbook_rate(root: Path, size: int, workers: int) -> float:
    import torchvision
    from torchvision import transforms as T

    tf = T.Compose(
        [
            T.RandomResizedCrop(size),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ]
    )
    ds = torchvision.datasets.ImageFolder(str(root / "train"), transform=tf)
    return loader_rate(ds, None, workers)


def fastload_loader_rate(root: Path, backend, size: int, workers: int) -> float:
    """Steady images/s of loader=baseline's host stage (reused batch slots, persistent
    workers), measured as loader_rate measures the textbook pipeline: the second of two
    epochs, from its first batch to its end."""
    from fastload.bench.common import compose, data_overrides, host_epoch, product_loader

    cfg = compose(
        data_overrides(root, crop=size)
        + [f"loader.num_workers={workers}", f"loader.persistent_workers={workers > 0}"]
        + ["loader.cross_epoch=false"]  # per-epoch iteration, as loader_rate's textbook row
    )
    loader = product_loader(cfg, backend=backend)
    try:
        host_epoch(loader, 0)
        return host_epoch(loader, 1)["steady_img_s"] or 0.0
    finally:
        loader.close()


def nvjpeg_rate(datas: list[bytes], batch_size: int = 64) -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    from torchvision.io import ImageReadMode, decode_jpeg

    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
    batches = [tensors[k : k + batch_size] for k in range(0, len(tensors), batch_size)]
    decode_jpeg(batches[0], mode=ImageReadMode.RGB, device="cuda")  # nvJPEG handles, warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in batches:
        decode_jpeg(b, mode=ImageReadMode.RGB, device="cuda")
    torch.cuda.synchronize()
    return len(tensors) / (time.perf_counter() - t0)


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m fastload.bench backends", description=__doc__)
    p.add_argument("--root", help="dataset root (default: the synthetic default set)")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated subset")
    p.add_argument("--size", type=int, default=224, help="RandomResizedCrop output size")
    p.add_argument("--workers", type=int, default=usable_cores(), help="'all cores' count")
    p.add_argument("--repeats", type=int, default=2, help="passes per figure; best is kept")
    p.add_argument("--no-loaders", action="store_true", help="skip the DataLoader rows")
    p.add_argument("--ffcv-python", help="python of an env with ffcv (scripts/bench_ffcv.py)")
    p.add_argument("--json", default="bench-results/backends.json", help="where to write JSON")
    return p.parse_args(argv)


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


def main(argv: list[str]) -> int:
    args = parse(argv)
    from fastload.data.transforms import RandomResizedCropFlip

    root = Path(args.root) if args.root else default_dataset()
    paths = sorted(str(f) for f in root.rglob("*") if f.suffix.lower() in (".jpg", ".jpeg"))
    datas = [Path(f).read_bytes() for f in paths]
    n, w = len(datas), args.workers
    _JOB.update(paths=paths, datas=datas, transform=RandomResizedCropFlip(args.size))
    print(
        f"{n} JPEGs from {root} (mean {np.mean([len(d) for d in datas]) / 1024:.0f} KiB), "
        f"decode + RandomResizedCrop({args.size}) + flip; all cores = {w} processes",
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
    gpu = nvjpeg_rate(datas)
    if gpu is not None:
        row("nvjpeg batched decode (GPU, full size)", "gpu", None, gpu)
    if not args.no_loaders:
        row(
            "textbook: ImageFolder+ToTensor+Normalize",
            "loader",
            None,
            textbook_rate(root, args.size, w),
        )
        if best_backend is not None:
            rate = fastload_loader_rate(root, best_backend, args.size, w)
            row(f"fastload DataLoader, backend={best_name}", "loader", None, rate)
    if args.ffcv_python:
        res = run_ffcv(args.ffcv_python, root, args.size, w, timeout=900)
        row("ffcv JPEG: RRC decoder + flip", "loader", None, res.get("images_per_s"), ffcv=res)

    ref = next((r for r in rows if r["pipeline"].startswith("textbook")), None)
    for r in rows:
        rate = r.get(f"{w} cores img/s")
        if ref and rate and ref.get(f"{w} cores img/s"):
            r["x textbook"] = rate / ref[f"{w} cores img/s"]
    columns = ["pipeline", "1 core img/s", f"{w} cores img/s", "x textbook"]
    print(format_table(rows, columns))
    params = {**vars(args), "images": n, "root": str(root), "machine_note": machine()["cpu"]}
    print(f"wrote {write_json(args.json, 'backends', params, rows)}", file=sys.stderr)
    return 0
