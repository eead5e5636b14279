"""Synthetic ImageNet-style dataset: the app's built-in default, generated on first use.

`ensure_synthetic_imagenet(root)` writes `root/{train,val}/<class>/*.jpg` in torchvision's
ImageFolder layout. Images are photo-like on purpose (sizes, aspect ratios, JPEG q90 4:2:0,
smooth backgrounds, shaded soft-edged objects, blur and grain) so that decode and augmentation
costs match a real ImageNet subset; a benchmark on noise or flat colour would lie about both.

Every image is a pure function of (seed, split, class, index), so the dataset is byte-identical
whatever the worker count. Each class has a signature that survives RandomResizedCrop and
flips: a shape family, a two-colour palette and a surface texture; everything else (count,
position, size, rotation, hue jitter, background, lighting) varies within the class.
"""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter

from fastload.data.generated import Generated, require_whole_numbers, run_tasks
from fastload.errors import ConfigError

MANIFEST_NAME = "fastload-synthetic.json"
_GENERATOR = "fastload-synthetic-imagenet"
# Bump when the renderer changes: an old cache then fails the parameter check loudly instead
# of silently mixing with images a new version would draw differently.
# History: 1 = first renderer; 2 = 1/4-res background canvas (3x faster, less colour noise),
# textures on the first classes too.
GENERATOR_VERSION = 2
SPLITS = ("train", "val")

# Aspect ratios (width, height) of common cameras and crops, both orientations.
_ASPECTS = ((4, 3), (3, 4), (3, 2), (2, 3), (1, 1), (16, 9), (9, 16), (5, 4), (4, 5))

# --------------------------------------------------------------------------------------------
# Class signatures: shape family x palette x texture.
# --------------------------------------------------------------------------------------------

_SHAPES = (
    "discs",
    "squares",
    "triangles",
    "stars",
    "rings",
    "crosses",
    "hexagons",
    "crescents",
    "diamonds",
    "flowers",
    "bars",
    "keyholes",
)

# (name, primary HSV, secondary HSV): primaries spread round the hue circle and each secondary
# contrasts with its primary in hue or value, so two palettes rarely look alike even after hue
# jitter.
_PALETTES = (
    ("crimson", (0.985, 0.85, 0.80), (0.12, 0.15, 0.95)),
    ("orange", (0.070, 0.90, 0.95), (0.06, 0.70, 0.30)),
    ("gold", (0.135, 0.85, 0.92), (0.00, 0.00, 0.10)),
    ("lime", (0.230, 0.80, 0.85), (0.80, 0.55, 0.50)),
    ("green", (0.360, 0.80, 0.55), (0.00, 0.00, 0.95)),
    ("teal", (0.480, 0.80, 0.60), (0.08, 0.80, 0.92)),
    ("sky", (0.550, 0.60, 0.95), (0.63, 0.80, 0.30)),
    ("blue", (0.625, 0.85, 0.75), (0.15, 0.80, 0.95)),
    ("violet", (0.760, 0.70, 0.70), (0.25, 0.60, 0.85)),
    ("magenta", (0.865, 0.80, 0.85), (0.50, 0.50, 0.90)),
    ("pink", (0.940, 0.45, 0.98), (0.00, 0.00, 0.45)),
    ("charcoal", (0.600, 0.10, 0.18), (0.00, 0.85, 0.85)),
)

# Standard-normal quantiles of 256 equal-probability bins: random bytes index it to give
# Gaussian grain ~10x faster than drawing normals.
_GAUSS_TABLE = np.array(
    [statistics.NormalDist().inv_cdf((i + 0.5) / 256) for i in range(256)], dtype=np.float32
)

_TEXTURES = ("plain", "stripes", "dots", "checks")

MAX_CLASSES = len(_SHAPES) * len(_PALETTES) * len(_TEXTURES)


