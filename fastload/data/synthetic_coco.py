"""Synthetic COCO: the built-in default of dataset=coco, generated on first use.

`ensure_synthetic_coco(root)` writes, in the COCO 2017 layout (CocoLayout's defaults):

    root/train/*.jpg  root/val/*.jpg
    root/annotations/instances_train.json  root/annotations/instances_val.json

Images reuse the synthetic ImageNet renderer's photograph-like backgrounds and camera
(fastload/data/synthetic.py); on them sit 1-4 non-overlapping objects, each of one category
with its own shape, palette and texture (the ImageNet generator's class signatures), so a
small detector can tell the categories apart. Every box is the tight box of the object's
drawn pixels. Category ids are not contiguous (1, 3, 7, ...), as in real COCO, so the label
mapping is exercised.

Every run also meets the bad input real annotation files hold: each split has one crowd
annotation and one image without any object, the training split also a zero-width box and a
box wholly outside its image. They are dropped and counted (fastload/data/sources.py, the
epoch row), never trained; COCOeval treats the crowd region of val as an ignore region.

Every image is a pure function of (seed, split, index); the folder is written into a temp
sibling renamed into place when complete (fastload/atomic.py), recognised afterwards by its
manifest, and a folder that is not ours is never written into.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from fastload.data.generated import Generated, require_whole_numbers, run_tasks
from fastload.data.synthetic import (
    _PALETTES,
    _background,
    _camera,
    _hsv_to_rgb,
    _image_size,
    _shape_sdf,
    _texture_mix,
    class_signature,
)
from fastload.errors import ConfigError

MANIFEST_NAME = "fastload-synthetic-coco.json"
_GENERATOR = "fastload-synthetic-coco"
GENERATOR_VERSION = 1  # bump when the drawing changes: an old cache is then refused, not mixed
SPLITS = ("train", "val")
# Non-contiguous like COCO's (1..90 for 80 categories): a model must map them to 1..K.
CATEGORY_IDS = (1, 3, 7, 8, 11, 14, 18, 22, 27, 31, 35, 40)


def category_names(n: int) -> list[str]:
    from fastload.data.synthetic import class_names

    return [name.split("_", 1)[1] for name in class_names(n)]


def _place(rng, w: int, h: int, taken: list) -> tuple[float, float, float] | None:
    """(cx, cy, radius) of a new object whose square extent overlaps none in `taken`."""
    short = min(w, h)
    for _ in range(20):
        r = rng.uniform(0.12, 0.24) * short
        cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
        if all(abs(cx - x) > 1.3 * (r + q) or abs(cy - y) > 1.3 * (r + q) for x, y, q in taken):
            return cx, cy, r
    return None


def _draw_object(img: np.ndarray, rng, category: int, cx: float, cy: float, radius: float):
    """Draw one object of `category` in place; returns its tight [x, y, w, h] box (the
    pixels at least half covered), or None when nothing visible was drawn."""
    h, w = img.shape[:2]
    shape, palette, texture = class_signature(category)
    _, prim_hsv, sec_hsv = _PALETTES[palette]
    dh = rng.normal(0, 0.015)
    prim = _hsv_to_rgb(prim_hsv[0] + dh, prim_hsv[1], prim_hsv[2] * rng.uniform(0.85, 1.05))
    sec = _hsv_to_rgb(sec_hsv[0] + dh, sec_hsv[1], sec_hsv[2] * rng.uniform(0.85, 1.05))
    rot, stretch = rng.uniform(0, 2 * math.pi), rng.uniform(0.85, 1.2)
    sx, sy = radius * stretch, radius / stretch
    ext = 1.2 * max(sx, sy) + 3
    x0, x1 = max(0, int(cx - ext)), min(w, int(cx + ext) + 1)
    y0, y1 = max(0, int(cy - ext)), min(h, int(cy + ext) + 1)
    px = np.arange(x0, x1, dtype=np.float32)[None, :] + (0.5 - cx)
    py = np.arange(y0, y1, dtype=np.float32)[:, None] + (0.5 - cy)
    cr, sr = math.cos(rot), math.sin(rot)
    u, v = (px * cr + py * sr) / sx, (py * cr - px * sr) / sy
    alpha = np.clip(0.5 - _shape_sdf(shape, u, v) * radius / 1.2, 0, 1)
    t = _texture_mix(texture, u, v, rng.uniform(2.5, 4.0))
    shade = alpha * (1.0 + 0.2 * (px / radius) - 0.1 * (px * px + py * py) / radius**2)
    patch = img[y0:y1, x0:x1]
    patch *= (1 - alpha)[..., None]
    patch += prim * shade[..., None] + (sec - prim) * (shade * t)[..., None]
    ys, xs = np.nonzero(alpha >= 0.5)
    if not len(xs):
        return None
    bx, by = x0 + int(xs.min()), y0 + int(ys.min())
    return [bx, by, x0 + int(xs.max()) + 1 - bx, y0 + int(ys.max()) + 1 - by]


def render_scene(seed: int, split: int, index: int, num_categories: int, sizes, empty: bool):
    """(PIL image, [(category index, [x, y, w, h]), ...]) of one image, a pure function of
    its arguments; `empty`: background only."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 7919, split, index]))
    w, h = _image_size(rng, *sizes)
    img = _background(rng, w, h)
    objects, taken = [], []
    for _ in range(0 if empty else int(rng.integers(1, 5))):
        spot = _place(rng, w, h, taken)
        if spot is None:
            continue
        taken.append(spot)
        k = int(rng.integers(num_categories))
        box = _draw_object(img, rng, k, *spot)
        if box is not None:
            objects.append((k, box))
    return _camera(img, rng), objects


