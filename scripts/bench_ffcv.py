"""FFCV's JPEG pipeline on the same files, for `python -m fastload.bench backends --ffcv-python`.

NEEDS ITS OWN ENVIRONMENT with ffcv (not a fastload dependency; nothing of ffcv is vendored):
  apt-get install libturbojpeg0-dev libopencv-dev pkg-config
  python3.11 -m venv /work/ffcv-venv
  # torch/torchvision: install them, or reuse another venv's with a .pth file naming its
  # site-packages, e.g. echo /path/to/.venv/lib/python3.11/site-packages > \\
  #   /work/ffcv-venv/lib/python3.11/site-packages/zz_torch.pth
  /work/ffcv-venv/bin/pip install numba opencv-python-headless ffcv==1.0.2
  /work/ffcv-venv/bin/python scripts/bench_ffcv.py --root ~/.cache/fastload/synthetic-...

Writes ROOT/train into a .beton (JPEG mode, quality 90, max side 512: the files are ~450 px,
so nothing is resized), then times RandomResizedCropRGBImageDecoder(size) + flip + ToTensor
through ffcv's Loader with --workers threads, batch --batch-size (64). The first epoch (numba JIT) is not
timed. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from peer_timing import exit_missing, report, time_epochs


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--root", required=True)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--beton", help="reuse/write this .beton (default: a temp file)")
    p.add_argument(
        "--write-mode",
        default="jpg",
        choices=["jpg", "raw"],
        help="raw: decoded pixels (FFCV's no-decode format, compare with shards-raw)",
    )
    p.add_argument("--max-resolution", type=int, default=512)
    args = p.parse_args()

    try:
        import torchvision
        from ffcv.fields import IntField, RGBImageField
        from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
        from ffcv.loader import Loader, OrderOption
        from ffcv.transforms import RandomHorizontalFlip, ToTensor
        from ffcv.writer import DatasetWriter
    except ModuleNotFoundError as exc:
        exit_missing(exc, "ffcv", "apt-get install libturbojpeg0-dev libopencv-dev pkg-config; "
                     "python3.11 -m venv /work/ffcv-venv; its pip install numba "
                     "opencv-python-headless ffcv==1.0.2; torch and torchvision")  # fmt: skip

    beton = args.beton or os.path.join(tempfile.mkdtemp(prefix="ffcv-bench-"), "train.beton")
    if not os.path.exists(beton):
        ds = torchvision.datasets.ImageFolder(os.path.join(args.root, "train"))
        writer = DatasetWriter(
            beton,
            {
                "image": RGBImageField(
                    write_mode=args.write_mode,
                    max_resolution=args.max_resolution,
                    jpeg_quality=90,
                ),
                "label": IntField(),
            },
            num_workers=args.workers,
        )
        writer.from_indexed_dataset(ds)
    loader = Loader(
        beton,
        batch_size=args.batch_size,
        num_workers=args.workers,
        order=OrderOption.RANDOM,
        drop_last=True,
        os_cache=True,
        pipelines={
            "image": [
                RandomResizedCropRGBImageDecoder((args.size, args.size)),
                RandomHorizontalFlip(),
                ToTensor(),
            ],
            "label": [IntDecoder(), ToTensor()],
        },
    )
    # epoch 0 compiles the pipeline with numba: not timed
    rates = time_epochs(lambda: sum(len(images) for images, _ in loader), args.epochs)
    report(
        rates,
        workers=args.workers,
        write_mode=args.write_mode,
        max_resolution=args.max_resolution,
        beton_bytes=os.path.getsize(beton),
    )


if __name__ == "__main__":
    main()
