"""storage=disk|tmpfs|lmdb|shards: same samples, atomic staging, packs, integrity, hooks."""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import re
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    NOBODY,
    REPO,
    as_another_user,
    can_mount_privately,
    in_other_pid_namespace,
    make_image_folder,
    run_torchrun,
    run_train,
    tiny_overrides,
)

from fastload import atomic
from fastload.atomic import temp_path
from fastload.data import rawimage
from fastload.data.batch import collate
from fastload.data.dataset import ImageDataset
from fastload.data.transforms import RandomResizedCropFlip
from fastload.decode.pil import PILBackend, open_rgb
from fastload.errors import ConfigError, DatasetError, StorageError
from fastload.host import pid_alive
from fastload.pack import main as pack_main
from fastload.storage import base as storage_base
from fastload.storage import tmpfs
from fastload.storage.disk import DiskStorage
from fastload.storage.lmdb_store import LmdbStorage
from fastload.storage.packing import pack_split
from fastload.storage.shards import ShardStorage
from fastload.storage.webdataset import WebDatasetStorage
from tests.helpers import sample, targets


@pytest.fixture(scope="module")
def packs(tiny_folder, tmp_path_factory):
    """Every pack of the tiny folder, built once through the CLI."""
    out = tmp_path_factory.mktemp("packs")
    assert pack_main(["lmdb", str(tiny_folder), str(out / "lmdb")]) == 0
    assert pack_main(["shards", str(tiny_folder), str(out / "sj")]) == 0
    assert pack_main(["shards", str(tiny_folder), str(out / "sj64"), "--max-side", "64"]) == 0
    assert pack_main(["shards", str(tiny_folder), str(out / "sr"), "--kind", "raw"]) == 0
    return out


def open_store(kind, root, split, packs):
    if kind == "disk":
        return DiskStorage().open(root, split)
    if kind == "lmdb":
        return LmdbStorage(path=packs / "lmdb", auto_pack=False).open(root, split)
    return ShardStorage(path=packs / kind, auto_pack=False).open(root, split)


@pytest.mark.parametrize("kind", ["lmdb", "sj"])
@pytest.mark.parametrize("split", ["train", "val"])
def test_packed_stores_give_the_disk_bytes_and_targets(tiny_folder, packs, kind, split):
    disk = DiskStorage().open(tiny_folder, split)
    store = open_store(kind, tiny_folder, split, packs)
    assert len(store) == len(disk) and store.classes == disk.classes
    assert targets(store).dtype == np.int64 and np.array_equal(targets(store), targets(disk))
    for i in range(len(disk)):
        assert sample(store, i) == sample(disk, i), (i, store.describe(i))
    assert disk.index.name(3) in store.describe(3)  # errors name the source file


def test_tmpfs_stage_gives_the_disk_bytes_and_targets(tiny_folder, tmp_path):
    target = tmp_path / "shm"
    store = tmpfs.TmpfsStorage(target_dir=target)
    store.prepare(tiny_folder, ["train", "val"])
    for split in ("train", "val"):
        disk, staged = DiskStorage().open(tiny_folder, split), store.open(tiny_folder, split)
        assert staged.describe(0).startswith(str(target))
        assert np.array_equal(targets(staged), targets(disk)) and staged.classes == disk.classes
        assert [sample(staged, i) for i in range(len(disk))] == [
            sample(disk, i) for i in range(len(disk))
        ]


def test_tmpfs_stage_keeps_empty_and_linked_class_folders(tmp_path):
    """Class indices come from the class folders: the staged copy has every one storage=disk
    indexes (an empty one, one linking to another class, a val class linking to train's),
    so the classes and targets are the same."""
    root = make_image_folder(tmp_path / "data", ("a", "c"), per_split=(2, 1), size=(16, 12))
    (root / "train" / "b").mkdir()  # no images yet
    (root / "train" / "d").symlink_to(root / "train" / "a")  # indexed once, under a
    for f in (root / "val" / "c").iterdir():
        f.unlink()
    (root / "val" / "c").rmdir()
    (root / "val" / "c").symlink_to(root / "train" / "c")  # val reuses train's images
    store = tmpfs.TmpfsStorage(target_dir=tmp_path / "shm", progress=False)
    store.prepare(root, ["train", "val"])
    for split, classes in (("train", ("a", "b", "c", "d")), ("val", ("a", "c"))):
        disk, staged = DiskStorage().open(root, split), store.open(root, split)
        assert disk.classes == classes and staged.classes == classes
        assert np.array_equal(targets(staged), targets(disk))
        assert [sample(staged, i) for i in range(len(disk))] == [
            sample(disk, i) for i in range(len(disk))
        ]


def test_raw_shards_hold_the_decoded_pixels_and_skip_the_decoder(tiny_folder, packs):
    disk = DiskStorage().open(tiny_folder, "train")
    raw = open_store("sr", tiny_folder, "train", packs)
    assert raw.schema["image"].codec == "pixels" and np.array_equal(targets(raw), targets(disk))
    for i in range(len(disk)):
        data, target = sample(raw, i)
        assert rawimage.is_raw(data) and target == targets(disk)[i]
        # The tiny images are smaller than size=256: stored as decoded, pixel for pixel.
        assert np.array_equal(
            np.asarray(rawimage.to_image(data)), np.asarray(open_rgb(disk.get(i, "image")))
        )

    class NoDecode(PILBackend):  # crops decoded pixels the PIL way, decodes nothing
        def load(self, *a):
            raise AssertionError("the backend must not see raw records")

    tf = RandomResizedCropFlip(24)
    a = ImageDataset(disk, PILBackend(), tf, seed=3)
    b = ImageDataset(raw, NoDecode(), tf, seed=3)
    for key in [(0, 0), (1, 5), (2, 17)]:  # same crop + flip as decoding the JPEG
        assert torch.equal(a[key][0], b[key][0]) and a[key][1] == b[key][1]


def test_raw_records_are_cropped_by_the_backends_own_resize(tiny_folder, packs):
    """backend=turbo crops raw records with OpenCV (its fast path): the same box as the PIL
    crop of the same record, pixels within the backends' PSNR bound (tests/test_backends.py)."""
    from fastload.decode.turbo import TurboBackend

    raw = open_store("sr", tiny_folder, "train", packs)
    tf = RandomResizedCropFlip(24)
    fast = TurboBackend(resize="cv2")
    calls = []
    fast.load_pixels = lambda px, t, rng, f=fast.load_pixels: calls.append(1) or f(px, t, rng)
    a = ImageDataset(raw, TurboBackend(resize="pil"), tf, seed=3)
    b = ImageDataset(raw, fast, tf, seed=3)
    pil_ref = ImageDataset(raw, PILBackend(), tf, seed=3)
    for key in [(0, 0), (1, 5), (2, 17)]:
        assert torch.equal(a[key][0], pil_ref[key][0])  # resize=pil: exactly the PIL crop
        x, y = a[key][0].numpy().astype(np.float64), b[key][0].numpy().astype(np.float64)
        mse = np.mean((x - y) ** 2)
        assert mse == 0 or 10 * np.log10(255**2 / mse) >= 35
    assert len(calls) == 3


def collate_in_worker_slot(samples, monkeypatch) -> torch.Tensor:
    """Collate `samples` as a DataLoader worker with a reused batch slot does; asserts the
    batch went into the slot and returns the slot's image tensor."""
    from fastload.loaders import batch_ring

    nbytes = sum(int(np.prod(s[0].shape)) for s in samples)
    ring = batch_ring.BatchRing(1, 1, nbytes)
    monkeypatch.setattr(batch_ring, "get_worker_info", lambda: type("W", (), {"id": 0}))
    slot = collate(samples, ring=ring)["image"]
    monkeypatch.undo()
    assert isinstance(slot, batch_ring.RingSlot)
    return ring.resolve(slot)


def test_raw_batches_resize_into_the_batch_slot_with_the_items_pixels(
    tiny_folder, packs, monkeypatch
):
    """The loader's batch path over raw shards (`load_batch`): crops are left to collate,
    which resizes each straight into its place in the batch (a reused slot in a worker), and
    the batch is bit-identical to collating the per-item samples; `__getitems__` gives the
    per-item samples."""
    from fastload.data.dataset import PendingCrop
    from fastload.decode.turbo import TurboBackend

    raw = open_store("sr", tiny_folder, "train", packs)
    tf = RandomResizedCropFlip(24)  # 96x72 records: boxes from 7 to 96 px, some averaged first
    keys = [(e, i) for e in (1, 2) for i in range(len(raw))]
    for backend in (TurboBackend(resize="cv2"), TurboBackend(resize="pil"), PILBackend()):
        ds = ImageDataset(raw, backend, tf, seed=3)
        items = [ds[k] for k in keys]
        lazy = ds.load_batch(keys)
        assert all(isinstance(s[0], PendingCrop) for s in lazy)
        assert all(
            torch.equal(a[0], b[0]) and a[1:] == b[1:]
            for a, b in zip(ds.__getitems__(keys), items, strict=True)
        )
        want = collate(items)
        got = collate(lazy)
        assert torch.equal(got["image"], want["image"]), type(backend).__name__
        assert torch.equal(got["target"], want["target"])
        # In a worker with a reused slot: written into the slot, same pixels.
        assert torch.equal(collate_in_worker_slot(ds.load_batch(keys), monkeypatch), want["image"])
    # A normalising dataset (float batches) keeps the per-item path.
    norm = ImageDataset(raw, PILBackend(), tf, seed=3, normalize=lambda x: x.float())
    assert not norm.crops_in_place and torch.is_tensor(norm.load_batch(keys[:2])[0][0])


def test_raw_shard_loader_batches_match_the_items(tiny_folder, packs):
    """Through the product loader (2 workers, reused slots, the batch path): the same batches
    as the dataset's items collated in the main process."""
    from conftest import build_test_loader

    loader = build_test_loader(
        "storage=shards",
        "storage.kind=raw",
        f"storage.path={packs / 'sr'}",
        "storage.auto_pack=false",
        "backend=turbo",
        "loader.num_workers=2",
        "loader.persistent_workers=false",
        "loader.cross_epoch=false",
        folder=tiny_folder,
        batch_size=4,
    )
    loader.set_epoch(1)
    batches = [(b["image"].clone(), b["target"].clone()) for b in loader.host_batches()]
    ds = loader.dataset
    keys = loader.sampler.epoch_keys(1)
    hits = loader.ring_stats()["ring_hits"]
    assert hits == len(batches) >= 3
    for n, (image, target) in enumerate(batches):
        want = collate([ds[k] for k in keys[n * 4 : (n + 1) * 4]])
        assert torch.equal(image, want["image"]) and torch.equal(target, want["target"])


def test_reencoded_shards_respect_max_side(tiny_folder, packs):
    store = open_store("sj64", tiny_folder, "train", packs)
    sides = [max(open_rgb(store.get(i, "image")).size) for i in range(len(store))]
    assert set(sides) == {64} and store.meta["params"]["max_side"] == 64  # tiny: 96x72


def test_lmdb_map_grows_while_packing(tiny_folder, tmp_path):
    store = LmdbStorage(path=tmp_path, initial_map_size=32 << 10)
    meta = pack_split(store.writer, tiny_folder / "train", tmp_path / "train", progress=False)
    total = sum(p.stat().st_size for p in (tiny_folder / "train").rglob("*.jpg"))
    assert total > 32 << 10 and meta["map_growths"] >= 1, meta
    store = store.open(tiny_folder, "train")  # path holds one folder per split
    disk = DiskStorage().open(tiny_folder, "train")
    assert [sample(store, i) for i in range(len(disk))] == [
        sample(disk, i) for i in range(len(disk))
    ]
    assert meta["count"] == len(disk) and meta["checksum"].startswith("crc32:")


@pytest.mark.parametrize("kind", ["lmdb", "sr"])
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_readers_under_fork_and_spawn_workers(tiny_folder, packs, kind, context):
    store = open_store(kind, tiny_folder, "train", packs)
    sample(store, 0)  # a handle opened in the parent must not travel to the workers
    assert sample(pickle.loads(pickle.dumps(store)), 1) == sample(store, 1)
    tf = RandomResizedCropFlip(24)
    ref = ImageDataset(DiskStorage().open(tiny_folder, "train"), PILBackend(), tf, seed=0)
    data = ImageDataset(store, PILBackend(), tf, seed=0)
    loader = torch.utils.data.DataLoader(
        data, batch_size=4, num_workers=2, collate_fn=collate, multiprocessing_context=context
    )
    got = torch.cat([b["image"] for b in loader])
    want = torch.stack([ref[i][0] for i in range(len(ref))])
    assert torch.equal(got, want)
    stats = store.epoch_stats()  # workers' reads are counted in the parent
    assert stats["read_mb"] > 0 and stats["read_s"] > 0


