"""The data path of the foundation: folder indexing, uint8 transforms, samplers, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision
from conftest import build_test_loader, make_image_folder
from PIL import Image, ImageFilter

from fastload.data.batch import collate
from fastload.data.dataset import ImageDataset
from fastload.data.folder import index_image_folder
from fastload.data.sampling import EpochSampler, ShardSampler
from fastload.data.transforms import (
    RandomResizedCropFlip,
    ResizeCenterCrop,
    random_resized_crop_box,
)
from fastload.decode.pil import PILBackend
from fastload.errors import CorruptImageError, DatasetError
from fastload.storage.disk import DiskStorage


def test_index_follows_torchvision_imagefolder(tiny_folder):
    ours = index_image_folder(tiny_folder / "train")
    ref = torchvision.datasets.ImageFolder(str(tiny_folder / "train"))
    assert ours.class_to_idx == ref.class_to_idx
    assert [str(ours.path(i)) for i in range(len(ours))] == [p for p, _ in ref.samples]
    assert ours.targets.tolist() == ref.targets
    assert ours.paths.dtype.kind == "S"  # numpy bytes, not a list of objects


@pytest.mark.parametrize("layout", ["missing", "empty", "no_images"])
def test_bad_roots_name_the_folder(tmp_path, layout):
    split = tmp_path / "root" / "train"
    if layout == "empty":
        split.mkdir(parents=True)
    elif layout == "no_images":
        (split / "cat").mkdir(parents=True)
        (split / "cat" / "notes.txt").write_text("x")
    with pytest.raises(DatasetError) as err:
        index_image_folder(split)
    assert str(split) in str(err.value) and "dataset.root" in str(err.value)


def test_symlinks_are_followed_but_no_folder_twice(tmp_path, caplog):
    """A link back up the tree (`ln -s .. cat/loop`) would repeat the split ~40 levels deep
    under one class; a link into another class would label its images twice. Both are
    skipped and named; a link to a folder outside the split is followed, as torchvision does."""
    root = make_image_folder(tmp_path / "d", classes=("cat", "dog"), per_split=(3, 1))
    split = root / "train"
    extra = make_image_folder(tmp_path / "extra", classes=("x",), per_split=(2, 1))
    (split / "cat" / "loop").symlink_to("..")
    (split / "cat" / "dogs").symlink_to(split / "dog")
    (split / "dog" / "more").symlink_to(extra / "train" / "x")
    with caplog.at_level("WARNING", logger="fastload"):
        index = index_image_folder(split)
    labels = {index.name(i): int(index.targets[i]) for i in range(len(index))}
    assert len(index) == 3 + 3 + 2
    assert sum(1 for t in labels.values() if t == 0) == 3  # cat: its own 3 images only
    assert [p for p in labels if p.startswith("dog/more/")] == ["dog/more/x_000.jpg",
                                                                 "dog/more/x_001.jpg"]  # fmt: skip
    assert sorted(index.skipped) == [str(split / "cat" / "dogs"), str(split / "cat" / "loop")]
    assert "skipped 2 linked folder(s)" in caplog.text and "cat/loop" in caplog.text


def test_tmpfs_staging_copies_a_symlink_loop_once(tmp_path):
    from fastload.storage import tmpfs

    root = make_image_folder(tmp_path / "d", classes=("cat", "dog"), per_split=(2, 1))
    (root / "train" / "cat" / "loop").symlink_to("..")
    staged = tmpfs.stage(root, ["train", "val"], tmp_path / "shm", threads=1, reserve_gb=0,
                         progress=False)  # fmt: skip
    copied = sorted(str(p.relative_to(staged)) for p in staged.rglob("*.jpg"))
    assert len(copied) == 2 * 2 + 2 * 1 and not any("loop" in p for p in copied)
    index = index_image_folder(staged / "train")
    assert index.targets.tolist() == [0, 0, 1, 1]


def test_crop_boxes_follow_random_resized_crop_rules():
    rng = np.random.default_rng(0)
    areas, ratios = [], []
    for _ in range(2000):
        left, top, w, h = random_resized_crop_box(500, 375, (0.08, 1.0), (3 / 4, 4 / 3), rng)
        assert 0 <= left and left + w <= 500 and 0 <= top and top + h <= 375
        areas.append(w * h / (500 * 375))
        ratios.append(w / h)
    assert 0.07 < min(areas) and max(areas) <= 1.0
    # Same distribution as torchvision's own sampler (which draws from torch's RNG).
    torch.manual_seed(0)
    img = torch.zeros(3, 375, 500)
    ref = [
        torchvision.transforms.RandomResizedCrop.get_params(img, [0.08, 1.0], [3 / 4, 4 / 3])
        for _ in range(2000)
    ]
    ref_areas = [h * w / (500 * 375) for _, _, h, w in ref]
    assert abs(np.mean(areas) - np.mean(ref_areas)) < 0.03
    assert abs(np.std(areas) - np.std(ref_areas)) < 0.03
    assert min(ratios) > 0.7 and max(ratios) < 1.4
    # Impossible ratio range for the image: falls back to the clipped centre crop.
    assert random_resized_crop_box(100, 10, (0.9, 1.0), (1, 1), np.random.default_rng(0)) == (
        45,
        0,
        10,
        10,
    )


def test_transforms_are_a_function_of_the_rng_only():
    img = Image.fromarray(np.random.default_rng(1).integers(0, 255, (80, 120, 3), np.uint8))
    t = RandomResizedCropFlip(32)
    a = np.asarray(t(img, np.random.default_rng((0, 1, 5))))
    b = np.asarray(t(img, np.random.default_rng((0, 1, 5))))
    c = np.asarray(t(img, np.random.default_rng((0, 1, 6))))
    assert a.shape == (32, 32, 3) and np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize("width, height", [(120, 80), (500, 375), (333, 500), (160, 120),
                                           (90, 120), (256, 300)])  # fmt: skip
def test_the_evaluation_crop_is_torchvisions_resize_and_center_crop(width, height):
    """One resample of the box torchvision's Resize(256) + CenterCrop(224) take: rounded to
    whole source pixels, it sat up to half a pixel off at each edge (28.5-39 dB against
    torchvision for these sizes, 1-1.7 output pixels off under 256 px). Evaluating published
    weights needs their own preprocessing."""
    yy, xx = np.mgrid[0:height, 0:width]
    smooth = np.stack([xx * 255 // width, yy * 255 // height, (xx * yy) % 251], -1)
    img = Image.fromarray(smooth.astype(np.uint8)).filter(ImageFilter.GaussianBlur(2))
    ref = torchvision.transforms.Compose(
        [torchvision.transforms.Resize(256), torchvision.transforms.CenterCrop(224)]
    )
    got = np.asarray(ResizeCenterCrop(224, 256)(img, None), np.float64)
    err = np.mean((got - np.asarray(ref(img), np.float64)) ** 2)
    assert err == 0 or 10 * np.log10(255**2 / err) >= 60, err


def test_the_epoch_samplers_padding_is_said(caplog):
    """DistributedSampler repeats the first samples of an epoch to give every rank as many:
    they are trained and counted twice (a corrupt one skipped twice), which the stream
    sampler said and this one did not."""
    with caplog.at_level("INFO", logger="fastload"):
        EpochSampler(22, rank=0, world_size=3, shuffle=True, seed=0)
        EpochSampler(22, rank=1, world_size=3, shuffle=True, seed=0)  # rank 0 says it
        EpochSampler(21, rank=0, world_size=3, shuffle=True, seed=0)  # none repeated
    assert caplog.text.count("repeated each epoch") == 1
    assert "22 samples over 3 ranks: 2 sample(s) repeated each epoch" in caplog.text


def test_epoch_sampler_shuffles_per_epoch_partitions_ranks_and_skips():
    s0 = EpochSampler(10, rank=0, world_size=2, shuffle=True, seed=3)
    s1 = EpochSampler(10, rank=1, world_size=2, shuffle=True, seed=3)
    s0.set_epoch(0), s1.set_epoch(0)
    e0 = [i for _, i in s0]
    assert sorted(e0 + [i for _, i in s1]) == list(range(10))
    s0.set_epoch(1)
    keys = list(s0)
    assert {e for e, _ in keys} == {1} and [i for _, i in keys] != e0
    s0.set_epoch(1, skip=2)
    assert list(s0) == keys[2:] and len(s0) == 3
    assert [i for _, i in ShardSampler(7, rank=1, world_size=3)] == [1, 4]


@pytest.mark.parametrize(
    "length, world, shuffle", [(0, 1, True), (1, 3, True), (10, 1, True), (22, 3, True),
                               (37, 4, False), (300, 8, True), (5, 7, True)]
)  # fmt: skip
def test_epoch_sampler_keys_and_batches_are_distributed_samplers(length, world, shuffle):
    """The epoch's keys are made from one index array as they are read, not listed: the
    order is still DistributedSampler's for every rank, epoch and skip, and the batches
    EpochBatches plans are its order cut in turn (drop_last or not, skipped batches)."""
    from torch.utils.data import DistributedSampler

    from fastload.data.sampling import EpochBatches

    for rank in range(world):
        sampler = EpochSampler(length, rank=rank, world_size=world, shuffle=shuffle, seed=7)
        for epoch in (0, 1, 5, 1):
            ref = DistributedSampler(range(length), world, rank, shuffle=shuffle, seed=7)
            ref.set_epoch(epoch)
            want = [(epoch, i) for i in ref]
            assert all(type(i) is int for _, i in want)
            keys = sampler.epoch_keys(epoch)
            assert len(keys) == len(want) and list(keys) == want
            assert [keys[j] for j in range(-len(want), len(want))] == want + want
            for skip in sorted({min(k, len(want)) for k in (0, 1, 3, len(want))}):
                sampler.set_epoch(epoch, skip)
                got = list(sampler)
                assert got == want[skip:] and len(sampler) == len(want) - skip
                assert all(type(k) is tuple and type(k[1]) is int for k in got)
            for bs, drop_last, skip in ((4, False, 0), (4, True, 1), (3, False, 2)):
                eb = EpochBatches(sampler, bs, drop_last)
                n = eb.epoch_batches()
                assert n == (len(want) // bs if drop_last else -(-len(want) // bs))
                skip = min(skip, n)
                eb.plan = [(epoch, skip, n - skip)]
                cut = [want[b * bs : (b + 1) * bs] for b in range(skip, n)]
                assert list(eb) == cut and len(eb) == len(cut)


def make_dataset(root, split="train", **kw):
    reader = DiskStorage().open(root, split)
    return ImageDataset(reader, PILBackend(), RandomResizedCropFlip(24), seed=0, **kw)


def test_corrupt_image_is_named_or_skipped_and_counted(tmp_path):
    root = make_image_folder(tmp_path / "d", classes=("a", "b"), per_split=(3, 1))
    bad = root / "train" / "a" / "a_001.jpg"
    bad.write_bytes(bad.read_bytes()[:200])  # truncated JPEG
    ds = make_dataset(root)
    idx = [str(ds.reader.describe(i)) for i in range(len(ds))].index(str(bad))
    with pytest.raises(CorruptImageError) as err:
        ds[(0, idx)]
    assert (
        str(bad) in err.value.user_message and "dataset.skip_corrupt=true" in err.value.user_message
    )
    ds = make_dataset(root, skip_corrupt=True)
    batch = collate([ds[(0, i)] for i in range(len(ds))])
    assert batch["skipped"] == 1 and batch["image"].shape[0] == len(ds) - 1


def test_worker_error_message_is_recovered(tmp_path):
    root = make_image_folder(tmp_path / "d", classes=("a",), per_split=(2, 1))
    bad = root / "train" / "a" / "a_000.jpg"
    bad.write_bytes(b"not a jpeg at all")
    loader = build_test_loader("loader.num_workers=1", folder=root, batch_size=2)
    loader.set_epoch(0)
    with pytest.raises(CorruptImageError) as err:
        next(iter(loader))
    assert "DataLoader worker" in str(err.value)  # torch re-wrapped it...
    assert err.value.user_message.startswith(f"cannot decode image {bad}")  # ...we unwrap it


@pytest.mark.parametrize("normalize_on", ["device", "cpu"])
def test_workers_and_normalisation_place_do_not_change_the_batches(tmp_path, normalize_on):
    root = make_image_folder(tmp_path / "d", per_split=(5, 1))

    def batches(workers, where):
        loader = build_test_loader(
            "dataset.mean=[0.5,0.4,0.3]",
            "dataset.std=[0.2,0.2,0.2]",
            f"loader.num_workers={workers}",
            f"loader.normalize_on={where}",
            folder=root,
        )
        loader.set_epoch(2)
        return [b["image"] for b in loader]

    ref = batches(0, "device")
    other = batches(2, normalize_on)
    assert len(ref) == len(other) == 3  # 15 images, batch 4, drop_last
    for a, b in zip(ref, other, strict=True):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_worker_collate_stacks_into_shared_memory(monkeypatch):
    """In a DataLoader worker the batch is built in shared memory (no extra copy when it is
    sent to the main process), with the same values as torch.stack."""
    from fastload.data.batch import stack_images

    rng = np.random.default_rng(0)
    imgs = [torch.from_numpy(rng.integers(0, 255, (8, 6, 3), dtype=np.uint8)).permute(2, 0, 1)]
    imgs = imgs * 3
    assert not stack_images(imgs).is_shared()
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())
    for batch_in in (imgs, [x.float().contiguous() for x in imgs]):
        got = stack_images(batch_in)
        assert got.is_shared() and torch.equal(got, torch.stack(batch_in))
