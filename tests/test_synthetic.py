"""Tests for the synthetic ImageNet-style dataset generator (fastload.data.synthetic)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, JpegImagePlugin

from fastload.atomic import temp_path
from fastload.data import synthetic
from fastload.data.synthetic import MANIFEST_NAME, ensure_synthetic_imagenet
from fastload.errors import ConfigError, DatasetError

# Small images keep the file fast; the renderer's per-pixel cost is what it is at full size.
TINY = dict(
    num_classes=3,
    train_per_class=4,
    val_per_class=2,
    min_long_side=64,
    max_long_side=96,
    progress=False,
)


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _quant_tables(quality: int) -> dict:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buf, "JPEG", quality=quality, subsampling=2)
    return Image.open(buf).quantization


def test_layout_is_imagefolder_with_requested_jpegs(tmp_path, capsys):
    from torchvision.datasets import ImageFolder

    root = tmp_path / "deep" / "synthetic"  # parents are created
    out = ensure_synthetic_imagenet(root, **{**TINY, "progress": True}, quality=85, workers=1)
    assert out == root.absolute()
    assert "generating synthetic dataset" in capsys.readouterr().err  # tqdm bar on stderr

    names = synthetic.class_names(3)
    assert names == sorted(names) and all(n.startswith(f"c{i:03d}_") for i, n in enumerate(names))
    train, val = ImageFolder(str(root / "train")), ImageFolder(str(root / "val"))
    assert train.class_to_idx == val.class_to_idx == {n: i for i, n in enumerate(names)}
    assert len(train) == 3 * 4 and len(val) == 3 * 2
    assert sorted(t for _, t in train.samples) == [0] * 4 + [1] * 4 + [2] * 4
    assert Path(train.samples[5][0]).name == "c001_00001.jpg"

    q85 = _quant_tables(85)
    for path, _ in train.samples + val.samples:
        with Image.open(path) as im:
            assert im.format == "JPEG" and im.mode == "RGB"
            assert 64 <= max(im.size) <= 96 and min(im.size) >= 64 * 9 // 16
            assert im.quantization == q85  # encoded at the requested quality
            assert JpegImagePlugin.get_sampling(im) == 2  # 4:2:0
            im.load()

    manifest = json.loads((root / MANIFEST_NAME).read_text())
    assert manifest["num_files"] == 18 == len(list(root.rglob("*.jpg")))
    assert manifest["classes"] == names


def test_images_look_like_photos_not_noise():
    """Sizes spread over the range, several aspect ratios, smooth content (most energy at low
    frequency) but not flat, and q90 JPEG sizes in a photo-like range."""
    sizes, shapes, ratios = [], set(), []
    for i in range(12):
        im = synthetic.render_image(0, 0, i % 4, i, 400, 500)
        shapes.add(im.size)
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=90, subsampling=2)
        sizes.append(len(buf.getvalue()))
        a = np.asarray(im.convert("L"), dtype=np.float32)
        assert 400 <= max(a.shape) <= 500
        fine = np.abs(np.diff(a, axis=1)).mean()  # pixel-to-pixel change: grain + edges
        coarse = a[:, ::8].std()  # spread of brightness across the frame
        ratios.append(coarse / fine)
    assert len({round(w / h, 2) for w, h in shapes}) >= 4
    assert 20_000 < np.mean(sizes) < 90_000
    assert np.median(ratios) > 4  # white noise has coarse/fine ~ 0.9


def test_deterministic_across_worker_counts(tmp_path):
    a = ensure_synthetic_imagenet(tmp_path / "a", **TINY, workers=1)
    b = ensure_synthetic_imagenet(tmp_path / "b", **TINY, workers=2)
    fa, fb = _files(a), _files(b)
    assert len(fa) == 19 and fa == fb  # 18 images + manifest, byte for byte
    images = [v for k, v in fa.items() if k.endswith(".jpg")]
    assert len(set(images)) == len(images)  # and not one image repeated

    c = ensure_synthetic_imagenet(tmp_path / "c", **TINY, workers=1, seed=1)
    assert not set(images) & {v for v in _files(c).values()}  # the seed matters


def test_second_call_is_a_cache_hit(tmp_path, monkeypatch):
    root = ensure_synthetic_imagenet(tmp_path / "ds", **TINY, workers=1)
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}

    def boom(task):
        raise AssertionError("regenerated a cached dataset")

    monkeypatch.setattr(synthetic, "_write_one", boom)
    assert ensure_synthetic_imagenet(root, **TINY, workers=1) == root
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before


def test_different_params_on_same_root_raise(tmp_path):
    root = ensure_synthetic_imagenet(tmp_path / "ds", **TINY, workers=1)
    with pytest.raises(DatasetError, match="different parameters") as err:
        ensure_synthetic_imagenet(root, **{**TINY, "num_classes": 4}, workers=1)
    assert str(root) in str(err.value) and "dataset.root=" in str(err.value)
    with pytest.raises(DatasetError, match=str(root)):
        ensure_synthetic_imagenet(root, **TINY, seed=7, workers=1)


def test_foreign_or_incomplete_root_is_not_treated_as_complete(tmp_path):
    # A copy of a real dataset minus its manifest, i.e. what an interrupted in-place
    # writer would leave: must not be accepted, and must not be overwritten either.
    root = ensure_synthetic_imagenet(tmp_path / "ds", **TINY, workers=1)
    (root / MANIFEST_NAME).unlink()
    with pytest.raises(DatasetError, match=f"{root} is not empty") as err:
        ensure_synthetic_imagenet(root, **TINY, workers=1)
    # It may be the user's own images: never offered for deletion; the way to use them is.
    assert "delete" not in str(err.value) and f"dataset=imagenet dataset.root={root}" in str(
        err.value
    )
    (root / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(DatasetError, match=str(root)):
        ensure_synthetic_imagenet(root, **TINY, workers=1)

    # An existing empty folder (e.g. made by a launcher) is fine to fill.
    empty = tmp_path / "empty"
    empty.mkdir()
    ensure_synthetic_imagenet(empty, **TINY, workers=1)
    assert (empty / MANIFEST_NAME).is_file()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_leftover_temp_folder_is_ignored_and_removed(tmp_path):
    root = tmp_path / "ds"
    # What a SIGKILLed generation leaves: a sibling temp folder, even one with a manifest.
    stale = temp_path(root, pid=_dead_pid())
    (stale / "train" / "c000_x").mkdir(parents=True)
    (stale / "train" / "c000_x" / "c000_00000.jpg").write_bytes(b"partial")
    (stale / MANIFEST_NAME).write_text("{}")
    # A temp folder of a generator that is still running (this process) must survive.
    live = temp_path(root, pid=os.getppid())
    live.mkdir()

    ensure_synthetic_imagenet(root, **TINY, workers=1)
    assert not stale.exists() and live.exists()
    assert len(list(root.rglob("*.jpg"))) == 18
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ds", live.name])


def test_interrupted_generation_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    root = tmp_path / "ds"
    real = synthetic._write_one
    calls = []

    def dies_midway(task):
        calls.append(task)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(task)

    monkeypatch.setattr(synthetic, "_write_one", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        ensure_synthetic_imagenet(root, **TINY, workers=1)
    assert not root.exists()
    assert list(tmp_path.iterdir()) == []  # our own temp folder is cleaned up too

    monkeypatch.setattr(synthetic, "_write_one", real)
    ensure_synthetic_imagenet(root, **TINY, workers=1)
    assert json.loads((root / MANIFEST_NAME).read_text())["num_files"] == 18


def test_a_root_that_links_to_an_empty_folder_is_generated_into(tmp_path, monkeypatch):
    """The link could not be replaced by the built folder: a raw AlreadyBuilt said the set
    'appeared while it was being built'."""
    target = tmp_path / "target"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    ensure_synthetic_imagenet(link, **TINY, workers=1)
    assert json.loads((link / MANIFEST_NAME).read_text())["num_files"] == 18
    assert link.is_symlink() and (target / MANIFEST_NAME).is_file()
    # a place the built folder cannot be renamed onto (an empty mount point): said so
    from fastload import atomic

    def busy(src, dst):
        raise OSError(16, "Device or resource busy")

    monkeypatch.setattr(atomic.os, "rename", busy)
    (tmp_path / "mnt").mkdir()
    with pytest.raises(DatasetError, match=r"could not be moved into place at .*mnt"):
        ensure_synthetic_imagenet(tmp_path / "mnt", **TINY, workers=1)
    # a parent this user cannot search: Path.exists raises (Python 3.11), said as the rest
    real_exists = Path.exists

    def denied(self, *a, **k):
        if self.name == "hidden":
            raise PermissionError(13, "Permission denied", str(self))
        return real_exists(self, *a, **k)

    monkeypatch.setattr(Path, "exists", denied)
    with pytest.raises(DatasetError, match=r"cannot read .*hidden: .*Permission denied"):
        ensure_synthetic_imagenet(tmp_path / "hidden", **TINY, workers=1)


def test_unwritable_location_raises_dataset_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(DatasetError, match=str(blocker / "sub" / "ds")):
        ensure_synthetic_imagenet(blocker / "sub" / "ds", **TINY, workers=1)
    with pytest.raises(DatasetError, match=str(blocker)):
        ensure_synthetic_imagenet(blocker, **TINY, workers=1)

    if os.geteuid() != 0:  # root ignores permission bits
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        try:
            with pytest.raises(DatasetError, match=str(ro / "ds")):
                ensure_synthetic_imagenet(ro / "ds", **TINY, workers=1)
        finally:
            ro.chmod(0o700)


def test_class_signatures_scale_to_hundreds_of_classes():
    sigs = [synthetic.class_signature(k) for k in range(synthetic.MAX_CLASSES)]
    assert len(set(sigs)) == synthetic.MAX_CLASSES >= 100
    # Among the first 10 classes no two share a shape or a palette.
    assert len({s for s, _, _ in sigs[:10]}) == 10 and len({p for _, p, _ in sigs[:10]}) == 10
    names = synthetic.class_names(1000)
    assert len(set(names)) == 1000 and names == sorted(names) and names[7].startswith("c007_")
    with pytest.raises(ConfigError, match="dataset.num_classes="):
        ensure_synthetic_imagenet("unused", num_classes=synthetic.MAX_CLASSES + 1)
    # the options named as the config names them (it said "synthetic train_per_class=-3")
    with pytest.raises(ConfigError, match=r"dataset.prepare.train_per_class=-3 and"):
        ensure_synthetic_imagenet("unused", num_classes=2, train_per_class=-3)


def _features(img: Image.Image, rng: np.random.Generator) -> np.ndarray:
    """Crude, CNN-free features of a random ~50% crop, randomly flipped: a joint RGB colour
    histogram plus a magnitude-weighted gradient-orientation histogram."""
    w, h = img.size
    cw, ch = int(w * np.sqrt(0.5)), int(h * np.sqrt(0.5))
    x0, y0 = rng.integers(0, w - cw + 1), rng.integers(0, h - ch + 1)
    crop = img.crop((x0, y0, x0 + cw, y0 + ch)).resize((48, 48))
    if rng.random() < 0.5:
        crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    a = np.asarray(crop, dtype=np.float32)
    bins = (a // 64).astype(int)  # 4 levels per channel
    colour = np.bincount(
        (bins[..., 0] * 16 + bins[..., 1] * 4 + bins[..., 2]).ravel(), minlength=64
    )
    grey = a.mean(axis=2)
    gx, gy = np.diff(grey, axis=1)[:-1], np.diff(grey, axis=0)[:, :-1]
    # Orientation modulo pi, folded so a horizontal flip maps the histogram onto itself.
    ang = np.abs(np.arctan2(gy, gx)) % np.pi
    ang = np.minimum(ang, np.pi - ang)
    orient = np.bincount(
        np.minimum((ang / (np.pi / 2) * 6).astype(int), 5).ravel(),
        weights=np.hypot(gx, gy).ravel(),
        minlength=6,
    )
    return np.concatenate([colour / colour.sum(), 0.5 * orient / max(orient.sum(), 1e-6)])


def test_classes_are_learnable_by_a_crude_classifier(tmp_path):
    root = ensure_synthetic_imagenet(
        tmp_path / "ds",
        num_classes=4,
        train_per_class=12,
        val_per_class=6,
        min_long_side=96,
        max_long_side=128,
        progress=False,
        workers=2,
    )
    rng = np.random.default_rng(0)

    def load(split):
        xs, ys = [], []
        for k, name in enumerate(synthetic.class_names(4)):
            for p in sorted((root / split / name).glob("*.jpg")):
                with Image.open(p) as im:
                    xs.append(_features(im.convert("RGB"), rng))
                ys.append(k)
        return np.stack(xs), np.array(ys)

    xtr, ytr = load("train")
    xva, yva = load("val")
    centroids = np.stack([xtr[ytr == k].mean(axis=0) for k in range(4)])
    pred = np.abs(xva[:, None, :] - centroids[None]).sum(axis=2).argmin(axis=1)
    accuracy = (pred == yva).mean()
    assert accuracy >= 0.6, accuracy  # chance is 0.25


def _generate_kind(kind: str, root: Path, workers: int) -> dict:
    """Each built-in generator as users run it (progress bar on), tiny; returns its manifest."""
    from fastload.data import synthetic_coco, synthetic_div2k

    if kind == "imagenet":
        ensure_synthetic_imagenet(root, **{**TINY, "progress": True}, workers=workers)
        manifest = root / MANIFEST_NAME
    elif kind == "coco":
        synthetic_coco.ensure_synthetic_coco(root, train_images=5, val_images=3, min_long_side=64,
                                             max_long_side=80, workers=workers, progress=True)  # fmt: skip
        manifest = root / synthetic_coco.MANIFEST_NAME
    else:
        synthetic_div2k.ensure_synthetic_div2k(root, train_count=4, val_count=2, min_long_side=64,
                                               max_long_side=80, workers=workers, progress=True)  # fmt: skip
        manifest = root / synthetic_div2k.MANIFEST_NAME
    return json.loads(manifest.read_text())


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("kind", ["imagenet", "coco", "div2k"])
def test_generators_write_everything_their_manifest_counts(tmp_path, monkeypatch, kind, workers):
    """With the progress bar redrawing on every image (as it does on a slow machine), every
    image is written and the manifest's counts and byte totals are those of the files."""
    monkeypatch.setenv("TQDM_MININTERVAL", "0")  # tqdm reads TQDM_* overrides: redraw always
    root = tmp_path / kind
    manifest = _generate_kind(kind, root, workers)
    images = sorted(p for p in root.rglob("*") if p.suffix in (".jpg", ".png"))
    on_disk = sum(p.stat().st_size for p in images)
    if kind == "imagenet":
        assert manifest["num_files"] == len(images) == 3 * (4 + 2)
        assert manifest["total_bytes"] == on_disk
    elif kind == "div2k":
        assert manifest["files"] == len(images) == 2 * (4 + 2)
        assert manifest["total_bytes"] == on_disk
    else:
        listed = []
        for split, n in (("train", 5), ("val", 3)):
            coco = json.loads((root / "annotations" / f"instances_{split}.json").read_text())
            assert len(coco["images"]) == manifest["splits"][split] == n
            listed += [root / split / im["file_name"] for im in coco["images"]]
        assert sorted(listed) == images


@pytest.mark.parametrize(
    "kind, bad", [("imagenet", {"train_per_class": "abc"}), ("coco", {"train_images": 2.5}),
                  ("div2k", {"val_count": "4"})],
)  # fmt: skip
def test_generator_counts_must_be_whole_numbers(tmp_path, kind, bad):
    from fastload.data import synthetic_coco, synthetic_div2k

    make = {"imagenet": ensure_synthetic_imagenet, "coco": synthetic_coco.ensure_synthetic_coco,
            "div2k": synthetic_div2k.ensure_synthetic_div2k}[kind]  # fmt: skip
    ((key, value),) = bad.items()
    with pytest.raises(ConfigError, match=f"{key}={value!r} must be a whole number"):
        make(tmp_path / kind, progress=False, **bad)
    assert not (tmp_path / kind).exists()
