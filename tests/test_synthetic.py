"""The built-in dataset: ImageFolder layout, photo-like JPEGs, deterministic, cached, atomic."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
import torchvision
from PIL import Image

from fastload.data.synthetic import MANIFEST_NAME, ensure_synthetic_imagenet
from fastload.errors import DatasetError

SMALL = dict(
    num_classes=3,
    train_per_class=4,
    val_per_class=2,
    min_long_side=120,
    max_long_side=160,
    progress=False,
)


def files(root):
    return sorted(p.relative_to(root) for p in root.rglob("*.jpg"))


def test_layout_is_an_imagefolder_of_photo_like_jpegs(tmp_path):
    root = ensure_synthetic_imagenet(tmp_path / "syn", **SMALL, workers=1)
    for split, n in (("train", 4), ("val", 2)):
        ref = torchvision.datasets.ImageFolder(str(root / split))
        assert len(ref.classes) == 3 and len(ref) == 3 * n
        assert list(ref.class_to_idx.values()) == [0, 1, 2]
    assert sorted(os.listdir(root / "train")) == sorted(os.listdir(root / "val"))
    for path in files(root)[:6]:
        img = Image.open(root / path)
        assert img.format == "JPEG" and img.mode == "RGB"
        assert 120 <= max(img.size) <= 160
        px = np.asarray(img, np.float64)
        # Photo-like, not noise: neighbouring pixels are strongly correlated.
        dx = np.abs(np.diff(px, axis=1)).mean()
        assert dx < 0.25 * px.std(), (path, dx, px.std())


def test_same_seed_same_bytes_whatever_the_worker_count(tmp_path):
    a = ensure_synthetic_imagenet(tmp_path / "a", **SMALL, workers=1)
    b = ensure_synthetic_imagenet(tmp_path / "b", **SMALL, workers=2)
    assert files(a) == files(b)
    assert all((a / p).read_bytes() == (b / p).read_bytes() for p in files(a))
    c = ensure_synthetic_imagenet(tmp_path / "c", **{**SMALL, "seed": 1}, workers=1)
    assert (a / files(a)[0]).read_bytes() != (c / files(c)[0]).read_bytes()


def test_cached_and_refuses_other_parameters(tmp_path):
    root = ensure_synthetic_imagenet(tmp_path / "syn", **SMALL, workers=1)
    stamp = {p: (root / p).stat().st_mtime_ns for p in files(root)}
    assert ensure_synthetic_imagenet(root, **SMALL, workers=1) == root
    assert stamp == {p: (root / p).stat().st_mtime_ns for p in files(root)}  # not regenerated
    with pytest.raises(DatasetError, match=str(root)):
        ensure_synthetic_imagenet(root, **{**SMALL, "train_per_class": 5}, workers=1)


def test_incomplete_folders_are_never_taken_for_a_dataset(tmp_path):
    root = tmp_path / "syn"
    # A killed run's temp folder (dead pid) is ignored and cleaned; generation completes.
    stale = tmp_path / f"syn.tmp-{os.uname().nodename}-999999"
    (stale / "train" / "c000").mkdir(parents=True)
    ensure_synthetic_imagenet(root, **SMALL, workers=1)
    assert (root / MANIFEST_NAME).is_file() and not stale.exists()
    # A non-empty folder without the manifest (e.g. a copy cut short) is refused, not used.
    other = tmp_path / "half"
    (other / "train").mkdir(parents=True)
    with pytest.raises(DatasetError, match="no complete synthetic dataset"):
        ensure_synthetic_imagenet(other, **SMALL, workers=1)


def test_classes_differ_in_colour_statistics(tmp_path):
    """A learnability proxy without a CNN: nearest class-mean colour histogram of random
    flipped half-size crops beats chance (1/3) clearly on held-out images."""
    root = ensure_synthetic_imagenet(
        tmp_path / "syn", **{**SMALL, "train_per_class": 8, "val_per_class": 6}, workers=2
    )
    rng = np.random.default_rng(0)

    def feature(path):
        px = np.asarray(Image.open(io.BytesIO(path.read_bytes())).convert("HSV"))
        h, w = px.shape[:2]
        y, x = rng.integers(0, h // 2), rng.integers(0, w // 2)
        crop = px[y : y + h // 2, x : x + w // 2, ::-1][:, ::-1]
        hist = [np.histogram(crop[..., c], bins=8, range=(0, 255))[0] for c in range(3)]
        return np.concatenate(hist) / crop[..., 0].size

    def split(name):
        ds = torchvision.datasets.ImageFolder(str(root / name))
        return np.stack([feature(Path(p)) for p, _ in ds.samples]), np.array(ds.targets)

    xtr, ytr = split("train")
    xva, yva = split("val")
    means = np.stack([xtr[ytr == k].mean(0) for k in range(3)])
    pred = np.argmin(((xva[:, None] - means[None]) ** 2).sum(-1), 1)
    assert (pred == yva).mean() >= 0.6