def _write_one(task: tuple) -> dict:
    """Worker: render and save one image; returns its COCO image entry and objects."""
    path, seed, split, index, num_categories, sizes, quality, empty = task
    image, objects = render_scene(seed, split, index, num_categories, sizes, empty)
    image.save(path, "JPEG", quality=quality, subsampling=2)
    return {"file_name": os.path.basename(path), "width": image.width,
            "height": image.height, "objects": objects}  # fmt: skip


def _annotation(ann_id: int, image_id: int, category_id: int, box, crowd: int = 0) -> dict:
    x, y, w, h = (float(v) for v in box)
    return {"id": ann_id, "image_id": image_id, "category_id": category_id, "bbox": [x, y, w, h],
            "area": max(0.0, w) * max(0.0, h), "iscrowd": crowd,
            "segmentation": [[x, y, x + w, y, x + w, y + h, x, y + h]]}  # fmt: skip


def instances(entries: list[dict], num_categories: int, degenerate: bool) -> dict:
    """The COCO instances dict of one split's rendered images, plus one crowd region and,
    with `degenerate`, a zero-width box and a box outside its image. Validation gets no
    degenerate boxes: COCOeval would count them as objects nobody can find (the real val2017
    has none), so a perfect detector would score below 100."""
    images, anns = [], []
    for i, e in enumerate(entries):
        image_id = 1000 + 3 * i  # not 0..n-1 either: ids are looked up, never used as positions
        images.append({"id": image_id, "file_name": e["file_name"], "width": e["width"],
                       "height": e["height"]})  # fmt: skip
        for k, box in e["objects"]:
            anns.append(_annotation(len(anns) + 1, image_id, CATEGORY_IDS[k], box))
    first = next(im for im, e in zip(images, entries, strict=True) if e["objects"])
    cat = CATEGORY_IDS[0]
    w, h = first["width"], first["height"]
    anns.append(_annotation(len(anns) + 1, first["id"], cat, [0, 0, w / 2, h / 2], crowd=1))
    if degenerate:
        anns.append(_annotation(len(anns) + 1, first["id"], cat, [5, 5, 0, 10]))  # zero width
        anns.append(_annotation(len(anns) + 1, first["id"], cat, [w + 10, 5, 20, 20]))  # outside
    cats = [{"id": CATEGORY_IDS[k], "name": n, "supercategory": "shape"}
            for k, n in enumerate(category_names(num_categories))]  # fmt: skip
    info = {"description": "fastload synthetic COCO", "version": str(GENERATOR_VERSION)}
    return {"info": info, "images": images, "annotations": anns, "categories": cats}


