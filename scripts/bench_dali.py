"""NVIDIA DALI's CPU pipeline on the same files, for `python -m fastload.bench backends
--dali-python` and `python -m fastload.bench storage --dali-python`.

NEEDS ITS OWN ENVIRONMENT with DALI (not a fastload dependency; nothing of DALI is vendored):
  python3.11 -m venv /work/dali-venv
  /work/dali-venv/bin/pip install nvidia-dali-cuda120 numpy pillow   # or -cuda130
  /work/dali-venv/bin/python scripts/bench_dali.py --root ~/.cache/fastload/synthetic-...
DALI's CPU operators run without a GPU or driver (`device_id=None`).

What it times, per mode (batch --batch-size (64), `num_threads` = --workers, the cores this
process may use by default; random shuffle; the first epoch untimed: thread start-up, buffer
growth; then whole epochs of the reader, images/s of the best):

* jpg (the fastload DataLoader row's work, DALI's way): `fn.readers.file` over ROOT/train ->
  `fn.decoders.image_random_crop(device="cpu")` (libjpeg-turbo; decodes only the crop
  region; area U(0.08, 1), aspect ratio 3/4-4/3 log-uniform, as RandomResizedCrop) ->
  `fn.resize` to size x size (linear, antialiased) -> `fn.flip(horizontal=coin flip)`:
  uint8 HWC batches in host memory. fastload's row also stops at uint8 batches (CHW, in
  shared memory); neither normalises.
* raw (beside FFCV's raw write mode and fastload's shards-raw): every image decoded once,
  its longer side capped at --max-resolution as FFCV's raw .beton does, saved as one .npy
  file each (a temp folder, or --npy-dir, reused); then `fn.readers.numpy` ->
  `fn.random_resized_crop` -> `fn.flip`, the same output. The difference from the other two
  raw rows: DALI reads one file per sample (page cache), they read one packed file.

Prints one JSON line last (the keys scripts/bench_ffcv.py prints, and DALI's version).
"""

from __future__ import annotations

import argparse
import os
import tempfile

from peer_timing import exit_missing, report, time_epochs


def jpeg_pipeline(fn, types, files: str, size: int, batch: int, threads: int):
    jpegs, labels = fn.readers.file(file_root=files, random_shuffle=True, name="Reader")
    images = fn.decoders.image_random_crop(
        jpegs,
        device="cpu",
        output_type=types.RGB,
        random_area=[0.08, 1.0],
        random_aspect_ratio=[3 / 4, 4 / 3],
        num_attempts=10,
    )
    images = fn.resize(images, resize_x=size, resize_y=size, interp_type=types.INTERP_LINEAR)
    return fn.flip(images, horizontal=fn.random.coin_flip()), labels


def raw_pipeline(fn, types, npy_dir: str, size: int, batch: int, threads: int):
    pixels = fn.readers.numpy(file_root=npy_dir, random_shuffle=True, name="Reader")
    images = fn.random_resized_crop(
        pixels,
        size=[size, size],
        random_area=[0.08, 1.0],
        random_aspect_ratio=[3 / 4, 4 / 3],
        interp_type=types.INTERP_LINEAR,
    )
    return fn.flip(images, horizontal=fn.random.coin_flip())


def write_npy(root: str, npy_dir: str, max_resolution: int) -> int:
    """ROOT/train's images decoded, longer side capped, one .npy each (kept when present)."""
    import numpy as np
    from PIL import Image

    os.makedirs(npy_dir, exist_ok=True)
    written = 0
    train = os.path.join(root, "train")
    for cls in sorted(os.listdir(train)):
        for name in sorted(os.listdir(os.path.join(train, cls))):
            out = os.path.join(npy_dir, f"{cls}-{os.path.splitext(name)[0]}.npy")
            if not os.path.exists(out):
                img = Image.open(os.path.join(train, cls, name)).convert("RGB")
                img.thumbnail((max_resolution, max_resolution))
                np.save(out, np.asarray(img))
            written += 1
    return written


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--root", required=True)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--write-mode", default="jpg", choices=["jpg", "raw"])
    p.add_argument("--max-resolution", type=int, default=256, help="raw mode's longer side")
    p.add_argument("--npy-dir", help="raw mode: reuse/write the .npy files here")
    args = p.parse_args()
    if args.epochs < 2:
        p.error("--epochs must be >= 2: the first epoch is not timed")

    try:
        import nvidia.dali
        import nvidia.dali.fn as fn
        import nvidia.dali.types as types
        from nvidia.dali import pipeline_def
    except ModuleNotFoundError as exc:
        exit_missing(exc, "NVIDIA DALI", "python3.11 -m venv /work/dali-venv; its pip install "
                     "nvidia-dali-cuda120 numpy pillow")  # fmt: skip

    if args.write_mode == "raw":
        source = args.npy_dir or tempfile.mkdtemp(prefix="dali-bench-npy-")
        write_npy(args.root, source, args.max_resolution)
        build = raw_pipeline
    else:
        source = os.path.join(args.root, "train")
        build = jpeg_pipeline

    @pipeline_def(
        batch_size=args.batch_size,
        num_threads=args.workers,
        device_id=None,  # CPU only: no GPU, no driver needed
        prefetch_queue_depth=2,
        seed=0,
    )
    def pipe():
        return build(fn, types, source, args.size, args.batch_size, args.workers)

    pipeline = pipe()
    pipeline.build()
    epoch_size = pipeline.epoch_size("Reader")
    batches = -(-epoch_size // args.batch_size)  # the last one wraps into the next epoch
    rates = time_epochs(lambda: sum(len(pipeline.run()[0]) for _ in range(batches)), args.epochs)
    report(
        rates,
        workers=args.workers,
        write_mode=args.write_mode,
        max_resolution=args.max_resolution if args.write_mode == "raw" else None,
        images_per_epoch=epoch_size,
        dali=nvidia.dali.__version__,
    )


if __name__ == "__main__":
    main()