def test_each_epoch_row_counts_the_reads_of_its_own_samples(tmp_path):
    """loader.cross_epoch (the default) has the workers read the next epoch's first batches
    while this one ends and evaluates: they were counted in this epoch's read_mb (then
    reset), so the first epoch read more than the split and the last less."""
    root = make_image_folder(tmp_path / "d")
    run_dir = tmp_path / "out" / "run"
    out = run_train(tiny_overrides(root, run_dir, "trainer.epochs=3", "loader.num_workers=1"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    split_mb = sum(p.stat().st_size for p in (root / "train").rglob("*.jpg")) / 1e6
    first = rows[0]["read_mb"]  # the samples each epoch trains (whole batches of the split)
    assert 0.5 * split_mb < first <= split_mb
    assert [r["read_mb"] for r in rows] == pytest.approx([first] * 3, rel=0.1)  # was 3:2:1


def test_corrupt_shard_byte_names_file_and_record(tiny_folder, packs, tmp_path):
    import shutil

    shutil.copytree(packs / "sj", tmp_path / "sj")
    shard = tmp_path / "sj" / "train" / "shard-00000.bin"
    idx = np.load(tmp_path / "sj" / "train" / "index.npy")
    with open(shard, "r+b") as f:
        f.seek(int(idx["image.offset"][7]) + 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    store = ShardStorage(path=tmp_path / "sj", auto_pack=False).open(tiny_folder, "train")
    sample(store, 6)
    with pytest.raises(StorageError, match=rf"{shard} record 7 .*xxh3_64.*fastload.pack verify"):
        sample(store, 7)
    assert pack_main(["verify", str(tmp_path / "sj")]) == 1


def flip_byte_of(path, data: bytes, at: int = -100) -> None:
    """Flip one byte of `data` (a record's bytes) where it sits in the file `path` (in every
    copy: LMDB may keep a stale one in a free page)."""
    blob, piece = bytearray(path.read_bytes()), data[at : at + 32 or None]
    where = blob.find(piece)
    assert where >= 0
    while where >= 0:
        blob[where + 10] ^= 0xFF
        where = blob.find(piece, where + 1)
    path.write_bytes(bytes(blob))


def test_verify_checks_every_shard_and_lmdb_split_and_says_so(packs, capsys):
    assert pack_main(["verify", str(packs)]) == 0
    lines = capsys.readouterr().out.splitlines()
    want = [
        f"checked {packs / name / split}: {n} records, ok"
        for name in ("lmdb", "sj", "sj64", "sr")
        for split, n in (("train", 18), ("val", 9))
    ]
    assert lines == want
    assert pack_main(["verify", str(packs / "lmdb" / "val")]) == 0  # one split
    assert capsys.readouterr().out.splitlines() == [want[1]]


def test_verify_refuses_a_path_without_a_pack(tiny_folder, tmp_path, capsys):
    assert pack_main(["verify", str(tmp_path / "nonexistent")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'nonexistent'} does not exist") and "DST" in err
    (tmp_path / "empty").mkdir()
    for folder in (tiny_folder, tmp_path / "empty"):  # a plain image folder, an empty one
        assert pack_main(["verify", str(folder)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: no pack in {folder}") and len(err.splitlines()) == 1
        assert "meta.json" in err and "data.mdb" in err


@pytest.mark.parametrize("kind", ["lmdb", "sj"])
def test_verify_names_the_damaged_record(tiny_folder, packs, tmp_path, kind, capsys):
    import shutil

    shutil.copytree(packs / kind, tmp_path / kind)
    disk = DiskStorage().open(tiny_folder, "train")
    store_file = "data.mdb" if kind == "lmdb" else "shard-00000.bin"
    flip_byte_of(tmp_path / kind / "train" / store_file, disk.get(7, "image"))
    assert pack_main(["verify", str(tmp_path / kind)]) == 1
    out, err = capsys.readouterr()
    assert f"checked {tmp_path / kind / 'train'}: 18 records, " in out and "problem" in out
    assert f"checked {tmp_path / kind / 'val'}: 9 records, ok" in out
    assert disk.index.name(7) in err and "CORRUPT" in err
    assert ("record 7 (image crc32" if kind == "lmdb" else "xxh3_64 check: record 7 (") in err
    if kind == "lmdb":
        assert "the pack's checksum" in err  # the overall crc32 of all image bytes


def edit_label_column(split: Path, fmt: str, edit) -> None:
    """Apply `edit(labels, meta)` to a pack's label column and metadata, in place."""
    if fmt == "shards":
        index = np.load(split / "index.npy")
        meta = json.loads((split / "meta.json").read_text())
        edit(index["label"], meta)
        np.save(split / "index.npy", index)
        (split / "meta.json").write_text(json.dumps(meta))
        return
    import lmdb

    env = lmdb.open(str(split), subdir=True)
    with env.begin(write=True) as txn:
        labels = np.frombuffer(txn.get(b"__column__.label"), "<i8").copy()
        meta = json.loads(txn.get(b"__meta__"))
        edit(labels, meta)
        txn.put(b"__column__.label", labels.tobytes())
        txn.put(b"__meta__", json.dumps(meta).encode())
    env.close()


@pytest.mark.parametrize("fmt", ["lmdb", "shards"])
def test_a_changed_label_fails_verify_and_open(tiny_folder, tmp_path, fmt, capsys):
    """The labels (an int column: shards' index.npy, LMDB's __column__.label) carried no
    checksum: a label changed from 0 to 2 was verified "ok" and trained on."""
    pack = tmp_path / "p"
    assert pack_main([fmt, str(tiny_folder), str(pack), "--splits", "val"]) == 0

    def relabel(labels, meta):
        assert labels[0] == 0
        labels[0] = 2

    edit_label_column(pack / "val", fmt, relabel)
    capsys.readouterr()
    assert pack_main(["verify", str(pack)]) == 1
    out, err = capsys.readouterr()
    assert f"checked {pack / 'val'}: 9 records, 1 problem(s)" in out
    assert "CORRUPT" in err and "its label column fails its" in err
    store = (LmdbStorage if fmt == "lmdb" else ShardStorage)(path=pack, auto_pack=False)
    with pytest.raises(StorageError, match="its label column fails its .* check"):
        store.open(tiny_folder, "val")


@pytest.mark.parametrize("fmt", ["lmdb", "shards"])
def test_a_pack_without_column_checksums_verifies_with_a_note_and_opens(
    tiny_folder, tmp_path, fmt, capsys
):
    """A pack written before the int columns had a checksum: verify says they were not
    checked (not damage: exit 0) and training reads it as before."""
    pack = tmp_path / "p"
    assert pack_main([fmt, str(tiny_folder), str(pack), "--splits", "val"]) == 0
    edit_label_column(pack / "val", fmt, lambda labels, meta: meta.pop("column_checks"))
    capsys.readouterr()
    assert pack_main(["verify", str(pack)]) == 0
    assert capsys.readouterr().out == (
        f"checked {pack / 'val'}: 9 records, ok; its label column carries no checksum (packed "
        f"by an earlier fastload), so it was not checked; re-pack to have it checked\n"
    )
    store = (LmdbStorage if fmt == "lmdb" else ShardStorage)(path=pack, auto_pack=False)
    reader = store.open(tiny_folder, "val")
    assert [reader.get(i, "label") for i in range(len(reader))] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


@pytest.mark.parametrize("fmt", ["lmdb", "shards"])
def test_verify_checks_paired_records_and_boxes(tmp_path, fmt, capsys):
    hr, lr = make_div2k(tmp_path / "div2k")
    out = tmp_path / "div2k-pack"
    args = [fmt, str(out), "--source", "div2k", "--hr", str(hr), "--lr", str(lr)]
    assert pack_main([*args, "--scale", "2"]) == 0
    ann, images = make_coco(tmp_path / "coco")
    coco = tmp_path / "coco-pack"
    args = [fmt, str(coco), "--source", "coco", "--annotations", str(ann), "--images", str(images)]
    assert pack_main(args) == 0
    capsys.readouterr()
    assert pack_main(["verify", str(out)]) == 0 and pack_main(["verify", str(coco)]) == 0
    assert "checked" in capsys.readouterr().out
    store_file = "data.mdb" if fmt == "lmdb" else "shard-00000.bin"
    flip_byte_of(out / "DIV2K_train_HR" / store_file, (lr / "0002x2.png").read_bytes())
    assert pack_main(["verify", str(out)]) == 1
    want = "record 1 (lr crc32" if fmt == "lmdb" else "field lr of record 1"
    assert want in capsys.readouterr().err
    # boxes are a field with their own checksum, in every store
    boxes = np.array([10.0, 20.0, 30.5, 40.0, 60.0, 0.0, 50.0, 70.0], "<f4").tobytes()
    flip_byte_of(coco / "train2017" / store_file, boxes, at=0)
    assert pack_main(["verify", str(coco)]) == 1
    want = "record 2 (boxes crc32" if fmt == "lmdb" else "field boxes of record 2"
    assert want in capsys.readouterr().err


def test_a_pack_of_an_earlier_format_is_refused_or_re_packed(tiny_folder, packs, tmp_path):
    """A pack written before records had named fields (one image and one target per record)
    is never read as if it had them: open refuses it with the re-pack advice, prepare
    without auto_pack names why it is out of date, with auto_pack it is re-packed."""
    import shutil

    from fastload.storage import shards
    from fastload.storage.packing import SIDECAR

    shutil.copytree(packs / "sj", tmp_path / "sj")
    split = tmp_path / "sj" / "train"
    meta = json.loads((split / "meta.json").read_text())
    assert meta["version"] == shards.VERSION == 3 and meta["record_checksum"] == "xxh3_64"
    meta["version"] = 2
    del meta["schema"]
    (split / "meta.json").write_text(json.dumps(meta))
    sidecar = json.loads((split / SIDECAR).read_text())
    del sidecar["schema"]
    (split / SIDECAR).write_text(json.dumps(sidecar))

    old = ShardStorage(path=tmp_path / "sj", auto_pack=False)
    with pytest.raises(StorageError, match=r"\(v3; it says fastload-shards v2\).*re-pack"):
        old.open(tiny_folder, "train")
    with pytest.raises(StorageError, match=r"out of date: it was packed by an older fastload"):
        old.prepare(tiny_folder, ["train"])
    ShardStorage(path=tmp_path / "sj").prepare(tiny_folder, ["train"])
    disk = DiskStorage().open(tiny_folder, "train")
    store = old.open(tiny_folder, "train")
    assert [sample(store, i) for i in range(len(disk))] == [
        sample(disk, i) for i in range(len(disk))
    ]


def test_truncated_shard_is_refused_at_open_with_file_and_record(tiny_folder, packs, tmp_path):
    import shutil

    shutil.copytree(packs / "sj", tmp_path / "sj")
    shard = tmp_path / "sj" / "train" / "shard-00000.bin"
    idx = np.load(tmp_path / "sj" / "train" / "index.npy")
    os.truncate(shard, int(idx["image.offset"][11]) + 10)
    with pytest.raises(StorageError, match=rf"{shard} is truncated.*first damaged record: 11"):
        ShardStorage(path=tmp_path / "sj", auto_pack=False).open(tiny_folder, "train")


def test_missing_pack_gives_the_pack_command(tiny_folder, tmp_path):
    with pytest.raises(
        StorageError, match=r"python -m fastload.pack shards .* --kind raw --size 128"
    ):
        ShardStorage(path=tmp_path / "none", kind="raw", size=128, auto_pack=False).open(
            tiny_folder, "train"
        )
    with pytest.raises(StorageError, match=r"python -m fastload.pack lmdb "):
        LmdbStorage(path=tmp_path / "none", auto_pack=False).open(tiny_folder, "train")


def test_a_relative_root_finds_its_pack_current(tmp_path, monkeypatch, caplog):
    """dataset.root=ds and /abs/ds are one dataset: the pack made from one is current for
    the other (the digest took the paths as spelled, and re-packed)."""
    make_image_folder(tmp_path / "ds", per_split=(2, 1))
    monkeypatch.chdir(tmp_path)
    store = ShardStorage(path=tmp_path / "packs")
    store.prepare(str(tmp_path / "ds"), ["train"])
    caplog.clear()
    with caplog.at_level("WARNING"):
        store.prepare("ds", ["train"])
    assert "re-packing" not in caplog.text


def test_every_spelling_of_the_source_finds_its_pack_current(tmp_path, monkeypatch, capsys, caplog):
    """The source through a symlink or with `..` in it re-packed the whole dataset, said to
    have "changed since it was packed": the digest took the paths as spelled."""
    root = make_image_folder(tmp_path / "data" / "ds", per_split=(2, 1))
    (tmp_path / "link").symlink_to(root)
    monkeypatch.chdir(tmp_path / "data")
    pack = tmp_path / "p"
    assert pack_main(["shards", str(root), str(pack)]) == 0
    for spelling in ("ds", "../data/ds", str(tmp_path / "link")):
        capsys.readouterr()
        assert pack_main(["shards", spelling, str(pack)]) == 0
        assert capsys.readouterr().out.count("exists and matches its source: skipped") == 2
    store = ShardStorage(path=pack)  # train.py's auto-pack: dataset.root through the link
    caplog.clear()
    with caplog.at_level("INFO", logger="fastload"):
        store.prepare(str(tmp_path / "link"), ["train", "val"])
    assert "re-packing" not in caplog.text and "packed" not in caplog.text


def test_a_pack_whose_digest_took_the_paths_as_spelled_stays_current(tmp_path):
    """Packs written before the digest took real paths: current for the spelling they were
    packed from, not re-packed."""
    from fastload.data.sources import ImageFolderSource
    from fastload.storage.packing import SIDECAR, source_digest, stale_reason

    root = make_image_folder(tmp_path / "ds", per_split=(2, 1))
    (tmp_path / "link").symlink_to(root)
    store = ShardStorage(path=tmp_path / "p")
    store.prepare(str(tmp_path / "link"), ["val"])
    sidecar = tmp_path / "p" / "val" / SIDECAR
    record = json.loads(sidecar.read_text())
    source = ImageFolderSource(tmp_path / "link" / "val")
    records = [source.record(i) for i in range(len(source))]
    del record["source_paths"]
    record["source_digest"] = source_digest(records, source, real_paths=False)[0]
    sidecar.write_text(json.dumps(record))
    assert stale_reason(tmp_path / "link" / "val", sidecar.parent, store.pack_options()) is None


def former_source_digest(records, source, real_paths=True):
    """source_digest as it was written when packs first recorded real paths: what every
    existing pack's sidecar holds, so any faster digest must give its value."""
    import xxhash

    from fastload.data.records import ImageFile

    h, total = xxhash.xxh3_128(), 0
    h.update(f"{source.kind}\0{len(records)}\0{','.join(source.schema.names)}\n".encode())

    def canonical(path):
        folder, name = os.path.split(path)
        return os.path.join(os.path.realpath(folder), name) if real_paths else path

    for r in records:
        for value in r.values():
            if isinstance(value, ImageFile):
                st = os.stat(value.path)
                total += st.st_size
                stated = f"\0{value.stated[0]}x{value.stated[1]}" if value.stated else ""
                h.update(
                    os.fsencode(canonical(value.path))
                    + f"\0{st.st_size}\0{st.st_mtime_ns}{stated}\n".encode()
                )
            elif isinstance(value, np.ndarray):
                h.update(
                    f"{value.dtype}{value.shape}".encode() + np.ascontiguousarray(value).tobytes()
                )
            else:
                h.update(f"{value!r}\n".encode())
    return h.hexdigest(), total


def test_the_digest_read_from_the_source_is_the_digest_packs_hold(tmp_path, monkeypatch):
    """The staleness check digests the source field by field, DIGEST_CHUNK records at a
    time, without building its records: every pack made before must stay current, so it
    equals the digest of the records for an image folder (spelled through a link or not,
    over several chunks), COCO (boxes, labels, stated sizes) and DIV2K pairs."""
    from fastload.data.sources import CocoSource, Div2kSource, ImageFolderSource
    from fastload.storage import packing

    monkeypatch.setattr(packing, "DIGEST_CHUNK", 4)
    root = make_image_folder(tmp_path / "ds", per_split=(5, 1))
    (tmp_path / "link").symlink_to(root)
    hr, lr = make_div2k(tmp_path / "div2k")
    sources = [
        ImageFolderSource(root / "train"),
        ImageFolderSource(tmp_path / "link" / "train"),
        CocoSource(*make_coco(tmp_path / "coco")),
        Div2kSource(hr, lr, 2),
        Div2kSource(hr),
    ]
    for source in sources:
        records = [source.record(i) for i in range(len(source))]
        for real_paths in (True, False):
            want = former_source_digest(records, source, real_paths)
            assert packing.source_digest(records, source, real_paths) == want
            assert packing.source_digest(None, source, real_paths) == want
    assert len(sources[0]) == 15 and sources[2].stated(0, "image") == (64, 48)


def test_a_file_rewritten_added_removed_or_moved_makes_an_image_folder_pack_out_of_date(
    tmp_path,
):
    from fastload.storage.packing import stale_reason

    root = make_image_folder(tmp_path / "ds", per_split=(3, 1))
    store = ShardStorage(path=tmp_path / "p")
    store.prepare(str(root), ["train"])
    pack, split = tmp_path / "p" / "train", root / "train"

    def stale() -> str | None:
        return stale_reason(split, pack, store.pack_options())

    assert stale() is None
    first = split / "cat" / "cat_000.jpg"
    data, stat_ = first.read_bytes(), first.stat()
    edits = [  # (make the change, undo it)
        (lambda: first.write_bytes(data + b"\0"), lambda: first.write_bytes(data)),
        (lambda: os.utime(first, ns=(stat_.st_atime_ns, stat_.st_mtime_ns + 10**9)), None),
        (lambda: (split / "dog" / "new.jpg").write_bytes(data),
         lambda: (split / "dog" / "new.jpg").unlink()),
        (lambda: first.unlink(), lambda: first.write_bytes(data)),
        (lambda: first.rename(split / "dog" / first.name),
         lambda: (split / "dog" / first.name).rename(first)),
    ]  # fmt: skip
    for change, undo in edits:
        change()
        assert "changed since it was packed" in stale()
        if undo:
            undo()
        os.utime(first, ns=(stat_.st_atime_ns, stat_.st_mtime_ns))
        assert stale() is None


def test_a_class_added_without_images_makes_a_pack_out_of_date(tmp_path, caplog):
    """A class folder added after the last one (still empty) leaves every path and label as
    they were, so the digest is the same: the pack kept the old classes, and the run's
    num_classes check blamed the config."""
    root = make_image_folder(tmp_path / "ds", classes=("cat", "dog"), per_split=(2, 1))
    store = LmdbStorage(path=tmp_path / "packs")
    store.prepare(str(root), ["train"])
    (root / "train" / "zebra").mkdir()
    with caplog.at_level("WARNING"):
        store.prepare(str(root), ["train"])
    assert "the classes of" in caplog.text
    assert store.open(str(root), "train").classes == ("cat", "dog", "zebra")


def test_a_file_that_cannot_be_read_stops_the_pack_even_with_skip_corrupt(tmp_path, monkeypatch):
    """Permission denied or an I/O error is not a corrupt image: left out, it would stay out
    once mended (its size and time unchanged, the pack found current)."""
    from fastload.storage import packing

    root = make_image_folder(tmp_path / "ds", per_split=(2, 1))
    bad = sorted((root / "train" / "cat").iterdir())[0]
    real_open = open

    def denied(path, *a, **k):
        if str(path) == str(bad):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(packing, "open", denied, raising=False)
    with pytest.raises(StorageError, match=rf"cannot read {bad} while packing .*Permission"):
        pack_split(ShardStorage().writer, root / "train", tmp_path / "p", progress=False,
                   workers=1, skip_corrupt=True)  # fmt: skip
    assert not (tmp_path / "p").exists()


def test_a_dangling_image_link_is_named_not_reported_as_an_unwritable_pack(tmp_path):
    root = make_image_folder(tmp_path / "ds", per_split=(2, 1))
    link = root / "train" / "cat" / "gone.jpg"
    link.symlink_to(tmp_path / "nowhere.jpg")
    for store in (ShardStorage(path=tmp_path / "s"), LmdbStorage(path=tmp_path / "l")):
        with pytest.raises(StorageError, match=rf"cannot read {link} while packing .*Restore"):
            store.prepare(str(root), ["train"])  # was: "cannot write there ... storage.path"


def test_a_file_name_that_is_not_utf8_packs(tmp_path):
    """File names are bytes to the OS; Python hands a non-UTF-8 one over surrogate-escaped,
    which str.encode() refused: every pack stopped with a bare UnicodeEncodeError."""
    root = make_image_folder(tmp_path / "ds", classes=("cat", "dog"), per_split=(1, 1))
    cat = root / "train" / "cat"
    name = os.fsencode(cat) + b"/caf\xe9.jpg"  # Latin-1, as an old archive may hold
    with open(name, "wb") as f:
        f.write(next(cat.iterdir()).read_bytes())
    want = len(DiskStorage().open(str(root), "train"))
    assert want == 3
    for store in (ShardStorage(path=tmp_path / "s"), LmdbStorage(path=tmp_path / "l")):
        store.prepare(str(root), ["train"])
        assert len(store.open(str(root), "train")) == want


def test_a_full_disk_under_lmdb_is_the_no_space_message(tmp_path, monkeypatch):
    """LMDB reports a full disk at its commit as its own error ("Input/output error")."""
    import lmdb

    root = make_image_folder(tmp_path / "ds", per_split=(2, 1))

    class FullEnv:
        def __init__(self, env):
            self.env = env

        def begin(self, write=False):
            raise lmdb.Error("mdb_txn_commit: Input/output error")

        def __getattr__(self, name):
            return getattr(self.env, name)

    real_open = lmdb.open
    monkeypatch.setattr(lmdb, "open", lambda *a, **k: FullEnv(real_open(*a, **k)))
    import shutil

    free = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: free._replace(free=4096))
    with pytest.raises(StorageError, match="no space left to write the pack"):
        pack_split(LmdbStorage().writer, root / "train", tmp_path / "p", progress=False)
    assert not (tmp_path / "p").exists()


def test_a_pack_of_another_format_in_the_folder_is_replaced(tiny_folder, tmp_path, capsys):
    """pack shards into a folder holding an LMDB pack said "matches: skipped", and the run
    then found no shards pack there."""
    assert pack_main(["lmdb", str(tiny_folder), str(tmp_path / "p"), "--splits", "train"]) == 0
    assert pack_main(["shards", str(tiny_folder), str(tmp_path / "p"), "--splits", "train"]) == 0
    assert "another format" in capsys.readouterr().out
    assert (tmp_path / "p" / "train" / "meta.json").is_file()
    LmdbStorage(path=tmp_path / "p").prepare(tiny_folder, ["train"])  # and back, by a run
    assert (tmp_path / "p" / "train" / "data.mdb").is_file()


def test_a_source_that_is_no_image_folder_now_is_not_trained_from_its_old_pack(tmp_path):
    """A split folder still there whose images were all deleted (or converted, or its classes
    reorganised): storage=disk refuses it, but a pack of it was used as "a pack whose source
    is not here", training on data the source no longer holds."""
    root = make_image_folder(tmp_path / "d", per_split=(2, 1))
    store = ShardStorage(path=tmp_path / "p")
    store.prepare(root, ["train"])
    for image in (root / "train").rglob("*.jpg"):
        image.unlink()
    with pytest.raises(DatasetError, match="has class folders .* but no image files"):
        store.prepare(root, ["train"])
    assert len(store.open(root, "train")) == 6  # the old pack is left as it was
    shutil.rmtree(root / "train")  # a pack whose source is elsewhere is still used
    store.prepare(root, ["train"])


def test_an_unreadable_folder_in_a_split_is_named_not_skipped(tmp_path, monkeypatch):
    """os.walk skips a folder it cannot read without a word: its images (or, for a class
    folder, the whole class; under storage=tmpfs the class itself) went missing in every
    storage. (The tests run as root, who reads everything: the refusal is simulated.)"""
    from fastload.data.folder import index_image_folder

    root = make_image_folder(tmp_path / "d", per_split=(2, 1))
    more = root / "train" / "dog" / "more"
    more.mkdir()
    shutil.copy(root / "train" / "dog" / "dog_000.jpg", more / "x.jpg")
    real = os.scandir

    def scandir(path="."):
        if os.fspath(path) == str(more):
            raise PermissionError(13, "Permission denied", str(more))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(DatasetError, match=rf"cannot read the folder {more} \(Permission denied"):
        index_image_folder(root / "train")
    with pytest.raises(DatasetError, match="chmod -R u\\+rX"):
        tmpfs.build_manifest(tmpfs.as_layout(root), ["train"])


def test_a_shard_of_empty_records_only_is_read_as_undecodable_samples(tmp_path):
    """Every image of a split a zero-byte file: its shard is an empty file, which mmap
    refuses; the read raised a bare ValueError naming nothing, where every other storage
    skips and counts them."""
    root = make_image_folder(tmp_path / "d", per_split=(1, 1))
    for image in (root / "val").rglob("*.jpg"):
        image.write_bytes(b"")
    store = ShardStorage(path=tmp_path / "p")
    store.prepare(root, ["val"])  # copied as they are (skip_corrupt would leave them out)
    reader = store.open(root, "val")
    assert [bytes(reader.get(i, "image")) for i in range(len(reader))] == [b""] * 3


@pytest.mark.parametrize("options", [[], ["--max-side", "256"]])
def test_skip_corrupt_leaves_undecodable_files_out_of_a_pack_that_copies_them(
    tmp_path, capsys, options
):
    """--skip-corrupt where the pack stores the files as they are (kind jpeg without
    --max-side; with one, JPEGs already that small) decoded none of them: a truncated JPEG,
    an empty .jpg and a text file named .jpg were packed, none listed as left out."""
    root = make_image_folder(tmp_path / "d", per_split=(2, 1))
    cat = root / "train" / "cat"
    bad = [cat / "cut.jpg", cat / "empty.jpg", cat / "text.jpg"]
    whole = (cat / "cat_000.jpg").read_bytes()
    bad[0].write_bytes(whole[: len(whole) // 2])  # its header whole, half its scan
    bad[1].write_bytes(b"")
    bad[2].write_text("not an image")
    dst = tmp_path / "p"
    args = ["shards", str(root), str(dst), "--splits", "train", *options]
    assert pack_main([*args, "--skip-corrupt"]) == 0
    assert "train: 6 records in" in capsys.readouterr().out
    assert json.loads((dst / "train" / "fastload-pack.json").read_text())["skipped"] == [
        str(b) for b in bad
    ]
    disk = DiskStorage().open(root, "train")
    bad_names = {str(b) for b in bad}
    kept = [
        bytes(disk.get(i, "image")) for i in range(len(disk)) if disk.describe(i) not in bad_names
    ]
    reader = ShardStorage(path=dst, auto_pack=False).open(root, "train")
    assert [bytes(reader.get(i, "image")) for i in range(len(reader))] == kept
    if not options:  # without --skip-corrupt a copy stores the files as they are, unread
        shutil.rmtree(dst)
        assert pack_main(args) == 0 and "train: 9 records in" in capsys.readouterr().out


def test_a_folder_holding_other_files_is_not_packed_over(tiny_folder, tmp_path, capsys):
    """A pack replaces its folder: an output folder or storage.path given by mistake (one
    holding the user's files) lost them to the pack, said only as "out of date"."""
    mine = tmp_path / "p" / "train" / "notes.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text("kept")
    assert pack_main(["shards", str(tiny_folder), str(tmp_path / "p"), "--splits", "train"]) == 2
    err = capsys.readouterr().err
    assert f"{mine.parent} holds files that are not a pack (notes.txt)" in err
    with pytest.raises(StorageError, match=r"which holds files that are not a pack \(notes\.txt\)"
                       r".*storage\.path=<a new or empty folder>"):  # fmt: skip
        ShardStorage(path=tmp_path / "p").prepare(tiny_folder, ["train"])
    assert mine.read_text() == "kept" and sorted(mine.parent.iterdir()) == [mine]
    mine.unlink()  # an empty folder is packed into, as is a pack of any format
    assert pack_main(["lmdb", str(tiny_folder), str(tmp_path / "p"), "--splits", "train"]) == 0
    ShardStorage(path=tmp_path / "p").prepare(tiny_folder, ["train"])
    assert (tmp_path / "p" / "train" / "meta.json").is_file()


def test_the_pack_cli_takes_a_root_with_a_flat_test_folder_for_a_root(tmp_path, capsys):
    """ImageNet's test/ holds images, no class folders: the root was packed as one split
    with the classes test, train, val."""
    root = make_image_folder(tmp_path / "imagenet", per_split=(2, 1))
    (root / "test").mkdir()
    (root / "test" / "1.jpg").write_bytes(next((root / "val" / "cat").iterdir()).read_bytes())
    assert pack_main(["shards", str(root), str(tmp_path / "p")]) == 0
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["train", "val"]
    assert f"left out {root / 'test'}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "option",
    [
        ["--max-side", "-5"],
        ["--kind", "raw", "--size", "-5"],
        ["--max-side", "64", "--quality", "150"],
        ["--max-side", "64", "--quality", "0"],
        ["--shard-mb", "0"],
        ["--shard-mb", "-1"],
        ["--workers", "-3"],
    ],
)
def test_the_pack_cli_refuses_numbers_out_of_range(tiny_folder, tmp_path, capsys, option):
    """--max-side -5 stored 1x1 JPEGs and --kind raw --size -5 1x1 arrays, a quality of 150
    or a shard size of 0 were taken as given: every one wrote a useless pack, exit 0."""
    with pytest.raises(SystemExit) as exit_:
        pack_main(["shards", str(tiny_folder), str(tmp_path / "p"), *option])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("error:") == 1
    assert f"error: argument {option[-2]}: {option[-1]!r}: use a whole number" in err
    assert not (tmp_path / "p").exists()


def test_a_bad_destination_or_split_is_refused_before_anything_is_packed(
    tiny_folder, tmp_path, capsys
):
    """DST an existing file ended in a FileExistsError traceback (exit 1); --splits
    train,nope packed train and only then failed on nope."""
    file = tmp_path / "file"
    file.write_text("mine")
    assert pack_main(["shards", str(tiny_folder), str(file)]) == 2
    assert f"error: {file} is a file, not a folder" in capsys.readouterr().err
    assert file.read_text() == "mine"
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "val").write_text("mine")  # DST/<split> a file
    assert pack_main(["lmdb", str(tiny_folder), str(tmp_path / "p")]) == 2
    assert f"error: {tmp_path / 'p' / 'val'} is a file, not a folder" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["val"]  # train not packed
    dst = tmp_path / "q"
    assert pack_main(["shards", str(tiny_folder), str(dst), "--splits", "train,nope"]) == 2
    err = capsys.readouterr().err
    assert f"error: --splits train,nope: {tiny_folder / 'nope'} is not a folder of SRC" in err
    assert "(its folders: train, val)" in err and not dst.exists()


@pytest.mark.parametrize(
    "args, refused",
    [
        (["shards", "SRC", "DST", "--quality", "80"], "--quality does nothing here: it is the "
                                                      "quality of JPEGs re-encoded at --max-side"),
        (["shards", "SRC", "DST", "--kind", "raw", "--max-side", "64"], "--max-side does nothing"),
        (["lmdb", "SRC", "DST", "--kind", "raw", "--quality", "80"], "--quality does nothing"),
        (["shards", "SRC", "DST", "--size", "64"], "--size does nothing here"),
        (["shards", "SRC", "DST", "--shard-samples", "4"], "--shard-samples is an option of "
                                                           "webdataset packs, not shards"),
        (["lmdb", "SRC", "DST", "--shard-mb", "4"], "--shard-mb is an option of shards and "),
        (["shards", "SRC", "DST", "--subset", "3"], "--subset is a --source coco option"),
        (["shards", "SRC", "DST", "--hr", "x"], "--hr is a --source div2k option"),
        (["shards", "DST", "--source", "div2k", "--hr", "x", "--scale", "2"], "--scale does "),
        (["verify", "DST", "SRC"], "verify takes one folder, the pack: SRC is a second one"),
        (["verify", "DST", "--skip-corrupt"], "--skip-corrupt is a packing option"),
    ],
)  # fmt: skip
def test_the_pack_cli_refuses_options_that_would_do_nothing(
    tiny_folder, tmp_path, capsys, args, refused
):
    """--quality without --max-side, --max-side with --kind raw, --shard-samples for shards,
    --subset / --hr without --source, a second folder given to verify: each was taken and
    ignored, the pack (or verify) going on as if it had not been given."""
    where = {"SRC": str(tiny_folder), "DST": str(tmp_path / "p")}
    with pytest.raises(SystemExit) as exit_:
        pack_main([where.get(a, a) for a in args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("error:") == 1
    assert f"error: {refused}".replace("SRC", str(tiny_folder)) in err
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize(
    "store, options, named",
    [
        (ShardStorage, {"max_side": -5}, "storage.max_side=-5"),
        (ShardStorage, {"kind": "raw", "size": 0}, "storage.size=0"),
        (ShardStorage, {"max_side": 256, "quality": 150}, "storage.quality=150"),
        (ShardStorage, {"shard_mb": 0}, "storage.shard_mb=0"),
        (LmdbStorage, {"max_side": 0}, "storage.max_side=0"),
        (LmdbStorage, {"kind": "raw", "size": -5}, "storage.size=-5"),
        (WebDatasetStorage, {"quality": 0}, "storage.quality=0"),
        (WebDatasetStorage, {"shard_samples": -1}, "storage.shard_samples=-1"),
    ],
)
def test_storage_pack_options_out_of_range_are_refused_by_name(store, options, named):
    """train.py's storage.max_side=-5 (or a quality of 150, ...) packed on first use as
    the command line did: 1x1 images, no error."""
    with pytest.raises(ConfigError, match=re.escape(named) + ": use"):
        store(**options)


# -- tmpfs staging -----------------------------------------------------------------------------

_KILL_MIDWAY = """
import os, shutil, signal, sys
from fastload.storage import tmpfs
copied = [0]
real = shutil.copyfile
def copy_then_die(src, dst):
    real(src, dst)
    copied[0] += 1
    if copied[0] == 10:
        os.kill(os.getpid(), signal.SIGKILL)
tmpfs.shutil.copyfile = copy_then_die
tmpfs.stage(sys.argv[1], ["train", "val"], sys.argv[2], threads=1, progress=False)
"""


def test_staging_is_atomic_when_killed_midway_then_restaged(tmp_path):
    root = make_image_folder(tmp_path / "data")
    target = tmp_path / "shm"
    killed = subprocess.run(
        [sys.executable, "-c", _KILL_MIDWAY, str(root), str(target)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    final = tmpfs.staged_root(root, target)
    leftovers = list(final.parent.glob(f".{final.name}.tmp-*"))
    assert not final.exists() and len(leftovers) == 1  # only a partial, never read
    assert len(list(leftovers[0].rglob("*.jpg"))) == 10
    with pytest.raises(StorageError, match="no complete staged copy"):
        tmpfs.TmpfsStorage(target_dir=target).open(root, "train")
    tmpfs.stage(root, ["train", "val"], target, progress=False)
    assert not list(final.parent.glob(f".{final.name}.tmp-*"))  # the stale partial copy is gone
    disk, staged = (
        DiskStorage().open(root, "train"),
        tmpfs.TmpfsStorage(target_dir=target).open(root, "train"),
    )
    assert [sample(staged, i) for i in range(len(disk))] == [
        sample(disk, i) for i in range(len(disk))
    ]


_BUILD_AND_WAIT = """
import sys, time
from pathlib import Path
from fastload import atomic
final, go = Path(sys.argv[1]), Path(sys.argv[2])
with atomic.building(final) as tmp:
    (tmp / "part").write_text("built")
    print(tmp, flush=True)
    while not go.exists():
        time.sleep(0.05)
"""


def test_a_live_build_in_another_pid_namespace_is_not_removed_as_stale(tmp_path):
    """Containers sharing a host name and a volume (a pack, a staged copy, a generated set):
    the other builder's pid names no process here, yet it lives; its temporary folder is
    kept, and it completes."""
    pid = next(p for p in range(20000, 2000, -1) if not pid_alive(p))
    final, go = tmp_path / "cache" / "set", tmp_path / "go"
    other = in_other_pid_namespace(_BUILD_AND_WAIT, str(final), str(go), pid=pid)
    try:
        tmp = Path(other.stdout.readline().strip())
        assert tmp.name.endswith(f"-{pid}") and tmp.exists()
        assert atomic.remove_stale(final) == [] and tmp.exists()
        go.touch()
        assert other.wait(timeout=60) == 0
    finally:
        other.kill()
        other.wait()
    assert (final / "part").read_text() == "built" and not tmp.exists()


def test_a_replaced_copy_left_by_a_dead_process_is_removed_by_the_next_build(tmp_path):
    """A rebuild moves the outdated folder aside (`...-old`) before deleting it, which takes
    a while on a large staged copy or pack: killed then, it was kept for a day (its pid was
    not read), holding RAM on a tmpfs."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    final = tmp_path / "stage" / "set"
    old = temp_path(final, pid=dead.pid).with_name(f"{temp_path(final, pid=dead.pid).name}-old")
    live = temp_path(final, pid=os.getpid()).with_name(f"{temp_path(final).name}-old")
    for folder in (old, live):
        (folder / "train").mkdir(parents=True)
    assert atomic.remove_stale(final) == [old]
    assert not old.exists() and live.exists()


def test_complete_staging_is_reused_and_a_damaged_one_restaged(tmp_path, monkeypatch):
    root = make_image_folder(tmp_path / "data")
    target = tmp_path / "shm"
    final = tmpfs.stage(root, ["train", "val"], target, progress=False)
    calls = []
    real = tmpfs.copy_files
    monkeypatch.setattr(tmpfs, "copy_files", lambda *a: calls.append(1) or real(*a))
    assert tmpfs.stage(root, ["train", "val"], target, progress=False) == final
    assert calls == []  # reused: nothing copied
    victim = next(final.rglob("*.jpg"))
    victim.write_bytes(victim.read_bytes()[:50])  # a damaged staged file
    tmpfs.stage(root, ["train", "val"], target, progress=False)
    assert (
        calls == [1] and victim.stat().st_size == (root / victim.relative_to(final)).stat().st_size
    )


def test_a_source_file_replaced_with_its_size_and_time_put_back_is_restaged(tmp_path, monkeypatch):
    """`cp -p`, `rsync -a`, `touch -r`: other bytes of the same size under the same
    modification time. The staged copy holds the old bytes: it is staged again (the change
    time and inode differ), not reused."""
    root = make_image_folder(tmp_path / "data", ("a", "b"), per_split=(2, 1), size=(16, 12))
    target = tmp_path / "shm"
    final = tmpfs.stage(root, ["train", "val"], target, progress=False, reserve_gb=0)
    victim = root / "train" / "a" / "a_000.jpg"
    st = victim.stat()
    other = bytearray(victim.read_bytes())
    other[-10] ^= 0xFF
    new = victim.with_name("new.tmp")
    new.write_bytes(bytes(other))
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(new, victim)  # as rsync -a puts it in place
    assert (victim.stat().st_size, victim.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert tmpfs.stage(root, ["train", "val"], target, progress=False, reserve_gb=0) == final
    assert (final / "train" / "a" / "a_000.jpg").read_bytes() == bytes(other)
    # rewritten in place (the same inode), its time put back: the change time tells
    other[-11] ^= 0xFF
    victim.write_bytes(bytes(other))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    tmpfs.stage(root, ["train", "val"], target, progress=False, reserve_gb=0)
    assert (final / "train" / "a" / "a_000.jpg").read_bytes() == bytes(other)


def test_a_copy_staged_with_an_earlier_manifest_is_restaged_once(tmp_path, monkeypatch):
    """A copy whose manifest lists size and modification time alone (staged by an earlier
    version) cannot tell a replaced file: it is staged again, once, then reused."""
    root = make_image_folder(tmp_path / "data", ("a", "b"), per_split=(2, 1), size=(16, 12))
    target = tmp_path / "shm"
    final = tmpfs.stage(root, ["train", "val"], target, progress=False, reserve_gb=0)
    manifest = json.loads((final / tmpfs.MANIFEST).read_text())
    manifest["files"] = [f[:3] for f in manifest["files"]]
    (final / tmpfs.MANIFEST).write_text(json.dumps(manifest))
    calls = []
    real = tmpfs.copy_files
    monkeypatch.setattr(tmpfs, "copy_files", lambda *a: calls.append(1) or real(*a))
    for _ in range(2):
        assert tmpfs.stage(root, ["train", "val"], target, progress=False, reserve_gb=0) == final
    assert calls == [1] and not list(target.glob(".*"))


@pytest.mark.parametrize("change", ["size", "mode", "replaced", "added", "removed", "folder"])
def test_a_copy_is_reused_for_any_order_or_subset_of_its_splits_until_the_source_changes(
    tmp_path, monkeypatch, change
):
    """Reused whichever order the splits come in, or a part of them; staged again when the
    last file listed changes (its size; its change time alone, by a chmod; its inode and
    change time, by the same bytes put in its place with its time), a file is added after
    it or removed, or an empty class folder is added."""
    root = make_image_folder(tmp_path / "data", ("a", "b"), per_split=(2, 1), size=(16, 12))
    target = tmp_path / "shm"
    final = tmpfs.stage(root, ["val", "train"], target, progress=False, reserve_gb=0)
    calls = []
    real = tmpfs.copy_files
    monkeypatch.setattr(tmpfs, "copy_files", lambda *a: calls.append(1) or real(*a))
    for splits in (["train", "val"], ["val", "train"], ["train"], ["val"]):
        assert tmpfs.stage(root, splits, target, progress=False, reserve_gb=0) == final
    assert calls == []
    last = root / "train" / "b" / "b_001.jpg"  # the last file of train listed
    st = last.stat()
    if change == "size":
        last.write_bytes(last.read_bytes() + b"\0")
    elif change == "mode":
        last.chmod(0o600)
    elif change == "replaced":
        shutil.copy(last, last.with_name("new.tmp"))
        os.utime(last.with_name("new.tmp"), ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(last.with_name("new.tmp"), last)
        assert (last.stat().st_size, last.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    elif change == "added":
        shutil.copy(last, last.with_name("b_002.jpg"))
    elif change == "removed":
        last.unlink()
    else:
        (root / "train" / "c").mkdir()
    assert tmpfs.stage(root, ["train"], target, progress=False, reserve_gb=0) == final
    assert calls == [1]
    assert tmpfs.stage(root, ["train", "val"], target, progress=False, reserve_gb=0) == final
    assert calls == [1]  # the new copy holds both splits


def test_the_manifest_lists_each_file_by_its_path_relative_to_the_root(tmp_path):
    """Paths relative to the root, for a split folder (nested folders too), a file the layout
    names, and a layout path that is the root itself ("."): as os.path.relpath gives them."""
    from types import SimpleNamespace

    root = make_image_folder(tmp_path / "data", ("a", "b"), per_split=(2, 1), size=(16, 12))
    (root / "train" / "a" / "deeper").mkdir()
    (root / "train" / "a" / "deeper" / "x.jpg").write_bytes(b"x")
    (root / "ann.json").write_text("{}")

    def listed(paths):
        layout = SimpleNamespace(root=str(root), stage_paths=lambda splits: paths)
        m = tmpfs.build_manifest(layout, ["train"])
        return sorted(f[0] for f in m["files"]), sorted(m["dirs"])

    def walked(top):
        files = [os.path.relpath(os.path.join(d, n), root) for d, _, ns in os.walk(top) for n in ns]
        return sorted(files), sorted(os.path.relpath(d, root) for d, _, _ in os.walk(top))

    files, dirs = walked(root / "train")
    assert listed(["train", "ann.json"]) == (sorted([*files, "ann.json"]), dirs)
    assert "train/a/deeper/x.jpg" in files
    assert listed(["."]) == walked(root)
    assert "ann.json" in walked(root)[0] and "." in walked(root)[1]


def test_staging_refused_with_numbers_when_it_does_not_fit(tmp_path, monkeypatch):
    root = make_image_folder(tmp_path / "data")
    monkeypatch.setattr(
        tmpfs,
        "room",
        lambda d: {
            "free space": 10_000,
            "available RAM": 8 << 30,
            "container memory limit headroom": None,
        },
    )
    with pytest.raises(StorageError) as err:
        tmpfs.stage(root, ["train", "val"], tmp_path / "shm", progress=False, reserve_gb=0)
    msg = str(err.value)
    assert str(root) in msg and "short on: free space" in msg and "MiB" in msg
    assert "mount -o remount,size=" in msg and "storage.target_dir" in msg
    assert not list(tmpfs.user_folder(tmp_path / "shm").iterdir())  # nothing half-copied
    # remount takes the tmpfs's mount point, not the folder inside it that was named
    point = tmpfs.mount_point(tmp_path / "shm" / "not-made-yet")
    assert os.path.ismount(point) and point in (tmp_path / "shm").parents
    assert f"remount,size=<N>G {point}`" in msg


def test_a_refusal_close_to_the_room_shows_the_bytes(tmp_path, monkeypatch):
    """Rounded to 0.1 MiB the refusal read "needs 1.0 MiB ... free space 1.0 MiB"."""
    root = make_image_folder(tmp_path / "data", ("a", "b"), per_split=(2, 1), size=(16, 12))
    need = sum(
        -(-f[1] // tmpfs.PAGE) * tmpfs.PAGE
        for f in tmpfs.build_manifest(tmpfs.as_layout(root), ["train", "val"])["files"]
    )
    monkeypatch.setattr(tmpfs, "room", lambda d: {"free space": need - 1, "available RAM": None,
                                                  "container memory limit headroom": None})  # fmt: skip
    with pytest.raises(StorageError) as err:
        tmpfs.stage(root, ["train", "val"], tmp_path / "shm", progress=False, reserve_gb=0)
    assert f"needs {need:,} bytes (+0 bytes" in str(err.value)
    assert f"free space {need - 1:,} bytes" in str(err.value)


_STAGE_INTO_FEW_INODES = """
import sys
from fastload.errors import StorageError
from fastload.storage import tmpfs
try:
    tmpfs.stage(sys.argv[1], ["train", "val"], sys.argv[2], progress=False, reserve_gb=0)
except StorageError as exc:
    print("error:", exc)
"""


@pytest.mark.skipif(not can_mount_privately(), reason="needs unshare -m and mount (root)")
def test_a_tmpfs_out_of_inodes_is_refused_naming_nr_inodes(tmp_path):
    """A tmpfs with bytes to spare but too few inodes (nr_inodes): the refusal gave bytes
    ("needs 0.1 MiB, 16 MiB free"); it counts files and folders and names nr_inodes."""
    root = make_image_folder(tmp_path / "data", ("a", "b"), per_split=(4, 2), size=(16, 12))
    small = tmp_path / "small"
    small.mkdir()
    script = f'mount -t tmpfs -o size=16m,nr_inodes=16 tmpfs {small} && exec "$@"'
    out = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh",
         sys.executable, "-c", _STAGE_INTO_FEW_INODES, str(root), str(small / "fl")],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert out.stdout.startswith(
        f"error: storage=tmpfs: the dataset {root} needs 20 files and folders in "
    ), out.stdout + out.stderr[-3000:]
    assert f"({small}, nr_inodes=16) takes only " in out.stdout
    assert f"mount -o remount,nr_inodes=<N> {small}" in out.stdout


def test_a_killed_stagings_leftover_is_removed_before_the_room_check(tmp_path, monkeypatch):
    """A partial copy left in tmpfs by a staging killed on this host takes room until it is
    removed: it goes before the room is measured, so it alone does not refuse the next one."""
    root = make_image_folder(tmp_path / "data", per_split=(2, 1), size=(16, 12))
    target = tmp_path / "shm"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = temp_path(tmpfs.staged_root(root, target).absolute(), pid=dead.pid)
    leftover.mkdir(parents=True)
    (leftover / "partial").write_bytes(b"x" * 3_000_000)
    capacity = 4_000_000  # the dataset + reserve fit, but not beside the leftover
    monkeypatch.setattr(
        tmpfs,
        "room",
        lambda d: {
            "free space": capacity - storage_base.du_bytes(d)[0],
            "available RAM": None,
            "container memory limit headroom": None,
        },
    )
    final = tmpfs.stage(root, ["train", "val"], target, reserve_gb=0.001, progress=False)
    assert not leftover.exists() and (final / tmpfs.MANIFEST).is_file()


def test_memory_limit_headroom_counts(monkeypatch, tmp_path):
    monkeypatch.setattr(tmpfs, "memory_limit_available", lambda: 1000)
    assert tmpfs.room(tmp_path)["container memory limit headroom"] == 1000
    with pytest.raises(StorageError, match="container memory limit headroom"):
        tmpfs.check_room(tmp_path, 5000, 0, "x")


def test_a_copy_holding_more_splits_is_reused_and_one_lacking_a_split_replaced(
    tmp_path, monkeypatch
):
    """A run that needs fewer splits (evaluate=<checkpoint>: val) reuses the copy staged for
    [train, val] while the training run reads it. A copy without a needed split is replaced
    by one holding the splits of both, built beside it: its readers keep reading."""
    root = make_image_folder(tmp_path / "data", ("a", "b"), per_split=(2, 1), size=(16, 12))
    target = tmp_path / "shm"
    store = tmpfs.TmpfsStorage(target_dir=target, progress=False, reserve_gb=0)
    calls = []
    real = tmpfs.copy_files
    monkeypatch.setattr(tmpfs, "copy_files", lambda *a: calls.append(1) or real(*a))
    store.prepare(root, ["train", "val"])
    train = store.open(root, "train")
    store.prepare(root, ["val"])
    store.prepare(root, ["train"])
    assert calls == [1]  # staged once, reused as it is by both
    assert sample(train, 0) == sample(DiskStorage().open(root, "train"), 0)

    other = make_image_folder(tmp_path / "other", ("a", "b"), per_split=(2, 1), size=(16, 12))
    store.prepare(other, ["val"])
    val = store.open(other, "val")
    store.prepare(other, ["train"])  # the val-only copy lacks train: replaced
    final = tmpfs.staged_root(other, target)
    staged = json.loads((final / tmpfs.MANIFEST).read_text())
    assert sorted(staged["splits"]) == ["train", "val"] and len(calls) == 3
    disk_val = DiskStorage().open(other, "val")
    assert [sample(val, i) for i in range(len(val))] == [
        sample(disk_val, i) for i in range(len(disk_val))
    ]  # the val run's reader, opened on the old copy, reads the new one
    store.prepare(other, ["train", "val"])
    store.prepare(other, ["val"])
    assert len(calls) == 3 and not list(target.glob(".*"))


def room_for_one_copy(monkeypatch, root, final) -> None:
    """Make the tmpfs hold one copy of both splits of `root`, not the copy at `final` and a
    new one beside it."""
    need = sum(
        -(-f[1] // tmpfs.PAGE) * tmpfs.PAGE
        for f in tmpfs.build_manifest(tmpfs.as_layout(root), ["train", "val"])["files"]
    )
    monkeypatch.setattr(
        tmpfs,
        "room",
        lambda d: {
            "free space": need - 1 if final.exists() else need,
            "available RAM": None,
            "container memory limit headroom": None,
        },
    )


def test_a_copy_without_room_for_its_replacement_beside_it_is_removed_first(
    tmp_path, monkeypatch, caplog
):
    """Where the old copy and its replacement do not fit together, the old one goes first
    (a run reading it would fail, and the warning says so) rather than refusing the run."""
    root = make_image_folder(tmp_path / "data", ("a", "b"), per_split=(2, 1), size=(16, 12))
    target = tmp_path / "shm"
    final = tmpfs.stage(root, ["val"], target, progress=False, reserve_gb=0)
    room_for_one_copy(monkeypatch, root, final)
    with caplog.at_level("WARNING", logger="fastload"):
        tmpfs.stage(root, ["train"], target, progress=False, reserve_gb=0)
    assert "removing it first (a run on this node reading it fails)" in caplog.text
    staged = json.loads((final / tmpfs.MANIFEST).read_text())
    assert sorted(staged["splits"]) == ["train", "val"] and not list(target.glob(".*"))


_STAGE = """
import contextlib, sys
from fastload.storage import tmpfs
if sys.argv[3] == "unlocked":  # another host on a shared target_dir: no flock between them
    tmpfs.staging_lock = lambda final: contextlib.nullcontext()
tmpfs.stage(sys.argv[1], sys.argv[4:], sys.argv[2], progress=False, reserve_gb=0)
"""


def test_a_copy_staged_by_another_process_meanwhile_is_used_if_it_holds_the_splits(
    tmp_path, monkeypatch
):
    """Two processes the staging lock does not reach (two hosts on a shared target_dir)
    stage the same dataset at once: the one that finishes second trains on the other's copy
    when it holds the splits it needs, else says what happened."""
    root = make_image_folder(tmp_path / "data", ("a", "b"), per_split=(2, 1), size=(16, 12))
    target = tmp_path / "shm"
    real = tmpfs.copy_files

    def another_stages_meanwhile(splits):
        def copy(*a):
            subprocess.run(
                [sys.executable, "-c", _STAGE, str(root), str(target), "unlocked", *splits],
                cwd=REPO,
                check=True,
                timeout=120,
            )
            real(*a)

        monkeypatch.setattr(tmpfs, "copy_files", copy)

    another_stages_meanwhile(["val"])
    with pytest.raises(StorageError, match="another process staged .* it holds \\['val'\\]"):
        tmpfs.stage(root, ["train"], target, progress=False, reserve_gb=0)
    final = tmpfs.staged_root(root, target)
    shutil.rmtree(final)
    another_stages_meanwhile(["train", "val"])
    assert tmpfs.stage(root, ["train"], target, progress=False, reserve_gb=0) == final
    disk, staged = DiskStorage().open(root, "train"), tmpfs.TmpfsStorage(target).open(root, "train")
    assert [sample(staged, i) for i in range(len(disk))] == [
        sample(disk, i) for i in range(len(disk))
    ]
    assert os.listdir(final.parent) == [final.name]  # our own copy is gone


_STAGE_SLOWLY = """
import shutil, sys, time
from fastload.storage import tmpfs
real = shutil.copyfile
def slow(src, dst):
    print("copying", flush=True)
    time.sleep(0.2)
    return real(src, dst)
tmpfs.shutil.copyfile = slow
tmpfs.stage(sys.argv[1], ["train", "val"], sys.argv[2], threads=1, progress=False, reserve_gb=0)
"""


def test_two_runs_staging_one_dataset_at_once_copy_it_once(tmp_path, monkeypatch, caplog):
    """With room for one copy, the second of two runs staging at once failed with "no space
    left" while the first's complete copy was in place. One copies; the other waits for it,
    then uses its copy."""
    root = make_image_folder(tmp_path / "data", ("a", "b"), per_split=(2, 1), size=(16, 12))
    target = tmp_path / "shm"
    first = subprocess.Popen([sys.executable, "-c", _STAGE_SLOWLY, str(root), str(target)],
                             cwd=REPO, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert first.stdout.readline().strip() == "copying"
        room_for_one_copy(monkeypatch, root, tmpfs.staged_root(root, target))
        calls = []
        real = tmpfs.copy_files
        monkeypatch.setattr(tmpfs, "copy_files", lambda *a: calls.append(1) or real(*a))
        with caplog.at_level("INFO", logger="fastload"):
            final = tmpfs.stage(root, ["train", "val"], target, progress=False, reserve_gb=0)
        assert first.wait(timeout=60) == 0
    finally:
        first.kill()
        first.wait()
    assert "another process on this node is staging" in caplog.text
    assert calls == [] and "reusing the complete staged copy" in caplog.text
    assert os.listdir(final.parent) == [final.name]  # no lock file, no temporary left


def test_a_copy_completed_by_another_host_is_used_when_this_one_runs_out_of_room(
    tmp_path, monkeypatch
):
    """Hosts staging into one shared target_dir (no flock between them): the tmpfs fills up
    while the other's complete copy is in place; that copy is used."""
    root = make_image_folder(tmp_path / "data", ("a", "b"), per_split=(2, 1), size=(16, 12))
    target = tmp_path / "shm"

    def another_host_completes_it_then_full(*a):
        subprocess.run([sys.executable, "-c", _STAGE, str(root), str(target), "unlocked",
                        "train", "val"], cwd=REPO, check=True, timeout=120)  # fmt: skip
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tmpfs, "copy_files", another_host_completes_it_then_full)
    final = tmpfs.stage(root, ["train"], target, progress=False, reserve_gb=0)
    assert (final / tmpfs.MANIFEST).is_file() and os.listdir(final.parent) == [final.name]


def test_a_target_dir_inside_the_dataset_is_refused(tmp_path):
    """storage.target_dir=<dataset.root>/train put each copy into the dataset: a new class
    folder, and every later run staged one level deeper. Refused before any folder is made,
    naming both options; so is a dataset.root inside the folder of staged copies."""
    root = make_image_folder(tmp_path / "data", ("a", "b"), per_split=(2, 1), size=(16, 12))
    before = sorted(p for p in root.rglob("*"))
    for target in (root / "train", root):
        store = tmpfs.TmpfsStorage(target_dir=target, progress=False, reserve_gb=0)
        with pytest.raises(ConfigError, match=re.escape(
            f"storage.target_dir={target} is inside dataset.root={root}"
        )):  # fmt: skip
            store.prepare(root, ["train", "val"])
        with pytest.raises(ConfigError, match="is inside dataset.root"):
            tmpfs.stage(root, ["train", "val"], target, progress=False, reserve_gb=0)
    assert sorted(p for p in root.rglob("*")) == before
    final = tmpfs.stage(root, ["train", "val"], tmp_path / "shm", progress=False, reserve_gb=0)
    with pytest.raises(ConfigError, match=re.escape(f"dataset.root={final} is inside storage")):
        tmpfs.stage(final, ["train", "val"], tmp_path / "shm", progress=False, reserve_gb=0)


def test_staging_leaves_out_a_dangling_link_that_is_no_image(tmp_path):
    """storage=disk lists only image files: a link to nothing that is no image (an old
    notes.txt) is not staged and does not stop the staging."""
    root = make_image_folder(tmp_path / "data", ("a", "b"), per_split=(2, 1), size=(16, 12))
    (root / "train" / "a" / "notes.txt").symlink_to(tmp_path / "missing.txt")
    store = tmpfs.TmpfsStorage(target_dir=tmp_path / "shm", progress=False, reserve_gb=0)
    store.prepare(root, ["train", "val"])
    disk, staged = DiskStorage().open(root, "train"), store.open(root, "train")
    assert [sample(staged, i) for i in range(len(disk))] == [
        sample(disk, i) for i in range(len(disk))
    ]
    final = tmpfs.staged_root(root, tmp_path / "shm")
    assert not os.path.lexists(final / "train" / "a" / "notes.txt")


def test_staging_names_an_image_that_leads_nowhere(tmp_path, monkeypatch):
    """An image name the split's index lists but no file behind it (a dangling link, or a
    file removed while staging) is refused naming it; nothing is left in place."""
    root = make_image_folder(tmp_path / "data", ("a", "b"), per_split=(2, 1), size=(16, 12))
    link = root / "train" / "a" / "gone.jpg"
    link.symlink_to(tmp_path / "missing.jpg")
    target = tmp_path / "shm"
    with pytest.raises(
        StorageError, match=re.escape(f"{link}: a symlink to {tmp_path}/missing.jpg")
    ):
        tmpfs.stage(root, ["train", "val"], target, progress=False, reserve_gb=0)
    link.unlink()
    victim = root / "val" / "b" / "b_000.jpg"
    real = tmpfs.copy_files
    monkeypatch.setattr(tmpfs, "copy_files", lambda *a: victim.unlink() or real(*a))
    with pytest.raises(StorageError, match=re.escape(f"{victim}: no such file")):
        tmpfs.stage(root, ["train", "val"], target, progress=False, reserve_gb=0)
    assert not list(tmpfs.user_folder(target).iterdir())


_STAGE_AS_USER = """
import logging, sys
logging.basicConfig(level=logging.INFO)
from fastload.errors import StorageError
from fastload.storage import tmpfs
try:
    print(tmpfs.stage(sys.argv[1], ["train", "val"], sys.argv[2], progress=False, reserve_gb=0))
except StorageError as exc:
    print("error:", exc)
"""


def test_staging_leaves_out_a_file_it_cannot_read_that_is_no_image(tmp_path):
    """storage=disk trains on a dataset holding a file this user cannot read that is no
    image (notes.txt, mode 600, another user's): it never reads it. Staging left it in the
    manifest and died on it with a PermissionError traceback; now it is left out, saying so.
    An image that cannot be read is refused in one line naming it and the fix."""
    root = make_image_folder(tmp_path / "pub" / "data", ("a", "b"), per_split=(2, 1),
                             size=(16, 12))  # fmt: skip
    (root / "train" / "a" / "notes.txt").write_text("private")
    (root / "train" / "a" / "notes.txt").chmod(0o600)
    (tmp_path / "pub" / "shm").mkdir(mode=0o777)
    (tmp_path / "pub" / "shm").chmod(0o777)
    out = as_another_user(tmp_path, _STAGE_AS_USER, "/media/data", "/media/shm")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "left out 1 file(s) this user cannot read" in out.stderr
    assert "/media/data/train/a/notes.txt" in out.stderr
    name = tmpfs.staged_name("/media/data")
    final = tmp_path / "pub" / "shm" / str(NOBODY) / name
    assert out.stdout.strip() == f"/media/shm/{NOBODY}/{name}"
    staged = sorted(p.relative_to(final) for p in final.rglob("*.jpg"))
    assert staged == sorted(p.relative_to(root) for p in root.rglob("*.jpg"))
    assert not (final / "train" / "a" / "notes.txt").exists()

    (root / "val" / "b" / "b_000.jpg").chmod(0o600)
    out = as_another_user(tmp_path, _STAGE_AS_USER, "/media/data", "/media/shm")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stdout.startswith(
        f"error: cannot stage /media/data/val/b/b_000.jpg: this user (uid {NOBODY}) may not "
        f"read it, but storage=disk would list it as an image of its split. Make it readable "
        f"(chmod a+r /media/data/val/b/b_000.jpg)"
    ), out.stdout


def test_each_user_stages_into_a_folder_of_their_own_in_a_shared_target_dir(tmp_path):
    """storage.target_dir (/dev/shm/fastload) made by the first user's run, 0755: a second
    user's run died on a PermissionError traceback. It is made 1777 as /dev/shm is, each
    user's copies go in a folder of their own (0700); a target_dir that another user made
    and others may not write to is refused in one line naming it and the fixes."""
    root = make_image_folder(tmp_path / "pub" / "data", ("a", "b"), per_split=(2, 1),
                             size=(16, 12))  # fmt: skip
    shm = tmp_path / "pub" / "shm"
    mine = tmpfs.stage(root, ["train", "val"], shm, progress=False, reserve_gb=0)
    assert stat.S_IMODE(shm.stat().st_mode) == 0o1777
    assert mine.parent == shm / str(os.geteuid())
    assert stat.S_IMODE(mine.parent.stat().st_mode) == 0o700
    out = as_another_user(tmp_path, _STAGE_AS_USER, "/media/data", "/media/shm")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    name = tmpfs.staged_name("/media/data")
    assert out.stdout.strip() == f"/media/shm/{NOBODY}/{name}"
    theirs = shm / str(NOBODY)
    assert theirs.stat().st_uid == NOBODY and stat.S_IMODE(theirs.stat().st_mode) == 0o700
    assert (theirs / name / tmpfs.MANIFEST).is_file() and (mine / tmpfs.MANIFEST).is_file()

    (tmp_path / "pub" / "shared").mkdir(mode=0o755)  # as an earlier version made it
    out = as_another_user(tmp_path, _STAGE_AS_USER, "/media/data", "/media/shared")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stdout.startswith(
        f"error: storage.target_dir=/media/shared: this user (uid {NOBODY}) cannot create its "
        f"folder there (Permission denied: /media/shared belongs to uid {os.geteuid()}, mode "
        f"755). Its owner can let every user stage there with `chmod 1777 /media/shared`"
    ), out.stdout
    assert f"storage.target_dir=/dev/shm/fastload-{NOBODY}" in out.stdout

    planted = tmp_path / "pub" / "planted"
    (planted / str(NOBODY)).mkdir(parents=True)  # root's, at nobody's name
    planted.chmod(0o1777)
    out = as_another_user(tmp_path, _STAGE_AS_USER, "/media/data", "/media/planted")
    assert out.stdout.startswith(
        f"error: storage.target_dir=/media/planted: /media/planted/{NOBODY}, where this user's"
    ), out.stdout + out.stderr[-2000:]


def test_a_copy_staged_before_folders_per_user_is_moved_into_ones_own(tmp_path, monkeypatch):
    """Copies used to be staged at <target_dir>/<name>: one's own is moved into one's
    folder and reused, not staged again beside it (its RAM held twice), unless a run uses
    it there."""
    root = make_image_folder(tmp_path / "data", ("a", "b"), per_split=(2, 1), size=(16, 12))
    target = tmp_path / "shm"
    final = tmpfs.stage(root, ["train", "val"], target, progress=False, reserve_gb=0)
    old = tmpfs.earlier_root(root, target)
    os.rename(final, old)
    calls = []
    real = tmpfs.copy_files
    monkeypatch.setattr(tmpfs, "copy_files", lambda *a: calls.append(1) or real(*a))
    assert tmpfs.stage(root, ["train", "val"], target, progress=False, reserve_gb=0) == final
    assert calls == [] and not old.exists() and (final / tmpfs.MANIFEST).is_file()
    assert sorted(os.listdir(target)) == [str(os.geteuid())]

    os.rename(final, old)
    other = subprocess.Popen(  # a run of the earlier version, reading the copy there
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], "
         "os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); "
         "time.sleep(60)", str(tmpfs.users_lock(old))],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert other.stdout.readline().strip() == "held"
        tmpfs.stage(root, ["train", "val"], target, progress=False, reserve_gb=0)
    finally:
        other.kill()
        other.wait()
    assert calls == [1] and (old / tmpfs.MANIFEST).is_file() and (final / tmpfs.MANIFEST).is_file()


def test_a_file_that_became_unreadable_while_staging_is_named(tmp_path, monkeypatch):
    """Readable when listed, not when copied (its mode changed meanwhile): one error naming
    the file and the fix, not a PermissionError traceback; nothing is left in place."""
    root = make_image_folder(tmp_path / "data", ("a", "b"), per_split=(2, 1), size=(16, 12))
    victim = root / "train" / "b" / "b_001.jpg"
    real = shutil.copyfile

    def copy(src, dst):
        if Path(src) == victim:
            raise PermissionError(errno.EACCES, "Permission denied", str(src))
        return real(src, dst)

    monkeypatch.setattr(tmpfs.shutil, "copyfile", copy)
    target = tmp_path / "shm"
    with pytest.raises(StorageError, match=re.escape(f"{victim}: this user")) as err:
        tmpfs.stage(root, ["train", "val"], target, progress=False, reserve_gb=0)
    assert f"chmod a+r {victim}" in str(err.value)
    assert not list(tmpfs.user_folder(target).iterdir())


def test_a_copy_of_more_files_than_are_handed_out_at_once_copies_each_in_order_of_need(
    tmp_path, monkeypatch
):
    """The threads get COPY_WINDOW files ahead of the oldest one not yet copied (not a
    future per file of the dataset at once); every file is copied, and a failure or a size
    that differs late in the order is named as before."""
    from concurrent.futures import ThreadPoolExecutor

    root = make_image_folder(tmp_path / "data", ("a", "b", "c"), per_split=(6, 3), size=(16, 12))
    monkeypatch.setattr(tmpfs, "COPY_WINDOW", 4)
    copied, ahead = [], []
    real = shutil.copyfile

    def copy(src, dst):
        copied.append(src)
        return real(src, dst)

    class Counting(ThreadPoolExecutor):
        def submit(self, fn, /, *a, **k):
            ahead.append(len(ahead) - len(copied))  # handed out, not yet copied
            return super().submit(fn, *a, **k)

    monkeypatch.setattr(tmpfs.shutil, "copyfile", copy)
    monkeypatch.setattr(tmpfs, "ThreadPoolExecutor", Counting)
    target = tmp_path / "shm"
    final = tmpfs.stage(root, ["train", "val"], target, threads=2, progress=False, reserve_gb=0)
    files = sorted(p.relative_to(root) for p in root.rglob("*.jpg"))
    assert len(files) == 27 and len(copied) == 27 and len(ahead) == 27
    assert max(ahead) <= 4
    assert sorted(p.relative_to(final) for p in final.rglob("*.jpg")) == files
    assert all((final / f).read_bytes() == (root / f).read_bytes() for f in files)

    shutil.rmtree(final)
    late = root / "val" / "c" / "c_002.jpg"  # the last file listed

    def unreadable_late(src, dst):
        if Path(src) == late:
            raise PermissionError(errno.EACCES, "Permission denied", str(src))
        return real(src, dst)

    monkeypatch.setattr(tmpfs.shutil, "copyfile", unreadable_late)
    with pytest.raises(StorageError, match=re.escape(f"cannot stage {late}: this user")):
        tmpfs.stage(root, ["train", "val"], target, threads=2, progress=False, reserve_gb=0)
    assert not list(tmpfs.user_folder(target).iterdir())

    def short_late(src, dst):
        real(src, dst)
        if Path(src) == late:
            Path(dst).write_bytes(b"x")

    monkeypatch.setattr(tmpfs.shutil, "copyfile", short_late)
    with pytest.raises(StorageError, match=r"1 file\(s\) differ .* \(first: val/c/c_002.jpg\)"):
        tmpfs.stage(root, ["train", "val"], target, threads=2, progress=False, reserve_gb=0)
    assert not list(tmpfs.user_folder(target).iterdir())


# -- cold cache --------------------------------------------------------------------------------


def test_cold_cache_evicts_every_store_file(tiny_folder, packs, monkeypatch):
    advised = []
    real = os.posix_fadvise
    monkeypatch.setattr(
        os,
        "posix_fadvise",
        lambda fd, o, n, a: (
            advised.append((os.readlink(f"/proc/self/fd/{fd}"), a)) or real(fd, o, n, a)
        ),
    )
    disk = DiskStorage(cold_cache=True).open(tiny_folder, "train")
    disk.before_epoch()
    assert sorted(p for p, _ in advised) == sorted(disk.store_files())
    assert {a for _, a in advised} == {os.POSIX_FADV_DONTNEED}
    advised.clear()
    shards = ShardStorage(path=packs / "sj", cold_cache=True).open(tiny_folder, "train")
    shards.before_epoch()
    assert str(packs / "sj" / "train" / "shard-00000.bin") in [p for p, _ in advised]


def test_cold_cache_evicts_once_per_node_before_every_ranks_epoch(tiny_folder, monkeypatch):
    """The page cache is the node's: local rank 0 evicts the split, the node's other ranks
    do not, and every rank waits at a barrier (so no rank reads the epoch before its node
    evicted); a single process evicts and needs none, nor does a warm cache."""
    from fastload import dist
    from fastload.dist import DistContext
    from fastload.pipeline import DataPath

    evicted, barriers = [], []
    monkeypatch.setattr(storage_base, "fs_type", lambda p: "ext4")
    monkeypatch.setattr(storage_base, "evict_page_cache", lambda p: evicted.append(list(p)) or 0)
    monkeypatch.setattr(dist, "barrier", lambda ctx: barriers.append(ctx.rank))
    reader = DiskStorage(cold_cache=True).open(tiny_folder, "train")
    for rank in range(4):  # two nodes of two ranks
        ctx = DistContext(rank=rank, local_rank=rank % 2, world_size=4, local_world_size=2)
        DataPath(None, None, None, None, reader).before_epoch(ctx)
    assert evicted == [reader.store_files()] * 2 and barriers == [0, 1, 2, 3]
    DataPath(None, None, None, None, reader).before_epoch(DistContext())
    DataPath(None, None, None, None, reader).before_epoch()
    assert len(evicted) == 4 and len(barriers) == 4
    warm = DiskStorage().open(tiny_folder, "train")
    DataPath(None, None, None, None, warm).before_epoch(DistContext(rank=1, world_size=2))
    assert len(evicted) == 4 and len(barriers) == 4


def test_cold_cache_on_tmpfs_says_it_does_nothing(tiny_folder, monkeypatch, caplog):
    monkeypatch.setattr(storage_base, "fs_type", lambda p: "tmpfs")
    monkeypatch.setattr(storage_base, "evict_page_cache", lambda p: pytest.fail("evicted tmpfs"))
    with caplog.at_level("WARNING", logger="fastload"):
        DiskStorage(cold_cache=True).open(tiny_folder, "val").before_epoch()
    assert "IS the page cache" in caplog.text


# -- through train.py --------------------------------------------------------------------------


def test_train_packs_on_first_use_and_logs_read_bandwidth(tmp_path):
    root = make_image_folder(tmp_path / "data")
    run_dir = tmp_path / "run"
    out = run_train(
        tiny_overrides(
            root, run_dir, "storage=shards", "storage.kind=raw", "storage.cold_cache=true"
        )
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "data.packs" / "shards-raw-256px" / "train" / "meta.json").is_file()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["cold_cache"] is True for r in rows)
    per_epoch = 4 * 4 * (96 * 72 * 3 + rawimage.HEADER_SIZE) / 1e6  # 4 steps x batch 4 images
    assert [round(r["read_mb"], 6) for r in rows] == [round(per_epoch, 6)] * 2, rows
    assert all(r["read_mb_per_s"] > 0 for r in rows)


def _can_mount_tmpfs(tmp_path) -> bool:
    import shutil

    if os.geteuid() != 0 or shutil.which("rsync") is None or shutil.which("mountpoint") is None:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)]).returncode
    if ok == 0:
        subprocess.run(["umount", str(probe)], check=True)
    return ok == 0


def test_stage_tmpfs_script_mounts_copies_reuses_and_refuses(tmp_path):
    """scripts/stage_tmpfs.sh for real: mount, atomic rsync, fstab line, reuse, too small."""
    if not _can_mount_tmpfs(tmp_path):
        pytest.skip("needs root, rsync and permission to mount a tmpfs")
    script = str(REPO / "scripts" / "stage_tmpfs.sh")
    src = make_image_folder(tmp_path / "imgs", per_split=(2, 1))
    mnt = tmp_path / "ram"
    try:
        out = subprocess.run([script, str(src), str(mnt), "16m"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert (
            subprocess.run(
                ["findmnt", "-n", "-o", "FSTYPE", str(mnt)], capture_output=True, text=True
            ).stdout.strip()
            == "tmpfs"
        )
        staged = mnt / "imgs"
        files = sorted(p.relative_to(src) for p in src.rglob("*.jpg"))
        assert files and sorted(p.relative_to(staged) for p in staged.rglob("*.jpg")) == files
        assert all((staged / f).read_bytes() == (src / f).read_bytes() for f in files)
        assert (staged / ".stage-complete").exists() and not (mnt / ".staging-imgs").exists()
        assert f"tmpfs  {mnt}  tmpfs  size=16m,mode=1777  0  0" in out.stdout
        assert f"dataset.root={staged}" in out.stdout

        again = subprocess.run([script, str(src), str(mnt), "16m"], capture_output=True, text=True)
        assert again.returncode == 0 and "already mounted, reusing it" in again.stdout
        assert "complete earlier staging found" in again.stdout
        assert f"tmpfs  {mnt}  tmpfs  size=16384k,mode=1777  0  0" in again.stdout  # as mounted

        big = tmp_path / "big"
        (big / "a").mkdir(parents=True)
        (big / "a" / "blob.bin").write_bytes(os.urandom(3 * 2**20))
        small = tmp_path / "small"
        refused = subprocess.run(
            [script, str(big), str(small), "1m"], capture_output=True, text=True
        )
        assert refused.returncode == 1 and "remount bigger" in refused.stderr
        assert not (small / "big").exists()
    finally:
        for m in (tmp_path / "ram", tmp_path / "small"):
            subprocess.run(["umount", str(m)], capture_output=True)


def test_stage_tmpfs_script_leaves_a_folder_it_did_not_stage(tmp_path):
    """The copy is an rsync --delete over MOUNTPOINT/<name of SRC>: a folder of that name
    that the script did not stage was emptied of everything SRC does not hold. /dev/shm is
    a mounted tmpfs (nothing to mount); a stand-in rsync (the refusal comes before it)."""
    shm = "/dev/shm"
    if subprocess.run(["mountpoint", "-q", shm], capture_output=True).returncode:
        pytest.skip("needs /dev/shm mounted (a tmpfs)")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "rsync").write_text("#!/bin/sh\nexit 9\n")
    (fake / "rsync").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    script = str(REPO / "scripts" / "stage_tmpfs.sh")
    src = make_image_folder(tmp_path / f"fastload-test-{os.getpid()}", per_split=(1, 1))
    theirs = Path(shm) / src.name
    theirs.mkdir()
    try:
        (theirs / "notes.txt").write_text("kept")
        out = subprocess.run([script, str(src), shm, "1m"], capture_output=True,
                             text=True, env=env)  # fmt: skip
        assert out.returncode == 2 and "is not a copy staged by this script" in out.stderr
        assert [p.name for p in theirs.iterdir()] == ["notes.txt"]
        (theirs / "notes.txt").unlink()
        theirs.rmdir()
        theirs.symlink_to(src)  # SRC itself, there already
        out = subprocess.run([script, str(src), shm, "1m"], capture_output=True,
                             text=True, env=env)  # fmt: skip
        assert out.returncode == 2 and "nothing to stage" in out.stderr
        assert (src / "train").is_dir()
    finally:
        if theirs.is_symlink():
            theirs.unlink()
        else:
            shutil.rmtree(theirs, ignore_errors=True)


@pytest.mark.slow  # two nodes of two ranks each: tests/test_multinode.py
def test_two_ranks_stage_once_per_node(tmp_path):
    root = make_image_folder(tmp_path / "data")
    record, target = tmp_path / "staged-by.txt", tmp_path / "shm"
    out = run_torchrun(
        root,
        tmp_path,
        "trainer.epochs=1",
        f"output_root={tmp_path / 'out'}",
        "name=stage",
        "storage=tmpfs",
        "storage._target_=tests.helpers.RecordingTmpfs",
        f"+storage.record={record}",
        f"storage.target_dir={target}",
        "storage.cleanup=true",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert record.read_text().split() == ["0"]  # local rank 0 staged, rank 1 waited
    assert not tmpfs.staged_root(root, target).exists()  # storage.cleanup=true


_USE_AND_WAIT = """
import sys, time
from fastload.storage.tmpfs import TmpfsStorage
storage = TmpfsStorage(target_dir=sys.argv[2], progress=False, reserve_gb=0)  # held to its end
storage.prepare(sys.argv[1], sys.argv[3:] or ["train"])
print("staged", flush=True)
time.sleep(120)
"""


def test_cleanup_leaves_a_copy_another_run_on_the_node_uses(tmp_path, caplog):
    """storage.cleanup=true removed the staged copy at the end of a run even while another
    run on the node was reading it (a second job on a shared node, an evaluation beside a
    training run): that run then lost its files mid-epoch. The last run to finish removes
    it; a run that died lets go of it."""
    root = make_image_folder(tmp_path / "data")
    target = tmp_path / "shm"
    final = tmpfs.staged_root(root, target)
    other = subprocess.Popen(
        [sys.executable, "-c", _USE_AND_WAIT, str(root), str(target)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout.readline().strip() == "staged"
        first = tmpfs.TmpfsStorage(target_dir=target, cleanup=True, progress=False)
        first.prepare(root, ["train"])
        with caplog.at_level(logging.INFO, logger="fastload"):
            first.finish(root, ["train"])
        assert "another run on this node is using it" in caplog.text
        assert (final / tmpfs.MANIFEST).is_file()
        reader = tmpfs.TmpfsStorage(target_dir=target).open(root, "train")
        assert sample(reader, 0) == sample(DiskStorage().open(root, "train"), 0)
    finally:
        other.kill()
        other.wait()
    last = tmpfs.TmpfsStorage(target_dir=target, cleanup=True, progress=False)
    last.prepare(root, ["train"])
    last.finish(root, ["train"])  # the other run is gone: its lock went with it
    assert not final.exists()


def test_the_size_of_the_copy_a_run_leaves_is_its_bytes_without_a_walk(
    tmp_path, monkeypatch, caplog
):
    """The end of a run says how much RAM the copy it leaves holds: the bytes of its files
    (its manifest too) as its manifest lists them, remembered from staging or reusing it,
    without a stat per file; read from the manifest in a process that did neither (or
    after another run replaced the copy); a walk of the copy when it has no manifest."""
    root = make_image_folder(tmp_path / "data", ("a", "b"), per_split=(2, 1), size=(16, 12))
    (root / "train" / "a" / "big.bin").write_bytes(os.urandom(3_000_000))
    target = tmp_path / "shm"
    store = tmpfs.TmpfsStorage(target_dir=target, progress=False, reserve_gb=0)
    store.prepare(root, ["train", "val"])
    final = tmpfs.staged_root(root, target)

    def walked():
        return sum(p.stat().st_size for p in final.rglob("*") if p.is_file())

    real = tmpfs._held
    monkeypatch.setattr(tmpfs, "_held", lambda folder: pytest.fail("walked the copy"))
    with caplog.at_level(logging.INFO, logger="fastload"):
        store.finish(root, ["train", "val"])
    assert f"stays in RAM for the next run ({walked() / 1e6:.0f} MB)" in caplog.text
    assert "(3 MB)" in caplog.text
    assert tmpfs.staged_bytes(final) == walked()
    tmpfs._listed_bytes.clear()  # another process: the manifest is read
    assert tmpfs.staged_bytes(final) == walked()
    (root / "val" / "b" / "more.jpg").write_bytes(b"more")  # another run replaces the copy
    subprocess.run([sys.executable, "-c", _STAGE, str(root), str(target), "locked", "val"],
                   cwd=REPO, check=True, timeout=120)  # fmt: skip
    assert (final / "val" / "b" / "more.jpg").is_file()
    assert tmpfs.staged_bytes(final) == walked()
    monkeypatch.setattr(tmpfs, "_held", real)
    (final / tmpfs.MANIFEST).unlink()
    assert tmpfs.staged_bytes(final) == walked()


def test_cleanup_removes_the_copy_of_a_run_that_fails_before_training(tmp_path):
    """storage.cleanup=true: a run that failed after staging, before training (building the
    data, tuning the loader) left its copy in RAM; it is removed whatever ends the run."""
    root = make_image_folder(tmp_path / "data", ("a", "b", "c"), per_split=(2, 1),
                             size=(16, 12))  # fmt: skip
    target = tmp_path / "shm"
    out = run_train(tiny_overrides(
        root, tmp_path / "out" / "run", "storage=tmpfs", "storage._target_=tests.helpers.TmpfsOpenFails",
        f"storage.target_dir={target}", "storage.cleanup=true", "storage.progress=false",
    ))  # fmt: skip
    assert out.returncode == 2 and "a test's failure" in out.stderr, out.stderr[-3000:]
    assert "storage.cleanup=true: removed the staged copy" in out.stdout + out.stderr
    assert not tmpfs.staged_root(root, target).exists()


def test_sigterm_while_staging_is_one_line_exit_143_and_leaves_no_partial_copy(tmp_path):
    """SIGTERM (Slurm, torchrun, kill) while staging ended the run at once with no word, and
    its partial copy stayed in RAM. It stops as Ctrl-C does: the partial copy removed, one
    line, exit 143."""
    root = make_image_folder(tmp_path / "data", ("a", "b", "c"), per_split=(2, 1),
                             size=(16, 12))  # fmt: skip
    target = tmp_path / "shm"
    out = run_train(tiny_overrides(
        root, tmp_path / "out" / "run", "storage=tmpfs", "storage.threads=1",
        "storage._target_=tests.helpers.SigtermWhileStaging", f"storage.target_dir={target}",
        "storage.progress=false",
    ))  # fmt: skip
    assert out.returncode == 143, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "interrupted (SIGTERM): nothing half-written was kept."
    ), out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert list(tmpfs.user_folder(target).iterdir()) == []  # no partial copy, no lock file


@pytest.mark.skipif(not can_mount_privately(), reason="needs unshare -m and mount (root)")
def test_checkpoints_that_do_not_fit_are_refused_before_staging(tmp_path):
    """The room for checkpoints was checked after the staging: a user waited out the copy
    of the dataset to learn that the output disk is too small. It is checked first."""
    root = make_image_folder(tmp_path / "data", ("a", "b", "c"), per_split=(2, 1),
                             size=(16, 12))  # fmt: skip
    record, target, out_dir = tmp_path / "staged-by.txt", tmp_path / "shm", tmp_path / "out"
    out_dir.mkdir()
    args = tiny_overrides(root, out_dir / "run", "storage=tmpfs",
                          "storage._target_=tests.helpers.RecordingTmpfs",
                          f"+storage.record={record}", f"storage.target_dir={target}",
                          "trainer.checkpoint_every=1")  # fmt: skip
    train = " ".join(f"'{a}'" for a in [sys.executable, str(REPO / "train.py"), *args])
    script = f"mount -t tmpfs -o size=96k tmpfs {out_dir} && {train}"
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                         capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert out.returncode == 2, out.stderr[-3000:]
    assert "this run's checkpoints need about" in out.stderr, out.stderr[-3000:]
    assert not record.exists() and not tmpfs.staged_root(root, target).exists()


def test_a_copy_another_run_reads_is_not_removed_to_make_room(tmp_path, monkeypatch):
    """A run needing a split the copy lacks, with no room for a new copy beside it, removed
    the copy first, and a run on the node reading it failed. While another run holds it, the
    staging is refused, naming the way out; once that run is gone, it goes ahead."""
    root = make_image_folder(tmp_path / "data", ("a", "b"), per_split=(2, 1), size=(16, 12))
    target = tmp_path / "shm"
    final = tmpfs.staged_root(root, target)
    other = subprocess.Popen(
        [sys.executable, "-c", _USE_AND_WAIT, str(root), str(target), "val"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout.readline().strip() == "staged"
        room_for_one_copy(monkeypatch, root, final)
        store = tmpfs.TmpfsStorage(target_dir=target, progress=False, reserve_gb=0)
        with pytest.raises(StorageError, match="another run on this node is reading it"):
            store.prepare(root, ["train"])
        assert json.loads((final / tmpfs.MANIFEST).read_text())["splits"] == ["val"]
    finally:
        other.kill()
        other.wait()
    store.prepare(root, ["train"])  # the reader is gone: removed first, then re-staged
    assert sorted(json.loads((final / tmpfs.MANIFEST).read_text())["splits"]) == ["train", "val"]
    store.finish(root, ["train"])


# -- COCO and DIV2K sources ------------------------------------------------------------------


def make_coco(root, sizes=((120, 80), (64, 48), (90, 150))):
    """A tiny COCO split: images with ids 7, 3, 5 (written out of order), image 5 has no
    boxes; returns (annotation file, image folder)."""
    from PIL import Image

    images = root / "train2017"
    images.mkdir(parents=True)
    ids = (7, 3, 5)
    doc = {
        "images": [],
        "annotations": [],
        "categories": [{"id": 18, "name": "dog"}, {"id": 1, "name": "person"}],
    }
    rng = np.random.default_rng(1)
    for image_id, (w, h) in zip(ids, sizes, strict=True):
        name = f"{image_id:012d}.jpg"
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(images / name)
        doc["images"].append({"id": image_id, "file_name": name, "width": w, "height": h})
    doc["annotations"] = [
        {"id": 1, "image_id": 7, "bbox": [10.0, 20.0, 30.5, 40.0], "category_id": 18},
        {"id": 2, "image_id": 3, "bbox": [1.0, 2.0, 3.0, 4.0], "category_id": 1},
        {"id": 3, "image_id": 7, "bbox": [60.0, 0.0, 50.0, 70.0], "category_id": 1},
    ]
    ann = root / "annotations" / "instances_train2017.json"
    ann.parent.mkdir()
    ann.write_text(json.dumps(doc))
    return ann, images


def open_pack(fmt, path, split):
    if fmt == "lmdb":
        return LmdbStorage(path=path, auto_pack=False).open(None, split)
    if fmt == "webdataset":  # shuffled when packed: seen here in the source's order
        from test_webdataset import ReorderedReader

        from fastload.storage.packing import pack_order

        reader = WebDatasetStorage(path=path, auto_pack=False).open(None, split)
        order = pack_order(len(reader), "shuffled")
        return ReorderedReader(reader, sorted(range(len(order)), key=order.__getitem__))
    return ShardStorage(path=path, auto_pack=False).open(None, split)


@pytest.mark.parametrize("fmt", ["lmdb", "shards", "webdataset"])
def test_coco_pack_keeps_bytes_ids_and_boxes(tmp_path, fmt):
    ann, images = make_coco(tmp_path / "coco")
    out = tmp_path / "pack"
    args = [fmt, str(out), "--source", "coco", "--annotations", str(ann), "--images", str(images)]
    assert pack_main(args) == 0
    store = open_pack(fmt, out, "train2017")
    assert len(store) == 3 and store.classes == ("person", "dog")  # category-id order
    assert targets(store).tolist() == [3, 5, 7]  # sorted by image id, target = image id
    want = {
        3: ([[1, 2, 3, 4]], [1]),
        5: (np.zeros((0, 4)), []),
        7: ([[10, 20, 30.5, 40], [60, 0, 50, 70]], [18, 1]),
    }
    for i, image_id in enumerate((3, 5, 7)):
        data, target = sample(store, i)
        assert target == image_id
        assert data == (images / f"{image_id:012d}.jpg").read_bytes()
        boxes, labels = (store.get(i, "boxes"), store.get(i, "labels"))
        assert boxes.dtype == np.float32 and labels.dtype == np.int64
        assert np.array_equal(boxes, np.array(want[image_id][0], np.float32).reshape(-1, 4))
        assert labels.tolist() == want[image_id][1]
    if fmt != "webdataset":  # webdataset names the shard and sample (it keeps no paths)
        assert f"{7:012d}.jpg" in store.describe(2)


@pytest.mark.parametrize("fmt", ["lmdb", "shards", "webdataset"])
def test_coco_boxes_scale_with_reencoded_pixels(tmp_path, fmt):
    ann, images = make_coco(tmp_path / "coco")
    out = tmp_path / "pack"
    args = [fmt, str(out), "--source", "coco", "--annotations", str(ann), "--images", str(images)]
    assert pack_main([*args, "--max-side", "60"]) == 0
    store = open_pack(fmt, out, "train2017")
    data, _ = sample(store, 2)  # image 7: 120 x 80 -> 60 x 40
    assert open_rgb(data).size == (60, 40)
    boxes, labels = (store.get(2, "boxes"), store.get(2, "labels"))
    assert np.allclose(boxes, [[5, 10, 15.25, 20], [30, 0, 25, 35]]) and labels.tolist() == [18, 1]
    assert open_rgb(store.get(0, "image")).size == (60, 45)  # 64 x 48: both axes by 60/64
    assert np.allclose(
        store.get(0, "boxes"), [[1 * 60 / 64, 2 * 45 / 48, 3 * 60 / 64, 4 * 45 / 48]]
    )
    if fmt == "shards":
        assert (
            pack_main(
                [*args[:1], str(tmp_path / "raw"), *args[2:], "--kind", "raw", "--size", "30"]
            )
            == 0
        )
        raw = open_pack(fmt, tmp_path / "raw", "train2017")
        assert rawimage.shape(raw.get(2, "image")) == (20, 30, 3)
        assert np.allclose(raw.get(2, "boxes"), [[2.5, 5, 7.625, 10], [15, 0, 12.5, 17.5]])


def test_coco_and_div2k_packs_are_re_packed_when_the_source_or_options_change(tmp_path, capsys):
    """`--source coco|div2k` over an existing pack: kept while it matches, re-packed when an
    annotation or image changed or other pack options are asked for."""
    ann, images = make_coco(tmp_path / "coco")
    out = tmp_path / "pack"
    args = ["shards", str(out), "--source", "coco", "--annotations", str(ann)]
    args += ["--images", str(images)]
    assert pack_main(args) == 0 and pack_main(args) == 0
    assert "matches its source: skipped" in capsys.readouterr().out
    doc = json.loads(ann.read_text())
    doc["annotations"][1]["bbox"] = [5.0, 6.0, 7.0, 8.0]  # image 3's box, moved
    ann.write_text(json.dumps(doc))
    assert pack_main(args) == 0
    text = capsys.readouterr().out
    assert "is out of date" in text and "changed since it was packed" in text, text
    assert open_pack("shards", out, "train2017").get(0, "boxes").tolist() == [[5, 6, 7, 8]]
    assert pack_main([*args, "--max-side", "60"]) == 0
    assert "is out of date (it was packed with" in capsys.readouterr().out
    hr, _ = make_div2k(tmp_path / "div2k")
    args = ["lmdb", str(tmp_path / "sr"), "--source", "div2k", "--hr", str(hr)]
    assert pack_main(args) == 0 and pack_main(args) == 0
    assert "matches its source: skipped" in capsys.readouterr().out
    (hr / "0002.png").write_bytes((hr / "0001.png").read_bytes())  # an HR image replaced
    assert pack_main(args) == 0
    assert "changed since it was packed" in capsys.readouterr().out
    assert (
        open_pack("lmdb", tmp_path / "sr", "DIV2K_train_HR").get(1, "image")
        == (hr / "0001.png").read_bytes()
    )


def test_coco_bad_input_names_the_file(tmp_path):
    from fastload.data.sources import CocoSource
    from fastload.errors import DatasetError

    ann, images = make_coco(tmp_path / "coco")
    with pytest.raises(DatasetError, match="instances_val2017.json does not exist"):
        CocoSource(ann.parent / "instances_val2017.json", images)
    (images / f"{5:012d}.jpg").unlink()
    with pytest.raises(DatasetError, match=f"{5:012d}.jpg"):
        CocoSource(ann, images)
    args = ["shards", str(tmp_path / "p"), "--source", "coco", "--annotations", str(ann)]
    assert pack_main([*args, "--images", str(images)]) == 2  # a clear error, no traceback


def test_missing_inputs_name_the_config_keys_in_train_and_the_flags_in_pack(tmp_path, capsys):
    """The same missing folder or file, named by the dataset yaml (a layout: train.py) or by
    `python -m fastload.pack`: each error says how to fix it in the words of its command."""
    from fastload.data.layouts import CocoLayout, Div2kLayout
    from fastload.data.sources import CocoSource, Div2kSource
    from fastload.errors import DatasetError

    def message(make) -> str:
        with pytest.raises(DatasetError) as err:
            make()
        return err.value.user_message

    ann, images = make_coco(tmp_path / "coco")
    hr, lr = make_div2k(tmp_path / "div2k")
    nowhere = tmp_path / "nowhere"
    cases = [  # (by the config, by the pack command, what both name, the keys, the flags)
        (lambda: CocoLayout(str(nowhere)).source("train2017"),
         lambda: CocoSource(nowhere / "annotations" / "instances_train2017.json", images),
         "instances_train2017.json", ["dataset.root", "dataset.layout.annotations"],
         ["--annotations"]),
        (lambda: CocoLayout(str(ann.parent.parent), images="nope").source("train2017"),
         lambda: CocoSource(ann, images.parent / "nope"),
         "nope", ["dataset.layout.images"], ["--images"]),
        (lambda: Div2kLayout(str(nowhere)).source("train"),
         lambda: Div2kSource(nowhere / "DIV2K_train_HR"),
         "DIV2K_train_HR", ["dataset.root", "dataset.layout.hr"], ["--hr"]),
        (lambda: Div2kLayout(str(hr.parent), lr="X{scale}").source("train"),
         lambda: Div2kSource(hr, hr.parent / "X2", 2),
         "X2", ["dataset.layout.lr", "dataset.layout.lr=null"], ["--lr"]),
        (lambda: Div2kLayout(str(hr.parent), scale=5).source("train"),
         lambda: Div2kSource(hr, lr, 5),
         "5", ["dataset.scale=5"], ["--scale"]),
    ]  # fmt: skip
    for by_config, by_pack, named, keys, flags in cases:
        train, pack = message(by_config), message(by_pack)
        assert named in train and named in pack, (train, pack)
        assert all(k in train for k in keys) and not any(f in train for f in flags), train
        assert all(f in pack for f in flags) and "dataset." not in pack, pack
    # an image folder: the pack command's SRC that is not there, and one without images
    assert pack_main(["lmdb", str(nowhere), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    assert pack_main(["lmdb", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert (
        err[0] == f"error: SRC {nowhere} is not a folder: pass a dataset root (SRC/<split>/"
        "<class>/<image>, e.g. ImageNet's train/ and val/) or one split (SRC/<class>/<image>)."
    )
    assert "no image files" in err[1] and "dataset.root (train.py) or SRC" in err[1], err


def make_div2k(root, n=3, scale=2):
    from PIL import Image

    rng = np.random.default_rng(2)
    hr, lr = root / "DIV2K_train_HR", root / "DIV2K_train_LR_bicubic" / f"X{scale}"
    hr.mkdir(parents=True)
    lr.mkdir(parents=True)
    for i in range(1, n + 1):
        img = Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8))
        img.save(hr / f"{i:04d}.png")
        img.resize((64 // scale, 48 // scale), Image.BICUBIC).save(lr / f"{i:04d}x{scale}.png")
    return hr, lr


@pytest.mark.parametrize("fmt", ["lmdb", "shards", "webdataset"])
def test_div2k_pack_keeps_hr_and_lr_pairs(tmp_path, fmt):
    hr, lr = make_div2k(tmp_path / "div2k")
    out = tmp_path / "pack"
    args = [fmt, str(out), "--source", "div2k", "--hr", str(hr)]
    assert pack_main([*args, "--lr", str(lr), "--scale", "2"]) == 0
    store = open_pack(fmt, out, "DIV2K_train_HR")
    assert len(store) == 3 and store.has("lr") and targets(store).tolist() == [0, 1, 2]
    for i in range(3):
        assert store.get(i, "image") == (hr / f"{i + 1:04d}.png").read_bytes()
        assert store.get(i, "lr") == (lr / f"{i + 1:04d}x2.png").read_bytes()
    if fmt == "shards":  # raw pairs keep the ratio
        assert (
            pack_main(
                [
                    *args[:1],
                    str(tmp_path / "raw"),
                    *args[2:],
                    "--lr",
                    str(lr),
                    "--scale",
                    "2",
                    "--kind",
                    "raw",
                    "--size",
                    "32",
                ]
            )
            == 0
        )
        raw = open_pack(fmt, tmp_path / "raw", "DIV2K_train_HR")
        assert rawimage.shape(raw.get(0, "image")) == (24, 32, 3)
        assert rawimage.shape(raw.get(0, "lr")) == (12, 16, 3)
    # no --lr: no pairs, and asking for one says how to pack them
    assert pack_main([*args[:1], str(tmp_path / "hr-only"), *args[2:]]) == 0
    solo = open_pack(fmt, tmp_path / "hr-only", "DIV2K_train_HR")
    assert not solo.has("lr")
    with pytest.raises(StorageError, match="holds no field 'lr'"):
        solo.get(0, "lr")


def test_div2k_missing_lr_image_names_it(tmp_path):
    from fastload.data.sources import Div2kSource
    from fastload.errors import DatasetError

    hr, lr = make_div2k(tmp_path / "div2k")
    (lr / "0002x2.png").unlink()
    with pytest.raises(DatasetError, match="0002.png"):
        Div2kSource(hr, lr, 2)
    with pytest.raises(DatasetError, match="--scale"):
        Div2kSource(hr, lr, None)


def test_truncated_or_corrupt_coco_shard_is_named(tmp_path):
    ann, images = make_coco(tmp_path / "coco")
    out = tmp_path / "pack"
    args = [
        "shards",
        str(out),
        "--source",
        "coco",
        "--annotations",
        str(ann),
        "--images",
        str(images),
    ]
    assert pack_main(args) == 0
    shard = out / "train2017" / "shard-00000.bin"
    blob = bytearray(shard.read_bytes())
    blob[-5] ^= 0xFF
    shard.write_bytes(bytes(blob))
    # the last field of the last record: its category ids
    match = rf"field labels of .*shard-00000.bin record 2 .*{7:012d}.jpg"
    with pytest.raises(StorageError, match=match):
        open_pack("shards", out, "train2017").get(2, "labels")
    shard.write_bytes(bytes(blob[:-10]))
    with pytest.raises(StorageError, match="shard-00000.bin is truncated.*first damaged record: 2"):
        open_pack("shards", out, "train2017")


def test_storage_benchmark_cli_smoke(tmp_path, capsys):
    from fastload.bench.__main__ import main

    root = make_image_folder(tmp_path / "d", per_split=(6, 1))
    out = tmp_path / "storage.json"
    argv = ["storage", "--root", str(root), "--stores", "disk,shards-raw", "--repeats", "1"]
    argv += ["--batch-size", "4", "--crop", "16", "--workers", "2", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    # no FFCV in the run: the target is not judged (no stored figure stands in for it)
    assert "shards-raw vs FFCV raw: not judged (no FFCV row in this run" in text
    rows = json.loads(out.read_text())["results"]
    assert [(r["storage"], r["cache"]) for r in rows] == [
        ("disk", "warm"),
        ("disk", "cold"),
        ("shards-raw", "warm"),
        ("shards-raw", "cold"),
    ]
    assert all(r["epoch_img_s"] > 0 and r["images"] == 18 for r in rows)
    # every batch went through the reused slots, none through a fresh segment; 5 batches of
    # which the last (2 images) is cut in two across the 2 workers (loader.balanced_tail)
    assert all(r["ring_hits"] == 2 * 6 and r["ring_misses"] == 0 for r in rows)
    assert (tmp_path / "d.packs" / "shards-raw-256px" / "train" / "meta.json").is_file()


def test_the_storage_benchmark_says_n_a_for_a_rate_it_could_not_measure(tmp_path, capsys):
    """An epoch of one batch has no steady rate (it leaves out the first batch): counted as
    0, the table and the JSON showed 0 img/s."""
    from fastload.bench.__main__ import main

    root = make_image_folder(tmp_path / "d", per_split=(6, 1))
    out = tmp_path / "storage.json"
    argv = ["storage", "--root", str(root), "--stores", "disk", "--repeats", "2", "--rounds",
            "2", "--batch-size", "32", "--crop", "16", "--workers", "0", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    assert rows and all(r["steady_img_s"] is None and r["epoch_img_s"] > 0 for r in rows)


def test_the_storage_benchmark_removes_only_what_it_staged(tmp_path, capsys):
    """--tmpfs-dir was removed whole at the end: given /dev/shm itself (or any folder holding
    other files), they went with the staged copy."""
    from fastload.bench.__main__ import main

    root = make_image_folder(tmp_path / "d", per_split=(6, 1))
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "theirs.txt").write_text("kept")
    argv = ["storage", "--root", str(root), "--stores", "tmpfs", "--repeats", "1",
            "--batch-size", "4", "--crop", "16", "--workers", "1", "--tmpfs-dir", str(shm),
            "--json", str(tmp_path / "storage.json")]  # fmt: skip
    assert main(argv) == 0
    assert [p.name for p in shm.iterdir()] == ["theirs.txt"]  # the staged copy is gone
    # this user's folder of a shared tmpfs dir there already (the training default's):
    # the copy staged into it goes, what was there stays
    mine = shm / str(os.geteuid())
    mine.mkdir()
    (mine / "earlier-copy").mkdir()
    assert main(argv) == 0
    assert sorted(p.name for p in shm.iterdir()) == [mine.name, "theirs.txt"]
    assert [p.name for p in mine.iterdir()] == ["earlier-copy"]
    from fastload.bench.storage import removed_after

    made = tmp_path / "made"
    with removed_after(made):
        (made / "copy").mkdir(parents=True)
    assert not made.exists()  # a folder the run made goes whole
    with removed_after(shm, keep=True):
        (shm / "copy").mkdir()
    assert (shm / "copy").is_dir()  # --keep-tmpfs


# -- damaged pack files: one message naming the file, never a signal or a traceback ---------


def lmdb_copy(packs, tmp_path):
    import shutil

    shutil.copytree(packs / "lmdb", tmp_path / "lmdb")
    return tmp_path / "lmdb" / "train" / "data.mdb"


def test_a_truncated_lmdb_is_named_not_a_bus_error(tiny_folder, packs, tmp_path):
    """LMDB maps data.mdb and trusts its header: a record past the end of a cut file killed
    train.py and pack verify with SIGBUS (rc 135) and not a word. Both run in a child here."""
    data = lmdb_copy(packs, tmp_path)
    os.truncate(data, data.stat().st_size // 2)
    out = run_train(tiny_overrides(tiny_folder, tmp_path / "run", "storage=lmdb",
                                   f"storage.path={tmp_path / 'lmdb'}", "storage.auto_pack=false"))  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{data} is truncated" in out.stderr and "fastload.pack lmdb" in out.stderr
    verify = subprocess.run([sys.executable, "-m", "fastload.pack", "verify", str(tmp_path / "lmdb")],
                            capture_output=True, text=True, cwd=REPO, timeout=120)  # fmt: skip
    assert (
        verify.returncode == 1
        and f"CORRUPT the LMDB pack file {data} is truncated" in verify.stderr
    )


@pytest.mark.parametrize("at, needle", [(16, "cannot be opened (InvalidError"), (None, "crashed the reader")])  # fmt: skip
def test_a_flipped_lmdb_page_is_named(tiny_folder, packs, tmp_path, at, needle):
    """A damaged meta page: one message at open. Damaged B-tree pages can make LMDB itself
    crash (it trusts its pages): verify checks each split in a child and names the split."""
    import struct

    data = lmdb_copy(packs, tmp_path)
    raw = bytearray(data.read_bytes())
    if at is None:  # the main database's root page (a leaf: its node offsets)
        metas = [struct.unpack_from("<Q", raw, base + 136)[0] for base in (0, 4096)]
        newest = 0 if metas[0] > metas[1] else 4096  # the larger last page is the newer meta
        root = struct.unpack_from("<Q", raw, newest + 16 + 24 + 48 + 40)[0]
        at = root * 4096 + 20
    raw[at : at + 8] = bytes(b ^ 0xFF for b in raw[at : at + 8])
    data.write_bytes(bytes(raw))
    verify = subprocess.run([sys.executable, "-m", "fastload.pack", "verify", str(tmp_path / "lmdb")],
                            capture_output=True, text=True, cwd=REPO, timeout=120)  # fmt: skip
    assert verify.returncode == 1, verify.stderr
    assert needle in verify.stderr and str(tmp_path / "lmdb" / "train") in verify.stderr
    assert "checked " + str(tmp_path / "lmdb" / "val") in verify.stdout  # the rest still checked


@pytest.mark.parametrize(
    "file, content, needle",
    [("meta.json", b"{oops", "meta.json cannot be read"),
     ("meta.json", b"[1, 2]", "it says [1, 2]"),
     ("index.npy", b"\x93NUMPY garbage", "index.npy is not a readable pack table"),
     ("index.npy", None, "index.npy lacks the columns shard, image.offset"),
     ("index.npy", "pickled", "index.npy is not a readable pack table (it holds pickled")],
)  # fmt: skip
def test_damaged_shard_pack_headers_are_named(tiny_folder, packs, tmp_path, file, content, needle):
    import shutil

    shutil.copytree(packs / "sj", tmp_path / "sj")
    target = tmp_path / "sj" / "train" / file
    if content is None:
        np.save(target, np.arange(12))
    elif content == "pickled":
        np.save(target, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    else:
        target.write_bytes(content)
    with pytest.raises(StorageError) as err:
        ShardStorage(path=tmp_path / "sj", auto_pack=False).open(tiny_folder, "train")
    assert needle in err.value.user_message and "re-pack" in err.value.user_message
    assert "allow_pickle" not in err.value.user_message
    assert pack_main(["verify", str(tmp_path / "sj")]) == 1


@pytest.mark.skipif(not can_mount_privately(), reason="needs unshare -m and mount (root)")
def test_auto_packing_beside_a_read_only_dataset_says_where_and_storage_path(tmp_path):
    """A dataset on a read-only mount (a shared NFS export, a container volume :ro): the pack
    beside it cannot be written; one line names the place and storage.path=."""
    ro = tmp_path / "ro"
    make_image_folder(ro / "d", per_split=(2, 1), size=(32, 24))
    lines = []
    for store in ("lmdb", "shards", "webdataset"):
        args = tiny_overrides(ro / "d", tmp_path / f"run-{store}", f"storage={store}")
        lines.append(" ".join(f"'{a}'" for a in [sys.executable, str(REPO / "train.py"), *args])
                     + "; echo rc=$?")  # fmt: skip
    script = f"mount --bind {ro} {ro} && mount -o remount,ro,bind {ro} && " + " && ".join(lines)
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                         capture_output=True, text=True, timeout=600, cwd=REPO)  # fmt: skip
    assert out.stdout.count("rc=2") == 3, out.stdout[-2000:] + out.stderr[-2000:]
    for store in ("lmdb", "shards", "webdataset"):
        assert f"storage={store} packs the dataset on first use into {ro}/d.packs/" in out.stderr
    assert out.stderr.count("storage.path=<a writable folder>") == 3
    assert "Traceback" not in out.stderr and not (ro / "d.packs").exists()


def test_a_pack_re_packed_by_another_node_first_is_used_not_replaced(tiny_folder, tmp_path, caplog):
    """Two nodes find one shared pack out of date and both re-pack it; the one that finishes
    second keeps the first one's pack (whose ranks may be reading it already) and trains on
    it, instead of deleting it under them."""
    from fastload.atomic import folder_id
    from fastload.storage.packing import SIDECAR

    ShardStorage(path=tmp_path / "sj").prepare(tiny_folder, ["train"])
    split = tmp_path / "sj" / "train"
    sidecar = json.loads((split / SIDECAR).read_text())
    (split / SIDECAR).write_text(json.dumps({**sidecar, "source_digest": "stale"}))

    class SlowerNode(ShardStorage):
        def writer(self, folder, schema):  # the other node re-packs and publishes first
            ShardStorage(path=tmp_path / "sj").prepare(tiny_folder, ["train"])
            self.theirs = folder_id(split)
            return super().writer(folder, schema)

    ours = SlowerNode(path=tmp_path / "sj")
    with caplog.at_level("INFO", logger="fastload"):
        ours.prepare(tiny_folder, ["train"])
    assert f"{split} was packed meanwhile by another process" in caplog.text
    assert folder_id(split) == ours.theirs  # theirs stayed in place
    assert json.loads((split / SIDECAR).read_text())["source_digest"] != "stale"
    assert sorted(p.name for p in (tmp_path / "sj").iterdir()) == ["train"]  # no temporary


def test_a_pack_that_left_files_out_says_so_to_a_run_without_skip_corrupt(tmp_path, caplog):
    """dataset.skip_corrupt=true packed without an undecodable file; a later run with
    skip_corrupt=false (which would stop at that file) reuses the pack and is told."""
    root = make_image_folder(tmp_path / "d")
    bad = root / "train" / "cat" / "cat_001.jpg"
    bad.write_bytes(b"\xff\xd8 truncated")
    store = ShardStorage(path=str(tmp_path / "p"), kind="raw", size=32)
    store.prepare(root, ["train"], skip_corrupt=True)
    assert len(store.open(root, "train")) == len(DiskStorage().open(root, "train")) - 1
    caplog.clear()
    with caplog.at_level("WARNING", logger="fastload"):
        store.prepare(root, ["train"], skip_corrupt=True)
    assert "left out" not in caplog.text  # that run asked for it
    with caplog.at_level("WARNING", logger="fastload"):
        store.prepare(root, ["train"])
    assert "packed with dataset.skip_corrupt=true and left out 1 file(s)" in caplog.text
    assert str(bad) in caplog.text


def test_the_pack_command_says_a_pack_it_keeps_left_files_out(tmp_path, capsys):
    """Re-running the pack without --skip-corrupt over a pack made with it said "exists and
    matches its source: skipped", not that files had been left out of it."""
    root = make_image_folder(tmp_path / "d", per_split=(2, 1))
    bad = root / "train" / "cat" / "cat_001.jpg"
    bad.write_bytes(b"\xff\xd8 truncated")
    args = ["shards", str(root), str(tmp_path / "p"), "--splits", "train", "--max-side", "64"]
    assert pack_main([*args, "--skip-corrupt"]) == 0
    capsys.readouterr()
    assert pack_main([*args, "--skip-corrupt"]) == 0
    assert "left out" not in capsys.readouterr().out  # that run asked for it
    assert pack_main(args) == 0
    out = capsys.readouterr().out
    assert "exists and matches its source: skipped" in out
    assert f"was packed with --skip-corrupt and left out 1 file(s) that could not be decoded " \
           f"({bad})" in out  # fmt: skip


@pytest.mark.parametrize("store", [ShardStorage, LmdbStorage])
def test_a_pack_replaced_under_a_running_job_is_named_not_mixed(store, tmp_path):
    """Another run re-packs a changed source into the folder this run reads: a process that
    opens the pack's files afterwards (a new DataLoader worker) stops, naming the pack,
    instead of reading the new pack's records with this run's index and labels."""
    root = make_image_folder(tmp_path / "d")
    store().prepare(root, ["train"])
    reader = store().open(root, "train")
    worker = pickle.dumps(reader)  # what a DataLoader worker receives
    assert pickle.loads(worker).get(0, "image")  # the same pack: reads
    extra = root / "train" / "cat" / "cat_000.jpg"
    extra.with_name("aaa_new.jpg").write_bytes(extra.read_bytes())  # the source changes...
    store().prepare(root, ["train"])  # ...and another run re-packs it in place
    with pytest.raises(StorageError, match="was replaced .* while this run reads it"):
        pickle.loads(worker).get(0, "image")
    assert len(store().open(root, "train")) == len(reader) + 1  # a restart reads the new one