def class_signature(k: int) -> tuple[int, int, int]:
    """(shape, palette, texture) indices of class k, unique for k < MAX_CLASSES.

    Shape cycles fastest and the palette is offset by k // S, so neighbouring classes differ
    in both shape and colour, and any first-n subset uses many palettes. (shape, palette)
    alone is unique for k < S*P; the texture term then separates the next blocks of S*P.
    """
    s, p, t = len(_SHAPES), len(_PALETTES), len(_TEXTURES)
    assert s == p, "the uniqueness argument above assumes as many palettes as shapes"
    return k % s, (k + k // s) % p, (k + k // s + k // (s * p)) % t


def class_names(num_classes: int) -> list[str]:
    """Folder names, zero-padded so lexicographic order is class-index order."""
    width = max(3, len(str(num_classes - 1)))
    names = []
    for k in range(num_classes):
        s, p, t = class_signature(k)
        tex = "" if _TEXTURES[t] == "plain" else f"{_TEXTURES[t]}_"
        names.append(f"c{k:0{width}d}_{_PALETTES[p][0]}_{tex}{_SHAPES[s]}")
    return names


# --------------------------------------------------------------------------------------------
# Rendering (pure numpy + PIL; runs in worker processes).
# --------------------------------------------------------------------------------------------


def _hsv_to_rgb(h: float, s: float, v: float) -> np.ndarray:
    h = (h % 1.0) * 6.0
    i = int(h) % 6
    f = h - int(h)
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    rgb = ((v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q))[i]
    return np.array(rgb, dtype=np.float32)


def _box(u: np.ndarray, v: np.ndarray, bx: float, by: float, r: float = 0.0) -> np.ndarray:
    """Signed distance to a rounded box with half-sizes (bx, by)."""
    qx = np.abs(u) - (bx - r)
    qy = np.abs(v) - (by - r)
    outside = np.hypot(np.maximum(qx, 0), np.maximum(qy, 0))
    return outside + np.minimum(np.maximum(qx, qy), 0) - r


def _ngon(r: np.ndarray, th: np.ndarray, n: int, size: float) -> np.ndarray:
    """Approximate signed distance to a regular n-gon of circumradius `size`."""
    seg = 2 * math.pi / n
    a = np.mod(th, seg) - seg / 2
    return r * np.cos(a) - size * math.cos(math.pi / n)


def _shape_sdf(shape: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Signed distance (unit-radius object coordinates, negative inside) for a shape family.

    Polar shapes use r - f(theta), not an exact distance, which is fine for a 1-3 px soft edge.
    """
    name = _SHAPES[shape]
    r = np.hypot(u, v)
    if name == "discs":
        return r - 1.0
    if name == "squares":
        return _box(u, v, 0.82, 0.82, 0.12)
    if name == "triangles":
        return _ngon(r, np.arctan2(v, u), 3, 1.1)
    if name == "stars":
        seg = 2 * math.pi / 5
        t = np.mod(np.arctan2(v, u), seg) / seg
        return r - (1.05 - 0.6 * (1 - np.abs(2 * t - 1)))
    if name == "rings":
        return np.abs(r - 0.72) - 0.28
    if name == "crosses":
        return np.minimum(_box(u, v, 1.0, 0.32, 0.05), _box(u, v, 0.32, 1.0, 0.05))
    if name == "hexagons":
        return _ngon(r, np.arctan2(v, u), 6, 1.0)
    if name == "crescents":
        return np.maximum(r - 1.0, 0.85 - np.hypot(u - 0.5, v))
    if name == "diamonds":
        return (np.abs(u) / 0.6 + np.abs(v) / 1.1 - 1.0) * 0.5
    if name == "flowers":
        th = np.arctan2(v, u)
        return r - (0.45 + 0.55 * np.abs(np.cos(2.5 * th)))
    if name == "bars":
        return _box(u, v, 1.1, 0.36, 0.08)
    if name == "keyholes":
        return np.minimum(np.hypot(u, v + 0.45) - 0.5, _box(u, v - 0.3, 0.26, 0.65))
    raise AssertionError(name)


def _texture_mix(texture: int, u: np.ndarray, v: np.ndarray, freq: float) -> np.ndarray:
    """Weight of the secondary colour (0..1) over the object surface, in object coordinates
    so the pattern rotates and scales with the object."""
    name = _TEXTURES[texture]
    if name == "plain":
        return 0.35 * np.clip(u * u + v * v, 0, 1)
    if name == "stripes":
        return np.clip(np.sin(u * freq * math.pi) * 2.5 + 0.5, 0, 1)
    if name == "dots":
        fu = u * freq - np.floor(u * freq) - 0.5
        fv = v * freq - np.floor(v * freq) - 0.5
        return np.clip((0.32 - np.hypot(fu, fv)) * 12 + 0.5, 0, 1)
    if name == "checks":
        s = np.sin(u * freq * math.pi) * np.sin(v * freq * math.pi)
        return np.clip(s * 3 + 0.5, 0, 1)
    raise AssertionError(name)


def _upsample(low: np.ndarray, w: int, h: int) -> np.ndarray:
    """Bicubic upsampling of an (h', w', C) float32 array to (h, w, C)."""
    out = np.empty((h, w, low.shape[2]), dtype=np.float32)
    for c in range(low.shape[2]):
        out[..., c] = np.asarray(Image.fromarray(low[..., c], "F").resize((w, h), Image.BICUBIC))
    return out


def _noise(rng: np.random.Generator, shape: tuple[int, int], chroma: float) -> np.ndarray:
    """Mostly-luminance noise (shared by R, G, B) with a little independent colour: real
    textures vary in brightness far more than in hue; independent channels look tie-dyed."""
    luma = rng.standard_normal((*shape, 1), dtype=np.float32)
    return luma + chroma * rng.standard_normal((*shape, 3), dtype=np.float32)


def _image_size(rng: np.random.Generator, min_long: int, max_long: int) -> tuple[int, int]:
    aw, ah = _ASPECTS[rng.integers(len(_ASPECTS))]
    long_side = int(rng.integers(min_long, max_long + 1))
    if aw >= ah:
        return long_side, max(1, round(long_side * ah / aw))
    return max(1, round(long_side * aw / ah)), long_side


def _background(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """Gradient, blotches, out-of-focus blobs and mottling, all low-frequency, so they are
    composed on a 1/4-resolution canvas and upsampled once (most of the speed budget)."""
    lw, lh = max(2, -(-w // 4)), max(2, -(-h // 4))
    ly, lx = np.ogrid[0:lh, 0:lw]
    lx = lx.astype(np.float32) + 0.5
    ly = ly.astype(np.float32) + 0.5
    # A two-colour gradient in a random direction, low-saturation so the class colours stand
    # out without being the only colourful thing in the frame.
    c1 = _hsv_to_rgb(rng.random(), rng.uniform(0.05, 0.4), rng.uniform(0.25, 0.9))
    c2 = _hsv_to_rgb(rng.random(), rng.uniform(0.05, 0.4), rng.uniform(0.25, 0.9))
    ang = rng.uniform(0, 2 * math.pi)
    g = (lx - lw / 2) * math.cos(ang) + (ly - lh / 2) * math.sin(ang)
    g = (g - g.min()) / max(float(np.ptp(g)), 1e-3)
    low = c1 + (c2 - c1) * g[..., None]
    # Often a second surface meeting the first along a fairly sharp line (horizon, table
    # edge, wall corner): real scenes have edges, not only haze.
    if rng.random() < 0.7:
        c3 = _hsv_to_rgb(rng.random(), rng.uniform(0.05, 0.5), rng.uniform(0.15, 0.9))
        c4 = c3 * rng.uniform(0.6, 1.2)
        ang2 = rng.uniform(0, 2 * math.pi)
        off = rng.uniform(-0.35, 0.35) * min(lw, lh)
        side = (lx - lw / 2) * math.cos(ang2) + (ly - lh / 2) * math.sin(ang2) - off
        m = np.clip(side / rng.uniform(0.3, 1.5) + 0.5, 0, 1)[..., None]
        g2 = np.clip(side / max(lw, lh), 0, 1)[..., None]
        low = low * (1 - m) + (c3 + (c4 - c3) * g2) * m
    # Large blotches (walls, sky, foliage masses) and medium mottling.
    for cells, amp in ((rng.integers(3, 7), 0.09), (rng.integers(12, 24), 0.05)):
        gh = max(2, round(int(cells) * lh / max(lh, lw)) + 1)
        gw = max(2, round(int(cells) * lw / max(lh, lw)) + 1)
        low += amp * _upsample(_noise(rng, (gh, gw), 0.25), lw, lh)
    # Soft random-coloured blobs: distractors that are not the class cue.
    short = min(lw, lh)
    for _ in range(int(rng.integers(0, 4))):
        col = _hsv_to_rgb(rng.random(), rng.uniform(0.1, 0.5), rng.uniform(0.2, 0.9))
        cx, cy = rng.uniform(0, lw), rng.uniform(0, lh)
        rx, ry = rng.uniform(0.1, 0.35) * short, rng.uniform(0.1, 0.35) * short
        d = np.hypot((lx - cx) / rx, (ly - cy) / ry)
        a = np.clip((1.0 - d) * rng.uniform(1.0, 3.0), 0, 1)[..., None] * rng.uniform(0.3, 0.7)
        low = low * (1 - a) + col * a
    # Fine texture at the canvas' own resolution: ~4 px features after upsampling.
    low += rng.uniform(0.03, 0.07) * _noise(rng, (lh, lw), 0.3)
    return _upsample(low, w, h)


def render_image(
    seed: int, split: int, label: int, index: int, min_long: int, max_long: int
) -> Image.Image:
    """Draw one image; a pure function of its arguments (no global RNG)."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, split, label, index]))
    w, h = _image_size(rng, min_long, max_long)
    short = min(w, h)
    img = _background(rng, w, h)

    # Objects of the class: shape family, palette and texture fixed; the rest varies.
    shape, palette, texture = class_signature(label)
    _, prim_hsv, sec_hsv = _PALETTES[palette]
    light = rng.uniform(0, 2 * math.pi)
    lx, ly = math.cos(light), math.sin(light)
    shadow_dx, shadow_dy = -lx * 0.05 * short, -ly * 0.05 * short
    n_obj = int(rng.choice([1, 2, 2, 3, 3, 4, 5]))
    for _ in range(n_obj):
        radius = rng.uniform(0.13, 0.25) * short
        cx = rng.uniform(0.12, 0.88) * w
        cy = rng.uniform(0.12, 0.88) * h
        rot = rng.uniform(0, 2 * math.pi)
        stretch = rng.uniform(0.8, 1.25)
        sx, sy = radius * stretch, radius / stretch
        dh = rng.normal(0, 0.015)
        prim = _hsv_to_rgb(
            prim_hsv[0] + dh,
            min(1.0, prim_hsv[1] * rng.uniform(0.85, 1.1)),
            min(1.0, prim_hsv[2] * rng.uniform(0.8, 1.1)),
        )
        sec = _hsv_to_rgb(
            sec_hsv[0] + dh,
            min(1.0, sec_hsv[1] * rng.uniform(0.85, 1.1)),
            min(1.0, sec_hsv[2] * rng.uniform(0.85, 1.1)),
        )
        freq = rng.uniform(2.5, 4.5)
        edge = rng.uniform(0.8, 2.5)  # soft-edge width in pixels
        surface = rng.uniform(0.03, 0.07)  # amplitude of the object's own mottling

        # Work only on the object's bounding box (plus its shadow): pixels elsewhere are
        # untouched, and full-frame distance fields per object would dominate the cost.
        ext = 1.15 * max(sx, sy) + edge + 2
        pad_x, pad_y = int(abs(shadow_dx)) + 1, int(abs(shadow_dy)) + 1
        x0, x1 = max(0, int(cx - ext) - pad_x), min(w, int(cx + ext) + 1 + pad_x)
        y0, y1 = max(0, int(cy - ext) - pad_y), min(h, int(cy + ext) + 1 + pad_y)
        if x0 >= x1 or y0 >= y1:
            continue
        px = np.arange(x0, x1, dtype=np.float32)[None, :] + (0.5 - cx)
        py = np.arange(y0, y1, dtype=np.float32)[:, None] + (0.5 - cy)
        cr, sr = math.cos(rot), math.sin(rot)
        u = (px * cr + py * sr) / sx
        v = (py * cr - px * sr) / sy
        d = _shape_sdf(shape, u, v) * radius
        alpha = np.clip(0.5 - d / edge, 0, 1)
        # Soft contact shadow: the same distance field shifted away from the light (by whole
        # pixels, which nobody can tell from exact) with a much wider edge.
        ix, iy = round(shadow_dx), round(shadow_dy)
        ds = np.full_like(d, 1e6)
        ds[max(0, iy) : d.shape[0] + min(0, iy), max(0, ix) : d.shape[1] + min(0, ix)] = d[
            max(0, -iy) : d.shape[0] + min(0, -iy), max(0, -ix) : d.shape[1] + min(0, -ix)
        ]
        keep = (1 - alpha) * (1 - 0.35 * np.clip(0.5 - ds / (0.06 * short), 0, 1))
        t = _texture_mix(texture, u, v, freq)
        # Directional shading in image space (one light for all objects) plus a darker rim,
        # so objects read as solid things rather than flat stickers; a little surface
        # mottling because real objects are never perfectly uniform.
        du, dv = px / radius, py / radius
        shade = alpha * (1.0 + 0.22 * (du * lx + dv * ly) - 0.12 * (du * du + dv * dv))
        grain = alpha * (surface * rng.standard_normal(d.shape, dtype=np.float32))
        # patch = patch * keep + (prim + (sec - prim) * t) * shade + grain, on 2-D weights
        # so only four operations touch all three channels.
        patch = img[y0:y1, x0:x1]
        patch *= keep[..., None]
        patch += prim * shade[..., None]
        patch += (sec - prim) * (shade * t)[..., None]
        patch += grain[..., None]

    return _camera(img, rng)


def _camera(img: np.ndarray, rng: np.random.Generator) -> Image.Image:
    """Slight lens blur, then sensor grain. On uint8 with a table of Gaussian values indexed
    by random bytes: same look as float maths, a fraction of the cost."""
    h, w = img.shape[:2]
    img8 = (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8)
    pil = Image.fromarray(img8, "RGB").filter(ImageFilter.BoxBlur(rng.uniform(0.25, 0.6)))
    sigma = rng.uniform(2.0, 4.0)
    noise = (_GAUSS_TABLE * sigma).round().astype(np.int16)
    arr = np.asarray(pil, dtype=np.int16) + noise[rng.integers(0, 256, (h, w, 1), dtype=np.uint8)]
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")


def _write_one(task: tuple) -> int:
    """Worker: render one image and save it; returns its size in bytes."""
    path, seed, split, label, index, min_long, max_long, quality = task
    image = render_image(seed, split, label, index, min_long, max_long)
    # subsampling=2 is 4:2:0, what cameras and ImageNet's JPEGs use; it sets decode cost.
    image.save(path, "JPEG", quality=quality, subsampling=2)
    return os.path.getsize(path)


# --------------------------------------------------------------------------------------------
# Cache management.
# --------------------------------------------------------------------------------------------


def _params(**kw) -> dict:
    return {"generator": _GENERATOR, "version": GENERATOR_VERSION, **kw}


GENERATED = Generated(
    MANIFEST_NAME,
    "synthetic dataset",
    "dataset=synthetic writes its images into dataset.root: pass dataset.root=<a new or empty "
    "folder>. To train on the images in {root}, use dataset=imagenet dataset.root={root} "
    "(train/<class>/*.jpg, val/<class>/*.jpg).",
)


def _validate(
    num_classes, train_per_class, val_per_class, seed, min_long_side, max_long_side, quality
) -> None:
    if not 1 <= num_classes <= MAX_CLASSES:
        raise ConfigError(
            f"dataset.num_classes={num_classes}: the synthetic set draws 1..{MAX_CLASSES} classes"
        )
    if train_per_class < 1 or val_per_class < 1:
        raise ConfigError(
            f"dataset.prepare.train_per_class={train_per_class} and "
            f"dataset.prepare.val_per_class={val_per_class} must be >= 1 (ImageFolder rejects "
            "empty class folders)"
        )
    if seed < 0:
        raise ConfigError(f"dataset.prepare.seed={seed} must be >= 0")
    if not 16 <= min_long_side <= max_long_side:
        raise ConfigError(
            f"dataset.prepare.min_long_side={min_long_side}, max_long_side={max_long_side}: "
            "need 16 <= min_long_side <= max_long_side"
        )
    if not 1 <= quality <= 100:
        raise ConfigError(f"dataset.prepare.quality={quality} must be in 1..100")


def ensure_synthetic_imagenet(
    root,
    *,
    num_classes=10,
    train_per_class=100,
    val_per_class=25,
    seed=0,
    min_long_side=400,
    max_long_side=500,
    quality=90,
    workers=None,
    progress=True,
) -> Path:
    """Generate the synthetic dataset into `root` unless it is already there; return root.

    A complete dataset is recognised by its manifest alone (written last), so a cache hit
    costs one small file read. Generation goes to a sibling temp folder renamed into place
    at the end (fastload/atomic.py), so a killed run never leaves something that looks
    complete.
    """
    require_whole_numbers("synthetic dataset", num_classes=num_classes,
                          train_per_class=train_per_class, val_per_class=val_per_class,
                          seed=seed, min_long_side=min_long_side, max_long_side=max_long_side,
                          quality=quality)  # fmt: skip
    _validate(
        num_classes, train_per_class, val_per_class, seed, min_long_side, max_long_side, quality
    )
    params = _params(
        num_classes=int(num_classes),
        train_per_class=int(train_per_class),
        val_per_class=int(val_per_class),
        seed=int(seed),
        min_long_side=int(min_long_side),
        max_long_side=int(max_long_side),
        quality=int(quality),
    )

    def build(tmp: Path) -> dict:
        tasks = _tasks(tmp, params, min_long_side, max_long_side, quality)
        desc = f"generating synthetic dataset {Path(root).name}"
        sizes = run_tasks(_write_one, tasks, workers, progress, desc, "img")
        return {
            "num_files": len(tasks),
            "total_bytes": sum(sizes),
            "splits": {"train": train_per_class * num_classes, "val": val_per_class * num_classes},
            "classes": class_names(num_classes),
        }

    return GENERATED.ensure(root, params, build)


def _tasks(tmp: Path, params: dict, min_long_side, max_long_side, quality) -> list[tuple]:
    """One task per image file: (path, seed, split, label, index, sizes, quality)."""
    tasks = []
    n = params["num_classes"]
    per_split = (params["train_per_class"], params["val_per_class"])
    for split_id, (split, per_class) in enumerate(zip(SPLITS, per_split, strict=True)):
        for label, name in enumerate(class_names(n)):
            folder = tmp / split / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                path = str(folder / f"{name[: name.index('_')]}_{i:05d}.jpg")
                task = (path, params["seed"], split_id, label, i)
                tasks.append(task + (min_long_side, max_long_side, quality))
    return tasks