def _params(**kw) -> dict:
    return {"generator": _GENERATOR, "version": GENERATOR_VERSION, **kw}


GENERATED = Generated(
    MANIFEST_NAME,
    "synthetic COCO",
    "Pass dataset.root=<a new or empty folder>. To train on a real COCO in {root}, use "
    "dataset=coco2017 dataset.root={root}.",
)


def _validate(num_categories, train_images, val_images, sizes, quality) -> None:
    if not 1 <= num_categories <= len(CATEGORY_IDS):
        raise ConfigError(f"dataset.num_classes={num_categories}: the synthetic COCO "
                          f"draws 1..{len(CATEGORY_IDS)} categories.")  # fmt: skip
    if train_images < 2 or val_images < 2:
        raise ConfigError(f"dataset.prepare.train_images={train_images}, val_images="
                          f"{val_images}: need at least 2 each (one is left empty).")  # fmt: skip
    if not 64 <= sizes[0] <= sizes[1]:
        raise ConfigError(f"dataset.prepare.min_long_side={sizes[0]}, max_long_side={sizes[1]}:"
                          f" need 64 <= min_long_side <= max_long_side.")  # fmt: skip
    if not 1 <= quality <= 100:
        raise ConfigError(f"dataset.prepare.quality={quality} must be in 1..100.")


def ensure_synthetic_coco(
    root,
    *,
    num_categories: int = 3,
    train_images: int = 256,
    val_images: int = 64,
    seed: int = 0,
    min_long_side: int = 160,
    max_long_side: int = 224,
    quality: int = 90,
    workers: int | None = None,
    progress: bool = True,
) -> Path:
    """Generate the synthetic COCO into `root` unless it is there already; returns root."""
    require_whole_numbers("synthetic COCO", num_categories=num_categories,
                          train_images=train_images, val_images=val_images, seed=seed,
                          min_long_side=min_long_side, max_long_side=max_long_side,
                          quality=quality)  # fmt: skip
    sizes = (int(min_long_side), int(max_long_side))
    _validate(num_categories, train_images, val_images, sizes, quality)
    params = _params(num_categories=int(num_categories), train_images=int(train_images),
                     val_images=int(val_images), seed=int(seed), min_long_side=sizes[0],
                     max_long_side=sizes[1], quality=int(quality))  # fmt: skip
    return GENERATED.ensure(
        root, params, lambda tmp: {"splits": _generate(tmp, params, workers, progress)}
    )


def _generate(tmp: Path, p: dict, workers: int | None, progress: bool) -> dict:
    """Both splits' images and instances files under tmp; returns images per split."""
    (tmp / "annotations").mkdir()
    counts = {}
    sizes = (p["min_long_side"], p["max_long_side"])
    for split_id, split in enumerate(SPLITS):
        n = p[f"{split}_images"]
        (tmp / split).mkdir()
        tasks = [(str(tmp / split / f"{i:06d}.jpg"), p["seed"], split_id, i,
                  p["num_categories"], sizes, p["quality"], i == n - 1)  # the last: no object
                 for i in range(n)]  # fmt: skip
        entries = run_tasks(_write_one, tasks, workers, progress, f"synthetic COCO {split}", "img")
        coco = instances(entries, p["num_categories"], degenerate=split == "train")
        (tmp / "annotations" / f"instances_{split}.json").write_text(json.dumps(coco))
        counts[split] = n
    return counts
