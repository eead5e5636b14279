"""Synthetic DIV2K: the built-in default of dataset=div2k, generated on first use.

`ensure_synthetic_div2k(root, scale=2)` writes DIV2K's own layout, PNG like the original:

    root/DIV2K_train_HR/0001.png ...                    root/DIV2K_valid_HR/0065.png ...
    root/DIV2K_train_LR_bicubic/X2/0001x2.png ...       root/DIV2K_valid_LR_bicubic/X2/...

HR images are the synthetic ImageNet renderer's photo-like frames (fastload/data/synthetic.py:
textured, shaded objects with soft and hard edges over smooth backgrounds, lens blur, grain),
so there is detail that bicubic upsampling loses and SRCNN can learn back. LR images are the
HR images downscaled by PIL's antialiased bicubic over exactly the HR pixels the LR grid
covers (LR size = HR size // scale, as DIV2K's), so LR pixel (y, x) is aligned with HR pixel
(y*scale, x*scale). Every file is a pure function of (seed, split, index).

Like the synthetic ImageNet: generated in a temporary sibling folder renamed into place
(fastload/atomic.py), recognised by its manifest (written last); a folder that holds anything
else is never written into.
"""

from __future__ import annotations

import os
from pathlib import Path

from PIL import Image

from fastload.data.generated import Generated, require_whole_numbers, run_tasks
from fastload.data.synthetic import MAX_CLASSES, render_image
from fastload.errors import ConfigError

MANIFEST_NAME = "fastload-synthetic-div2k.json"
GENERATOR = "fastload-synthetic-div2k"
GENERATOR_VERSION = 1  # bump when the images change; conf/dataset/div2k.yaml names it (g1)
SPLITS = ("train", "valid")
SUPERSAMPLE = 3


def hr_name(index: int) -> str:
    return f"{index:04d}.png"


def lr_name(index: int, scale: int) -> str:
    return f"{index:04d}x{scale}.png"


def write_pair(task: tuple) -> int:
    """Worker: render HR image `index`, save it and its bicubic LR; returns bytes written."""
    hr_path, lr_path, seed, split, index, scale, min_long, max_long = task
    # Drawn at SUPERSAMPLE x the size and downscaled: the renderer's frames are soft (lens
    # blur, ~4 px background features), which bicubic upsampling already restores to
    # ~39 dB; supersampled they are sharp like real photographs (bicubic x2 ~33 dB luma
    # PSNR here with PyTorch's bicubic, ~0.2 dB above MATLAB's that papers use) and the grain
    # drops to ~1 grey level.
    ss = SUPERSAMPLE
    big = render_image(seed, 100 + split, index % MAX_CLASSES, index, min_long * ss, max_long * ss)
    hr = big.resize((big.width // ss, big.height // ss), Image.LANCZOS)
    w, h = hr.width // scale, hr.height // scale
    lr = hr.resize((w, h), Image.BICUBIC, box=(0, 0, w * scale, h * scale))
    hr.save(hr_path, "PNG", compress_level=1)  # DIV2K's files are PNG; level 1: fast to write
    lr.save(lr_path, "PNG", compress_level=1)
    return os.path.getsize(hr_path) + os.path.getsize(lr_path)


GENERATED = Generated(
    MANIFEST_NAME,
    "synthetic DIV2K",
    "To train on the images in it add dataset.prepare=null (DIV2K layout, or "
    "dataset.layout.lr=null for any image folder); to generate, pass dataset.root=<a new or "
    "empty folder>.",
)


def ensure_synthetic_div2k(
    root,
    *,
    scale: int = 2,
    train_count: int = 64,
    val_count: int = 16,
    seed: int = 0,
    min_long_side: int = 320,
    max_long_side: int = 480,
    workers: int | None = None,
    progress: bool = True,
) -> Path:
    """Generate the synthetic DIV2K into `root` unless it is already there; returns root."""
    require_whole_numbers("synthetic DIV2K", scale=scale, train_count=train_count,
                          val_count=val_count, seed=seed, min_long_side=min_long_side,
                          max_long_side=max_long_side)  # fmt: skip
    if scale not in (2, 3, 4, 8) or train_count < 1 or val_count < 1 or seed < 0:
        raise ConfigError(
            f"synthetic DIV2K: scale={scale} (2, 3, 4, 8), train_count={train_count} and "
            f"val_count={val_count} (>= 1), seed={seed} (>= 0)."
        )
    if not 16 * scale <= min_long_side <= max_long_side:
        raise ConfigError(
            f"synthetic DIV2K: min_long_side={min_long_side}, max_long_side={max_long_side}: "
            f"need {16 * scale} <= min_long_side <= max_long_side."
        )
    params = {"generator": GENERATOR, "version": GENERATOR_VERSION, "scale": scale,
              "train_count": train_count, "val_count": val_count, "seed": seed,
              "min_long_side": min_long_side, "max_long_side": max_long_side}  # fmt: skip

    def build(tmp: Path) -> dict:
        tasks = _tasks(tmp, params)
        desc = f"generating synthetic DIV2K {Path(root).name}"
        sizes = run_tasks(write_pair, tasks, workers, progress, desc, "pair", chunksize=4)
        return {"files": 2 * len(tasks), "total_bytes": sum(sizes)}

    return GENERATED.ensure(root, params, build)


def _tasks(tmp: Path, params: dict) -> list[tuple]:
    """One task per pair; valid numbered after train, as DIV2K's 0801..0900."""
    scale, tasks, index = params["scale"], [], 1
    for split_id, (split, count) in enumerate(
        zip(SPLITS, (params["train_count"], params["val_count"]), strict=True)
    ):
        hr_dir = tmp / f"DIV2K_{split}_HR"
        lr_dir = tmp / f"DIV2K_{split}_LR_bicubic" / f"X{scale}"
        hr_dir.mkdir(parents=True)
        lr_dir.mkdir(parents=True)
        for _ in range(count):
            tasks.append((str(hr_dir / hr_name(index)), str(lr_dir / lr_name(index, scale)),
                          params["seed"], split_id, index, scale,
                          params["min_long_side"], params["max_long_side"]))  # fmt: skip
            index += 1
    return tasks
