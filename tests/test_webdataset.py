"""storage=webdataset: tar shards from a local folder, a real web server (nginx when installed,
else Python's http.server) and an S3-protocol server (moto), through the node cache, in a
deterministic shard-aware order with equal parts per rank and exact resume."""

from __future__ import annotations

import io
import json
import logging
import mmap
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    NOBODY,
    REPO,
    as_another_user,
    build_test_loader,
    can_mount_privately,
    free_port,
    gets,
    make_image_folder,
    run_torchrun,
    run_train,
    tiny_overrides,
    web_server,
)

from fastload.data.sampling import shard_stream_order
from fastload.errors import StorageError
from fastload.pack import main as pack_main
from fastload.storage import webdataset as wds
from fastload.storage.disk import DiskStorage
from fastload.storage.packing import SIDECAR, pack_order, stale_reason
from fastload.storage.user_dir import user_folder
from fastload.storage.webdataset import WebDatasetStorage, expand_braces
from tests.helpers import recorded, sample, targets

CLASSES = ("cat", "dog", "eel")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """An ImageFolder (3 classes x 7 train / 3 val, so 21 train samples: odd, not a multiple
    of the batch) packed into tar shards of 4 samples, written sorted by class."""
    base = tmp_path_factory.mktemp("wds")
    root = make_image_folder(base / "tiny", classes=CLASSES, per_split=(7, 3), size=(48, 40))
    assert pack_main(["webdataset", str(root), str(base / "pack"), "--shard-samples", "4"]) == 0
    return root, base / "pack"


class ReorderedReader:
    """A reader's records in another order (`order[i]` at i), as a shuffled pack holds them."""

    def __init__(self, reader, order):
        self.reader, self.order = reader, list(order)

    def __len__(self):
        return len(self.order)

    def get(self, i, name="image"):
        return self.reader.get(self.order[i], name)

    def column(self, name):
        return np.asarray(self.reader.column(name))[self.order]

    def __getattr__(self, name):
        return getattr(self.reader, name)


def disk_samples(root, split="train"):
    """The folder's samples in the order a webdataset pack of it holds them (shuffled)."""
    disk = DiskStorage().open(root, split)
    return [sample(disk, i) for i in pack_order(len(disk), "shuffled")]


# -- packing and the local folder ----------------------------------------------------------


def test_pack_writes_webdataset_tars_with_a_manifest_and_reads_the_disk_bytes(data):
    root, pack = data
    manifest = json.loads((pack / "train" / "manifest.json").read_text())
    assert manifest["count"] == 21 and manifest["classes"] == list(CLASSES)
    assert [s["count"] for s in manifest["shards"]] == [4, 4, 4, 4, 4, 1]
    assert all(len(s["xxh3_64"]) == 16 and s["bytes"] > 0 for s in manifest["shards"])
    # The WebDataset convention: <key>.jpg + <key>.cls, readable by any tar reader.
    with tarfile.open(pack / "train" / "shard-000000.tar") as tf:
        names = tf.getnames()
        assert names[:4] == ["00000000.jpg", "00000000.cls", "00000001.jpg", "00000001.cls"]
        assert tf.extractfile("00000000.cls").read() == b"%d" % disk_samples(root)[0][1]
    reader = WebDatasetStorage(url=str(pack)).open(root, "train")
    assert [sample(reader, i) for i in range(len(reader))] == disk_samples(root)
    assert "shard-000001.tar sample 1 of 4" in reader.describe(5)
    assert pack_main(["verify", str(pack)]) == 0


def test_verify_compares_the_manifests_labels_with_the_cls_members(data, tmp_path, capsys):
    """The manifest's labels (what training takes) were not compared with the shards' .cls
    members by verify, only by the reader at open: a pack whose manifest says another label
    than its tar was verified ok. Each differing shard is named with the sample's key."""
    root, pack = data
    bad = tmp_path / "pack"
    shutil.copytree(pack, bad)
    manifest = json.loads((bad / "train" / "manifest.json").read_text())
    labels = manifest["shards"][1]["columns"]["label"]
    labels[2] = (labels[2] + 1) % len(CLASSES)
    (bad / "train" / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert pack_main(["verify", str(bad)]) == 1
    out, err = capsys.readouterr()
    assert f"checked {bad / 'train'}: 21 records, 1 problem(s)" in out
    assert f"checked {bad / 'val'}: 9 records, ok" in out
    shard = bad / "train" / "shard-000001.tar"
    assert f"CORRUPT {shard}: sample 00000006 has .cls {(labels[2] - 1) % 3}, the manifest " \
        f"says {labels[2]}\n" in err, err  # fmt: skip
    with pytest.raises(StorageError, match="sample 00000006 has .cls"):  # as the reader says
        sample(WebDatasetStorage(url=str(bad)).open(root, "train"), 6)


@pytest.mark.parametrize("fmt", ["webdataset", "shards"])
def test_the_pack_command_uses_the_yamls_shard_mb(fmt):
    """`python -m fastload.pack webdataset SRC DST` wrote 1024 MB shards (storage=shards'
    size) while storage=webdataset packs 256 MB ones on first use: one dataset, two packs.
    Without --shard-mb the command packs with the format's storage.shard_mb default."""
    from conftest import compose_config

    from fastload.pack import make_storage, parse

    want = compose_config([f"storage={fmt}"]).storage.shard_mb
    assert make_storage(parse([fmt, "SRC", "DST"])[1]).shard_mb == want
    assert make_storage(parse([fmt, "SRC", "DST", "--shard-mb", "8"])[1]).shard_mb == 8


def test_a_pack_of_a_class_sorted_folder_mixes_the_classes_in_its_shards(data, tmp_path):
    """The training order permutes shards and shuffles within a window of consecutive
    samples: shards written class by class (an image folder's order; ImageNet-sized shards
    hold a class or two each) gave batches of a few classes. The pack holds the records in a
    fixed shuffled order, and a pack written in the folder's order is out of date."""
    root, pack = data
    manifest = json.loads((pack / "train" / "manifest.json").read_text())
    per_shard = [s["columns"]["label"] for s in manifest["shards"]]
    labels = [label for shard in per_shard for label in shard]
    assert sorted(labels) == sorted(targets(DiskStorage().open(root, "train")).tolist())
    assert labels != sorted(labels) and manifest["params"]["order"] == "shuffled"
    assert sum(len(set(shard)) > 1 for shard in per_shard) >= 4  # 6 shards, 3 classes
    old = tmp_path / "old"
    shutil.copytree(pack / "train", old)
    sidecar = json.loads((old / SIDECAR).read_text())
    del sidecar["params"]["order"]  # as packs were written before they were shuffled
    (old / SIDECAR).write_text(json.dumps(sidecar))
    assert "order" in stale_reason(root / "train", old, WebDatasetStorage().pack_options())
    assert stale_reason(root / "train", pack / "train", WebDatasetStorage().pack_options()) is None


def test_class_sorted_shards_are_said_to_mix_few_classes(tmp_path, caplog):
    """Shards from another tool written class by class (one class each): the window shuffle
    cannot mix them, and the training loader says so with the numbers; fastload's own
    (shuffled) pack of the same folder is not flagged."""
    classes = tuple("abcdef")
    root = make_image_folder(tmp_path / "d", classes=classes, per_split=(8, 1), size=(24, 16))
    disk = DiskStorage().open(root, "train")  # class by class
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for k in range(len(classes)):
        with tarfile.open(foreign / f"part-{k}.tar", "w") as tf:
            for i in range(k * 8, k * 8 + 8):
                image, label = sample(disk, i)
                for ext, blob in (("jpg", image), ("cls", b"%d" % label)):
                    info = tarfile.TarInfo(f"s{i:03d}.{ext}")
                    info.size = len(blob)
                    tf.addfile(info, io.BytesIO(blob))
    assert pack_main(["webdataset", str(root), str(tmp_path / "pack"), "--shard-samples", "8"]) == 0
    flagged = []
    for url in (f"{foreign}/part-{{0..5}}.tar", str(tmp_path / "pack")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fastload.pipeline"):
            build_test_loader(
                "storage=webdataset", f"storage.url='{url}'", "storage.shuffle_buffer=8",
                f"storage.cache_dir={tmp_path / 'cache'}", "dataset.num_classes=6", folder=root,
            )  # fmt: skip
        flagged.append([r.getMessage() for r in caplog.records if "class by class" in r.message])
    assert len(flagged[0]) == 1 and "holds 1.0 classes on average" in flagged[0][0], flagged
    assert flagged[1] == []


def test_url_null_packs_beside_the_dataset_on_first_use(tmp_path):
    root = make_image_folder(tmp_path / "d", per_split=(2, 1), size=(32, 24))
    store = WebDatasetStorage(shard_samples=2)
    with pytest.raises(StorageError, match="python -m fastload.pack webdataset"):
        WebDatasetStorage(auto_pack=False).open(root, "train")
    store.prepare(root, ["train", "val"])
    assert (Path(f"{root}.packs") / "webdataset-orig" / "val" / "manifest.json").is_file()
    reader = store.open(root, "train")
    assert [sample(reader, i) for i in range(len(reader))] == disk_samples(root)


def test_brace_patterns_and_foreign_shards_without_a_manifest(data, tmp_path):
    assert expand_braces("a-{08..10}-{x,y}.tar") == [
        "a-08-x.tar", "a-08-y.tar", "a-09-x.tar", "a-09-y.tar", "a-10-x.tar", "a-10-y.tar"
    ]  # fmt: skip
    root, pack = data
    # Shards written by another tool: keys with folders, .cls, and an extra member.
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    samples = disk_samples(root)
    for k in range(3):
        with tarfile.open(foreign / f"part-{k:03d}.tar", "w") as tf:
            for i in range(k * 7, k * 7 + 7):
                for ext, blob in (("jpg", samples[i][0]), ("cls", b"%d" % samples[i][1]),
                                  ("txt", b"caption")):  # fmt: skip
                    info = tarfile.TarInfo(f"imgs/s{i:04d}.{ext}")
                    info.size = len(blob)
                    tf.addfile(info, __import__("io").BytesIO(blob))
    store = WebDatasetStorage(url=str(foreign / "part-{000..002}.tar"), cache_dir=tmp_path / "c")
    store.prepare(root, ["train"])  # local rank 0 derives the manifest once ...
    assert len(list(user_folder(tmp_path / "c").glob("*.json"))) == 1
    reader = store.open(root, "train")  # ... the other ranks find it
    assert reader.classes == ("0", "1", "2") and list(reader.shard_sizes) == [7, 7, 7]
    assert [sample(reader, i) for i in range(21)] == samples
    # A pattern over our own pack uses the manifest beside the shards (no scan).
    sub = WebDatasetStorage(url=str(pack / "{split}" / "shard-{000001..000002}.tar"))
    reader = sub.open(root, "train")
    assert len(reader) == 8 and sample(reader, 0) == samples[4]


# -- order: equal parts per rank, every sample, shuffle quality ------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_every_rank_gets_the_same_count_and_every_sample_once(world, remainder):
    sizes = [4, 4, 4, 1]  # 13 samples in 4 shards: fewer shards than 5 ranks too
    parts = [
        shard_stream_order(
            sizes, seed=3, epoch=1, rank=r, world_size=world, window=5, remainder=remainder
        )[0]  # fmt: skip
        for r in range(world)
    ]
    assert len({len(p) for p in parts}) == 1  # equal: the same batches on every rank
    seen = Counter(i for p in parts for i in p)
    left = 13 % world
    if remainder == "pad":
        assert set(seen) == set(range(13))
        assert sum(seen.values()) - 13 == (world - left) % world  # the repeats, counted
    else:
        assert set(seen) <= set(range(13)) and len(seen) == 13 - left
        assert max(seen.values()) == 1
    again = shard_stream_order(sizes, seed=3, epoch=1, rank=0, world_size=world, window=5,
                               remainder=remainder)[0]  # fmt: skip
    assert again == parts[0]  # the same order for the same (seed, epoch)
    other = shard_stream_order(sizes, seed=3, epoch=2, rank=0, world_size=1, window=5)[0]
    assert other != shard_stream_order(sizes, seed=3, epoch=1, rank=0, world_size=1, window=5)[0]


def test_fewer_samples_than_half_the_ranks_still_give_every_rank_its_part():
    """The pad repeated the stream's first samples once only: with 3 samples on 8 ranks
    the last two ranks got none, raised alone, and the others waited for them at DDP's
    first all-reduce. The stream now repeats as often as it takes, as DistributedSampler
    pads, and a rank's part is the same as before where once was enough."""
    for n, world in [(3, 8), (2, 5), (1, 4)]:
        parts = [shard_stream_order([1] * n, seed=0, epoch=0, rank=r, world_size=world,
                                    window=1)[0] for r in range(world)]  # fmt: skip
        assert [len(p) for p in parts] == [1] * world, (n, world)
        assert {i for p in parts for i in p} == set(range(n))


def adjacent_same(classes) -> float:
    c = np.asarray(classes)
    return float(np.mean(c[1:] == c[:-1]))


def longest_run(classes) -> int:
    best = run = 1
    for a, b in zip(classes, classes[1:], strict=False):
        run = run + 1 if a == b else 1
        best = max(best, run)
    return best


def test_shuffle_of_class_sorted_shards_is_not_clustered():
    """10 classes x 1,000 samples written sorted by class into shards of 100 (each shard one
    class, the worst case), 2 ranks. What a rank sees, against a uniform shuffle (adjacent
    same-class rate 1/10, longest run ~6): measured over seeds 0-9, window 500: 0.27 / 15,
    2000 (the default, 20 shards): 0.14 / 8, 5000 (a rank's whole part): 0.11 / 6."""
    n_classes, per, shard = 10, 1000, 100
    cls = np.repeat(np.arange(n_classes), per)
    sizes = [shard] * (n_classes * per // shard)
    uniform = 1 / n_classes

    def seen(window, rank=0, seed=0):
        order = shard_stream_order(
            sizes, seed=seed, epoch=0, rank=rank, world_size=2, window=window
        )[0]
        return cls[order]

    assert adjacent_same(seen(1)) > 0.95  # stored order: clustered (the metric sees it)
    for rank in (0, 1):
        s = seen(2000, rank)  # the yaml's default window
        assert adjacent_same(s) < 1.8 * uniform, adjacent_same(s)
        assert longest_run(s) <= 10, longest_run(s)
        assert len(set(s[:500])) >= 6  # most classes early in the epoch (a window = 20 shards)
    # the window is the knob: wider mixes better, the whole part is as good as uniform
    rates = [np.mean([adjacent_same(seen(w, seed=k)) for k in range(4)]) for w in (500, 2000, 5000)]
    assert rates[0] > rates[1] > rates[2] and rates[2] < 1.25 * uniform, rates


# -- HTTP, the node cache, loaders, failures --------------------------------------------------


def wds_overrides(url, cache, *extra):
    return [
        "storage=webdataset",
        f"storage.url='{url}'",
        f"storage.cache_dir={cache}",
        "storage.shuffle_buffer=6",
        "storage.retry_backoff_s=0.05",
        "dataset.num_classes=3",
        *extra,
    ]


def test_http_epochs_through_the_loader_fill_the_cache_once_per_node(data, tmp_path):
    root, pack = data
    with web_server(pack, tmp_path / "srv") as (url, _, log):
        loaders = [
            build_test_loader(
                *wds_overrides(
                    url, tmp_path / "cache", "loader.num_workers=2", "loader.drop_last=false"
                ),  # fmt: skip
                folder=root,
                rank=rank,
                world_size=2,
                batch_size=4,
            )  # fmt: skip
            for rank in (0, 1)
        ]
        reader = loaders[0].dataset.reader
        for epoch in (0, 1):
            keys = []
            for loader in loaders:
                loader.set_epoch(epoch)
                batches = list(loader.host_batches())
                ks = loader.sampler.epoch_keys(epoch)
                assert len(batches) == 3  # 11 samples per rank (21 padded to 22), batch 4
                got = torch.cat([b["target"] for b in batches])
                assert got.tolist() == [int(targets(reader)[i]) for _, i in ks]
                keys += [i for _, i in ks]
            assert set(keys) == set(range(21)) and len(keys) == 22  # one repeat, counted
        for loader in loaders:
            loader.close()
        requests = gets(log)
    shards = [f"/train/shard-{k:06d}.tar" for k in range(6)]
    # Two ranks x two workers x two epochs: each shard crossed the network exactly once.
    assert {p: requests[p] for p in shards} == dict.fromkeys(shards, 1), requests
    assert requests["/train/manifest.json"] == 2  # one per rank's open
    assert len(list(user_folder(tmp_path / "cache").glob("*shard-*.tar"))) == 6
    assert not list(user_folder(tmp_path / "cache").glob(".*tmp*"))  # nothing half-written


def test_resume_mid_epoch_continues_with_the_samples_the_run_would_have_seen(data, tmp_path):
    root, pack = data
    make = lambda: build_test_loader(  # noqa: E731
        *wds_overrides(pack, tmp_path / "c", "loader.num_workers=0"), folder=root, batch_size=4
    )
    whole = make()
    whole.set_epoch(1)
    ref = [b["image"].clone() for b in whole.host_batches()]
    resumed = make()  # a new process's loader, as after a restart
    resumed.set_epoch(1, skip_batches=2)  # what fit does with the checkpoint's step
    rest = [b["image"] for b in resumed.host_batches()]
    assert len(ref) == 5 and len(rest) == 3
    assert all(torch.equal(a, b) for a, b in zip(ref[2:], rest, strict=True))
    whole.set_epoch(2)
    assert not torch.equal(next(iter(whole.host_batches()))["image"], ref[0])  # new epoch order


def test_the_cache_limit_evicts_least_recently_used_shards(data, tmp_path):
    root, pack = data
    one = (pack / "train" / "shard-000000.tar").stat().st_size
    with web_server(pack, tmp_path / "srv") as (url, _, log):
        store = WebDatasetStorage(url=url, cache_dir=tmp_path / "c", cache_gb=2.5 * one / 1e9)
        reader = store.open(root, "train")
        for i in range(0, 21, 4):
            sample(reader, i)
        kept = sorted(p.name[-10:-4] for p in user_folder(tmp_path / "c").glob("*.tar"))
        assert kept == ["000003", "000004", "000005"]  # the least recently used went first
        assert sum(p.stat().st_size for p in user_folder(tmp_path / "c").glob("*.tar")) <= 2.5 * one
        reader = store.open(root, "train")  # a fresh process: the last two are local
        sample(reader, 20), sample(reader, 16)
        assert gets(log)["/train/shard-000005.tar"] == 1 and reader.cache.fetched == 0


def test_eviction_removes_only_the_caches_own_shards(data, tmp_path):
    """storage.cache_dir may be a folder shared with other files (/scratch): eviction
    removes the shards it cached, never a file it did not write, however old."""
    root, pack = data
    one = (pack / "train" / "shard-000000.tar").stat().st_size
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    theirs = [scratch / "thesis.pdf", scratch / "backup.tar", scratch / "0123456789ab-notes.txt"]
    for f in theirs:
        f.write_bytes(b"x" * one)
        os.utime(f, (0, 0))  # older than every shard: first in line if it were a shard
    with web_server(pack, tmp_path / "srv") as (url, _, _log):
        store = WebDatasetStorage(url=url, cache_dir=scratch, cache_gb=2.5 * one / 1e9)
        reader = store.open(root, "train")
        for i in range(0, 21, 4):
            sample(reader, i)
    assert all(f.read_bytes() == b"x" * one for f in theirs)
    assert (
        len(list(user_folder(scratch).glob("*-shard-*.tar"))) == 3
    )  # the limit holds for its shards


def test_a_shard_re_packed_to_the_same_url_is_fetched_again(data, tmp_path):
    """A pack re-written in place on the server (an image changed): the manifest's new
    checksums make the cache fetch the changed shards, not serve the old copies."""
    root, pack = data
    served, changed = tmp_path / "www", tmp_path / "tiny"
    shutil.copytree(pack, served)
    shutil.copytree(root, changed)
    first, other = sorted((changed / "train" / CLASSES[0]).iterdir())[:2]
    first.write_bytes(other.read_bytes())
    with web_server(served, tmp_path / "srv") as (url, _, log):
        store = WebDatasetStorage(url=url, cache_dir=tmp_path / "c")
        at = pack_order(21, "shuffled").index(0)  # where the pack holds `first`
        assert sample(store.open(root, "train"), at) == disk_samples(root)[at]  # cached
        args = ["webdataset", str(changed), str(tmp_path / "new"), "--shard-samples", "4"]
        assert pack_main(args) == 0
        shutil.copytree(tmp_path / "new", served, dirs_exist_ok=True)  # the upload
        reader = store.open(changed, "train")
        assert [sample(reader, i) for i in range(len(reader))] == disk_samples(changed)
        assert gets(log)[f"/train/shard-{at // 4:06d}.tar"] == 2


def test_a_server_that_goes_away_gives_retries_then_a_named_error(data, tmp_path, caplog):
    root, pack = data
    with web_server(pack, tmp_path / "srv") as (url, proc, _):
        store = WebDatasetStorage(url=url, cache_dir=tmp_path / "c", retries=2,
                                  retry_backoff_s=0.05)  # fmt: skip
        reader = store.open(root, "train")
        assert sample(reader, 0) == disk_samples(root)[0]
        proc.terminate()
        proc.wait(10)
        with caplog.at_level(logging.WARNING, "fastload"):
            with pytest.raises(StorageError) as err:
                sample(reader, 4)  # shard 1: not cached yet
    assert f"{url}/train/shard-000001.tar after 3 attempt(s)" in str(err.value)
    assert "storage.retries" in str(err.value)
    assert sum("retry" in r.message for r in caplog.records) == 2
    # A missing shard is not retried: the error says HTTP 404 at once.
    (tmp_path / "gone").mkdir()
    shutil.copy(pack / "train" / "manifest.json", tmp_path / "gone" / "manifest.json")
    with web_server(tmp_path, tmp_path / "srv2") as (url, _, log):
        store = WebDatasetStorage(url={"train": f"{url}/gone/shard-{{000000..000005}}.tar"},
                                  cache_dir=tmp_path / "c2")  # fmt: skip
        with pytest.raises(StorageError, match=r"404"):
            sample(store.open(root, "train"), 0)
        assert gets(log)["/gone/shard-000000.tar"] == 1


# Reads every train shard of the pack at argv[1] into the cache argv[2] (a small tmpfs);
# prints the shards kept, or the error.
FILL_SMALL_CACHE = """
import sys
from fastload.storage.webdataset import WebDatasetStorage
from fastload.errors import StorageError
store = WebDatasetStorage(url=sys.argv[1], cache_dir=sys.argv[2], retry_backoff_s=0.05)
reader = store.open(sys.argv[3], "train")
try:
    paths = [reader.local_path(k) for k in range(len(reader.urls))]
    print("read", len(paths), "kept", sum(p.exists() for p in paths), flush=True)
except StorageError as exc:
    print("error:", exc, flush=True)
"""


@pytest.mark.skipif(not can_mount_privately(), reason="needs unshare -m and mount (root)")
def test_a_cache_dir_smaller_than_cache_gb_evicts_to_its_free_space_or_says_so(data, tmp_path):
    """storage.cache_gb=16 (the default) on a file system that holds far less (Docker's 64 MB
    /dev/shm): shards are evicted down to what it can hold; one that cannot fit at all is one
    error naming storage.cache_dir, not a network failure retried three times."""
    root, pack = data
    cache = tmp_path / "cache"
    cache.mkdir()
    with web_server(pack, tmp_path / "srv") as (url, _, log):
        outs = []
        for size in ("64k", "16k"):  # two 20 KB shards and the slack; less than one shard
            script = (f"mount -t tmpfs -o size={size} tmpfs {cache} && "
                      f'"$0" -c "$1" {url} {cache} {root}')  # fmt: skip
            cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", script,
                   sys.executable, FILL_SMALL_CACHE]  # fmt: skip
            outs.append(subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                                       cwd=REPO))  # fmt: skip
        requests = gets(log)
    fits, small = (o.stdout + o.stderr for o in outs)
    assert "read 6 kept 2" in fits, fits
    assert "retry" not in fits + small
    assert f"error: the shard cache storage.cache_dir={cache} has no room for {url}/train/" in small
    assert "storage.cache_gb=16 is the cache's own limit" in small and "is free" in small
    shards = [f"/train/shard-{k:06d}.tar" for k in range(6)]
    assert [requests[p] for p in shards] == [1, 1, 1, 1, 1, 1]  # none fetched in vain


# Reads train shard 0 of the pack at argv[1] through the cache argv[2]; prints its path or
# the error.
READ_ONE_SHARD = """
import sys
from fastload.errors import StorageError
from fastload.storage.webdataset import WebDatasetStorage
store = WebDatasetStorage(url=sys.argv[1], cache_dir=sys.argv[2], retry_backoff_s=0.05)
try:
    print(store.open(sys.argv[3], "train").local_path(0))
except StorageError as exc:
    print("error:", exc)
"""


def test_each_user_caches_shards_in_a_folder_of_their_own_in_a_shared_cache_dir(data, tmp_path):
    """storage.cache_dir (/dev/shm/fastload-wds) made by the first user's run, 0755: a
    second user's run died on a PermissionError traceback. It is made 1777 as /dev/shm is,
    each user's shards go in a folder of their own (0700, shared by that user's ranks and
    workers); a cache_dir that another user made and others may not write to, or a folder at
    this user's name that is not theirs, is refused in one line naming it and the fixes."""
    root, pack = data
    cache = tmp_path / "pub" / "cache"
    with web_server(pack, tmp_path / "srv") as (url, _, _log):
        store = WebDatasetStorage(url=url, cache_dir=cache, retry_backoff_s=0.05)
        mine = store.open(root, "train").local_path(0)
        assert stat.S_IMODE(cache.stat().st_mode) == 0o1777
        assert mine.parent == cache / str(os.geteuid())
        assert stat.S_IMODE(mine.parent.stat().st_mode) == 0o700
        out = as_another_user(tmp_path, READ_ONE_SHARD, url, "/media/cache", str(root))
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
        theirs = cache / str(NOBODY)
        assert out.stdout.strip() == f"/media/cache/{NOBODY}/{mine.name}", out.stdout
        assert theirs.stat().st_uid == NOBODY and stat.S_IMODE(theirs.stat().st_mode) == 0o700
        assert (theirs / mine.name).read_bytes() == mine.read_bytes()

        (tmp_path / "pub" / "shared").mkdir(mode=0o755)  # as an earlier version made it
        out = as_another_user(tmp_path, READ_ONE_SHARD, url, "/media/shared", str(root))
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert out.stdout.startswith(
            f"error: storage.cache_dir=/media/shared: this user (uid {NOBODY}) cannot create "
            f"its folder there (Permission denied: /media/shared belongs to uid "
            f"{os.geteuid()}, mode 755). Its owner can let every user cache shards there with "
            f"`chmod 1777 /media/shared`"
        ), out.stdout
        assert f"storage.cache_dir=/dev/shm/fastload-wds-{NOBODY}" in out.stdout

        planted = tmp_path / "pub" / "planted"
        (planted / str(NOBODY)).mkdir(parents=True)  # root's, at nobody's name
        planted.chmod(0o1777)
        out = as_another_user(tmp_path, READ_ONE_SHARD, url, "/media/planted", str(root))
        assert out.stdout.startswith(
            f"error: storage.cache_dir=/media/planted: /media/planted/{NOBODY}, where this user's"
        ), out.stdout + out.stderr[-2000:]


def test_a_full_disk_while_fetching_is_not_retried_as_a_network_failure(tmp_path, caplog):
    """A download that finds the cache's file system full (ENOSPC, EDQUOT) is no network
    failure: no backoff and retries, no advice about the server; it is tried once more after
    making room, then named as the cache folder's problem."""
    import errno

    from fastload.storage.wds_cache import ShardCache, with_retries

    tries = []

    def disk_full():
        tries.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    def fetch(url, tmp):
        with_retries("fetch shard", url, disk_full, retries=3, backoff_s=0.01)

    cache = ShardCache(tmp_path / "c", limit_bytes=16e9)
    with caplog.at_level(logging.WARNING, "fastload"):
        with pytest.raises(StorageError) as err:
            cache.get("http://host/train/shard-000000.tar", None, None, fetch)
    assert len(tries) == 2 and not caplog.records
    assert str(err.value).startswith(
        f"the shard cache storage.cache_dir={tmp_path / 'c'} has no room for http://host/train/"
    )
    assert "storage.url" not in str(err.value)
    assert [p.name for p in cache.dir.iterdir() if "tmp" in p.name] == []


def test_downloads_of_killed_processes_are_removed_before_the_next_fill(tmp_path):
    """A process killed mid-fetch leaves its partial download (up to a whole shard, which
    cache_gb does not count); the next fill removes it when its pid is dead here, keeps a
    live process's, and removes expired `.bad` verdicts."""
    from fastload.atomic import temp_path
    from fastload.storage.wds_cache import ShardCache

    cache = ShardCache(tmp_path / "c", limit_bytes=16e9)
    cache.ready()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    killed = temp_path(cache.path("http://host/train/shard-000001.tar"), pid=dead.pid)
    live = temp_path(cache.path("http://host/train/shard-000002.tar"), pid=os.getppid())
    old_bad = cache.dir / (cache.key("http://host/train/shard-000003.tar") + ".bad")
    new_bad = cache.dir / (cache.key("http://host/train/shard-000004.tar") + ".bad")
    for f in (killed, live, old_bad, new_bad):
        f.write_bytes(b"x" * 1000)
    os.utime(old_bad, (0, 0))
    names = []

    def fetch(url, tmp):
        names.append(tmp.name)
        tmp.write_bytes(b"shard")

    final = cache.get("http://host/train/shard-000000.tar", 5, None, fetch)
    assert names == [temp_path(final).name]  # host, PID namespace and pid: judged later
    assert not killed.exists() and not old_bad.exists()
    assert live.exists() and new_bad.exists()


def test_shards_cached_before_folders_per_user_move_into_ones_own(tmp_path):
    """Shards used to be cached at <cache_dir>/<key>: this user's own are moved into their
    folder and used there (counted and evicted by the cache, not left holding RAM), no
    other file is touched."""
    from fastload.storage.wds_cache import ShardCache

    cache = ShardCache(tmp_path / "c", limit_bytes=16e9)
    url = "http://host/train/shard-000000.tar"
    earlier = tmp_path / "c" / cache.key(url)
    other = tmp_path / "c" / "notes.tar"
    earlier.parent.mkdir()
    earlier.write_bytes(b"shard")
    other.write_bytes(b"mine")
    fetched = []
    final = cache.get(url, 5, None, lambda u, tmp: fetched.append(u))
    assert fetched == [] and final == cache.dir / earlier.name
    assert final.read_bytes() == b"shard" and not earlier.exists()
    assert other.read_bytes() == b"mine"


def test_a_corrupt_shard_is_named_or_skipped_and_counted(data, tmp_path):
    root, pack = data
    bad = tmp_path / "pack"
    shutil.copytree(pack, bad)
    shard = bad / "train" / "shard-000002.tar"
    shard.write_bytes(shard.read_bytes()[:1500])  # truncated
    with web_server(bad, tmp_path / "srv") as (url, _, _log):
        store = WebDatasetStorage(url=url, cache_dir=tmp_path / "c", retries=0)
        with pytest.raises(StorageError, match=r"corrupt shard .*shard-000002.tar \(truncated"):
            sample(store.open(root, "train"), 9)
        assert not list(
            user_folder(tmp_path / "c").glob("*shard-000002.tar")
        )  # never entered the cache
    # Local folder, through the dataset: stop with the shard's name, or skip and count.
    overrides = wds_overrides(
        bad, tmp_path / "c3", "loader.num_workers=0", "loader.drop_last=false"
    )
    loader = build_test_loader(*overrides, folder=root)
    loader.set_epoch(0)
    with pytest.raises(StorageError, match="shard-000002.tar"):
        list(loader.host_batches())
    loader = build_test_loader(*overrides, "dataset.skip_corrupt=true", folder=root)
    loader.set_epoch(0)
    batches = list(loader.host_batches())
    assert sum(b["skipped"] for b in batches) == 4  # the shard's samples, counted
    assert sum(len(b["target"]) for b in batches) == 21 - 4  # one rank: no padding


def test_s3_through_moto_server(data, tmp_path, monkeypatch):
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    for k, v in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                 ("AWS_DEFAULT_REGION", "us-east-1")):  # fmt: skip
        monkeypatch.setenv(k, v)
    root, pack = data
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket="data")
        for f in (pack / "train").iterdir():
            s3.upload_file(str(f), "data", f"in/train/{f.name}")
        opts = {"endpoint_url": endpoint}
        store = WebDatasetStorage(url="s3://data/in", storage_options=opts,
                                  cache_dir=tmp_path / "c")  # fmt: skip
        reader = store.open(root, "train")
        assert [sample(reader, i) for i in range(len(reader))] == disk_samples(root)
        assert len(list(user_folder(tmp_path / "c").glob("*.tar"))) == 6
        missing = WebDatasetStorage(url="s3://data/in/train/shard-{000007..000008}.tar",
                                    storage_options=opts, cache_dir=tmp_path / "c2", retries=1)  # fmt: skip
        with pytest.raises(StorageError, match=r"s3://data/in/train/shard-000007.tar"):
            missing.open(root, "train")
    finally:
        server.stop()


# -- the application: resume=auto and 2-process DDP ------------------------------------------


@pytest.mark.slow  # three train.py runs, ~40 s here; the loader-level test above is fast
def test_train_resumed_mid_epoch_matches_the_uninterrupted_run(data, tmp_path):
    root, pack = data
    common = ["trainer.epochs=2", "loader.num_workers=0", "trainer.batch_size=4"]
    common += wds_overrides(pack, tmp_path / "cache")
    common += ["storage._target_=tests.helpers.SigtermWebDataset"]
    ref = run_train(tiny_overrides(root, tmp_path / "ref" / "r", *common, "name=ref"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    # SIGTERM at the 31st read: in epoch 1 (5 batches of 4 from 21), a few steps in.
    killed_dir = tmp_path / "out" / "b" / "r1"
    killed = run_train(
        tiny_overrides(root, killed_dir, *common, "name=b"), env={"SIGTERM_AFTER_READS": "31"}
    )
    assert killed.returncode == 143, killed.stderr[-3000:]
    state = torch.load(killed_dir / "checkpoints" / "last.pt", weights_only=True)
    assert state["epoch"] == 1 and 0 < state["step_in_epoch"] < 5, state["step_in_epoch"]
    resumed_dir = tmp_path / "out" / "b" / "r2"
    resumed = run_train(tiny_overrides(root, resumed_dir, *common, "name=b", "resume=auto"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = torch.load(tmp_path / "ref" / "r" / "checkpoints" / "last.pt", weights_only=True)
    b = torch.load(resumed_dir / "checkpoints" / "last.pt", weights_only=True)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


@pytest.mark.slow  # two nodes of two ranks each: tests/test_multinode.py
def test_two_process_ddp_over_http_equal_batches(data, tmp_path):
    root, pack = data
    with web_server(pack, tmp_path / "srv") as (url, _, log):
        out_root = tmp_path / "outputs"
        out = run_torchrun(
            root, tmp_path, f"output_root={out_root}", "name=wds", "trainer.epochs=2",
            *wds_overrides(url, tmp_path / "cache"), "loader.drop_last=false",
            "dataset.skip_corrupt=false", "trainer.batch_size=4",
        )  # fmt: skip
        requests = gets(log)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run_dir,) = list((out_root / "wds").iterdir())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1] and rows[0]["world_size"] == 2
    # 21 samples: 11 per rank (one repeat), 3 batches each; both ranks stepped together.
    assert all(r["train_images"] == 2 * 11 for r in rows), rows[0]
    # both ranks x epochs x the train and val splits: each shard fetched once on this node
    assert all(n == 1 for p, n in requests.items() if p.endswith(".tar")), requests


# -- COCO detection targets and DIV2K pairs ----------------------------------------------


def test_coco_boxes_and_labels_equal_disk_and_train_runs(tmp_path):
    """<key>.json members: every sample's boxes (bit for bit) and category ids equal
    storage=disk's, the pack keeps the category ids and dropped counts, and one train.py
    epoch of dataset=coco runs on the shards."""
    from test_detection import coco_run_args, read_jsonl

    from fastload.data.detection import category_ids, dropped_counts
    from fastload.data.layouts import CocoLayout
    from fastload.data.synthetic_coco import ensure_synthetic_coco

    root = ensure_synthetic_coco(
        tmp_path / "coco", train_images=12, val_images=6, workers=1, progress=False
    )
    layout = CocoLayout(str(root))
    store = WebDatasetStorage(
        path=str(tmp_path / "wds"), shard_samples=4, cache_dir=str(tmp_path / "cache")
    )
    store.prepare(layout, ["train", "val"])
    for split in ("train", "val"):
        want, got = DiskStorage().open(layout, split), store.open(layout, split)
        order = pack_order(len(want), "shuffled")
        assert len(got) == len(want) and np.array_equal(targets(got), targets(want)[order])
        assert len(got.shard_sizes) > 1 and not got.has("lr")
        assert category_ids(got).tolist() == category_ids(want).tolist()
        assert dropped_counts(got) == dropped_counts(want) != {}
        n_boxes = 0
        for i in range(len(want)):
            (gb, gl), (wb, wl) = (
                (got.get(i, "boxes"), got.get(i, "labels")),
                (want.get(order[i], "boxes"), want.get(order[i], "labels")),
            )
            assert gb.dtype == np.float32 and gl.dtype == np.int64
            np.testing.assert_array_equal(gb, wb)
            np.testing.assert_array_equal(gl, wl)
            assert sample(got, i) == sample(want, order[i])
            n_boxes += len(gl)
        assert n_boxes > 0 and any(not len(got.get(i, "labels")) for i in range(len(got)))
    shard = tmp_path / "wds" / "train" / "shard-000000.tar"
    with tarfile.open(shard) as tf:
        names = tf.getnames()
    assert names[:4] == [
        "00000000.jpg",
        "00000000.cls",
        "00000000.boxes.npy",
        "00000000.labels.npy",
    ]

    run_dir = tmp_path / "run"
    out = run_train(
        coco_run_args(
            root,
            run_dir,
            "trainer.epochs=1",
            "storage=webdataset",
            f"storage.path={tmp_path / 'wds'}",
            f"storage.cache_dir={tmp_path / 'cache'}",
        )
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 1 and rows[0]["train_images"] == 8  # 11 images with boxes, drop_last
    assert 0 <= rows[0]["val_map"] <= 100 and rows[0]["dropped_crowd"] == 1


def test_div2k_pairs_equal_disk_and_hr_only_packs_say_how_to_pair(tmp_path):
    """<key>.lr.png members: every HR record and LR pair equal storage=disk's bytes; the
    pair dataset gives the same patches; a pack without --lr has no pairs and says so."""
    from fastload.data.layouts import Div2kLayout
    from fastload.data.pairs import PairDataset
    from fastload.data.synthetic_div2k import ensure_synthetic_div2k
    from fastload.decode.pil import PILBackend

    root = ensure_synthetic_div2k(
        tmp_path / "div2k", train_count=4, val_count=2, min_long_side=96, max_long_side=128,
        workers=1, progress=False,
    )  # fmt: skip
    layout = Div2kLayout(str(root), lr="DIV2K_{split}_LR_bicubic/X{scale}")
    store = WebDatasetStorage(
        path=str(tmp_path / "wds"), shard_samples=3, cache_dir=str(tmp_path / "cache")
    )
    store.prepare(layout, ["train", "valid"])
    for split in ("train", "valid"):
        want, got = DiskStorage().open(layout, split), store.open(layout, split)
        order = pack_order(len(want), "shuffled")
        assert got.has("lr") and len(got) == len(want)
        assert np.array_equal(targets(got), targets(want)[order])
        for i in range(len(want)):
            assert got.get(i, "image") == want.get(order[i], "image")
            assert got.get(i, "lr") == want.get(order[i], "lr")
            assert "the lr member of" in got.describe(i, "lr") and "shard-" in got.describe(i, "lr")
        sets = [
            PairDataset(r, PILBackend(), scale=2, patch_size=16, train=True, seed=0, repeat=2)
            for r in (want, got)
        ]
        # a patch is drawn from (seed, epoch, index): the pack's index i is the folder's order[i]
        sets[0] = PairDataset(
            ReorderedReader(want, order), PILBackend(), scale=2, patch_size=16, train=True,
            seed=0, repeat=2,
        )  # fmt: skip
        for key in [(0, i) for i in range(len(sets[0]))]:
            a, b = sets[0][key], sets[1][key]
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), key
    with tarfile.open(tmp_path / "wds" / "train" / "shard-000000.tar") as tf:
        assert "00000000.lr.png" in tf.getnames()
    hr = root / "DIV2K_train_HR"
    assert (
        pack_main(["webdataset", str(tmp_path / "solo"), "--source", "div2k", "--hr", str(hr)]) == 0
    )
    solo = WebDatasetStorage(path=str(tmp_path / "solo"), auto_pack=False).open(None, hr.name)
    first = pack_order(len(solo), "shuffled")[0]  # the folder's image the pack holds first
    assert not solo.has("lr") and solo.get(0, "image") == (hr / f"{first + 1:04d}.png").read_bytes()
    with pytest.raises(StorageError, match="holds no field 'lr'"):
        solo.get(0, "lr")


# -- what a shard or manifest may hold instead of what it should ---------------------------


def write_shard(path: Path, samples: list[tuple[bytes, bytes]]) -> None:
    """A foreign shard: <key>.jpg + <key>.cls (raw bytes of the .cls member as given)."""
    import io

    with tarfile.open(path, "w") as tf:
        for i, (jpg, cls) in enumerate(samples):
            for ext, blob in (("jpg", jpg), ("cls", cls)):
                info = tarfile.TarInfo(f"s{i:04d}.{ext}")
                info.size = len(blob)
                tf.addfile(info, io.BytesIO(blob))


def test_an_html_page_instead_of_a_shard_is_never_cached_under_its_name(data, tmp_path):
    """A server answering 200 with an HTML page for a shard (pattern URL, no manifest): the
    error says what came back, nothing is cached under the shard's name, and once the
    server serves the shard the same command works."""
    root, _ = data
    samples = disk_samples(root)[:3]
    served = tmp_path / "www"
    served.mkdir()
    page = b"<!DOCTYPE html><html><body>Please log in</body></html>"
    (served / "part-000.tar").write_bytes(page)
    cache = user_folder(tmp_path / "c")
    with web_server(served, tmp_path / "srv") as (url, _, _log):
        store = WebDatasetStorage(url=f"{url}/part-{{000..000}}.tar", cache_dir=cache.parent,
                                  retries=0)  # fmt: skip
        with pytest.raises(StorageError) as err:
            store.prepare(root, ["train"])
        text = err.value.user_message
        assert "part-000.tar did not return a tar shard but an HTML/XML page" in text
        assert "Nothing was cached" in text
        assert not [p for p in cache.iterdir() if p.name.endswith("part-000.tar")]
        write_shard(served / "part-000.tar", [(jpg, b"%d" % t) for jpg, t in samples])
        for verdict in cache.glob("*.bad"):  # the verdict ages out: a fixed server is fetched
            os.utime(verdict, (time.time() - 3600, time.time() - 3600))
        store.prepare(root, ["train"])
        reader = store.open(root, "train")
        assert [sample(reader, i) for i in range(3)] == samples


@pytest.mark.parametrize("cls, needle", [(b"abc", "'abc'"), (b"1.7", "'1.7'"), (b"-1", "'-1'"),
                                         (b"999999", "label 999999 far beyond")])  # fmt: skip
def test_a_bad_cls_member_names_its_shard_and_sample(data, tmp_path, cls, needle):
    root, _ = data
    jpg = disk_samples(root)[0][0]
    shard = tmp_path / "part-000.tar"
    write_shard(shard, [(jpg, b"0"), (jpg, b"1"), (jpg, cls), (jpg, b"2")])
    store = WebDatasetStorage(url=str(tmp_path / "part-{000..000}.tar"), cache_dir=tmp_path / "c")
    with pytest.raises(StorageError) as err:
        store.prepare(root, ["train"])
    text = err.value.user_message
    assert str(shard) in text and needle in text
    assert "num_classes=1000000" not in text


def test_a_manifest_whose_labels_disagree_with_the_cls_members_is_refused(data, tmp_path):
    root, pack = data
    bad = tmp_path / "pack"
    shutil.copytree(pack, bad)
    manifest = json.loads((bad / "train" / "manifest.json").read_text())
    labels = manifest["shards"][1]["columns"]["label"]
    labels[2] = (labels[2] + 1) % 3
    (bad / "train" / "manifest.json").write_text(json.dumps(manifest))
    reader = WebDatasetStorage(url=str(bad)).open(root, "train")
    assert sample(reader, 0) == disk_samples(root)[0]  # shard 0 agrees
    with pytest.raises(StorageError, match=r"shard-000001.tar: sample 00000006 has .cls \d, but"):
        sample(reader, 4)


def test_skipping_a_whole_truncated_split_stops_the_run(data, tmp_path):
    """skip_corrupt=true over shards that are all truncated would "succeed" with a train loss
    of 0 on no data: more skipped than dataset.max_skipped_share stops the run."""
    root, pack = data
    bad = tmp_path / "pack"
    shutil.copytree(pack, bad)
    for shard in (bad / "train").glob("*.tar"):
        shard.write_bytes(shard.read_bytes()[:700])
    args = tiny_overrides(root, tmp_path / "run", "trainer.epochs=1", "dataset.skip_corrupt=true",
                          *wds_overrides(bad, tmp_path / "c"))  # fmt: skip
    out = run_train(args)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "training samples (100.0 %) could not be decoded" in out.stderr
    assert re.search(r"shard-0000\d\d.tar", out.stderr) and "Traceback" not in out.stderr


def test_a_stream_stopped_on_one_rank_goes_on_over_two_with_what_it_had_left(data, tmp_path):
    """Resume on another world size: the interrupted epoch's samples not yet trained, each
    once, over 2 ranks; the next epoch is a fresh 2-rank run's (shard_stream_order)."""
    root, pack = data
    common = [
        "loader.drop_last=false", "trainer.batch_size=4", f"output_root={tmp_path / 'out'}",
        "dataset.task._target_=tests.helpers.RecordingClassification",
        "storage._target_=tests.helpers.SigtermWebDataset",
        *wds_overrides(pack, tmp_path / "cache"),
    ]  # fmt: skip
    (tmp_path / "rec1").mkdir()
    (tmp_path / "rec2").mkdir()
    stopped_dir = tmp_path / "out" / "b" / "r1"
    stopped = run_train(
        tiny_overrides(root, stopped_dir, *common, "name=b"),
        env={"SIGTERM_AFTER_READS": "10", "RECORD_SAMPLES": str(tmp_path / "rec1")},
    )  # SIGTERM in step 3 of 6: 12 of 21 samples trained
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    checkpoint = stopped_dir / "checkpoints" / "last.pt"
    out = run_torchrun(
        root, tmp_path, *common, "name=b", f"resume={checkpoint}",
        env={"RECORD_SAMPLES": str(tmp_path / "rec2")},
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    before, after = recorded(tmp_path / "rec1"), recorded(tmp_path / "rec2")
    epoch0 = [i for rows in (*before.values(), *after.values()) for e, i, _ in rows if e == 0]
    assert len(before[0]) == 12 and sorted(epoch0) == list(range(21))
    # 9 left over 2 ranks: 3 + 2, then 2 + 2 (no rank gets a batch of one)
    assert [len([1 for e, _, _ in after[r] if e == 0]) for r in (0, 1)] == [5, 4]
    for r in (0, 1):  # shards of 4 samples: 4 x 5 + 1
        order, _ = shard_stream_order([4, 4, 4, 4, 4, 1], seed=0, epoch=1, rank=r,
                                      world_size=2, window=6)  # fmt: skip
        assert [i for e, i, _ in after[r] if e == 1] == order


# Reads every train sample of the local pack argv[1] with the shard cache argv[2]; prints
# how many shards this process hashed, or the error.
READ_LOCAL_PACK = """
import sys
import fastload.storage.webdataset as wds
from fastload.errors import StorageError
hashed = []
real_xxh3 = wds.file_xxh3
wds.file_xxh3 = lambda path: hashed.append(path) or real_xxh3(path)
reader = wds.WebDatasetStorage(url=sys.argv[1], cache_dir=sys.argv[2]).open(sys.argv[3], "train")
try:
    for i in range(len(reader)):
        reader.get(i, "image")
    print("hashed", len(hashed), flush=True)
except StorageError as exc:
    print("error:", exc, flush=True)
"""


def test_a_local_shard_is_hashed_once_per_node_until_it_changes(data, tmp_path):
    """verify=true hashed every local shard in every process that opened it: each
    DataLoader worker read the whole split once more. A process of the node that hashed
    it leaves a marker in the cache folder, and the next process trusts it while the
    shard's file is the same; a shard written since (even with its size and mtime kept)
    is hashed again, and a corrupt one is still named."""
    root, pack = data
    local = tmp_path / "pack"
    shutil.copytree(pack, local)
    shards = len(json.loads((local / "train" / "manifest.json").read_text())["shards"])

    def read() -> str:
        cmd = [sys.executable, "-c", READ_LOCAL_PACK, str(local), str(tmp_path / "c"), str(root)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                             cwd=REPO)  # fmt: skip
        return out.stdout.strip() or out.stderr

    assert read() == f"hashed {shards}"
    assert read() == "hashed 0"
    shard = local / "train" / "shard-000002.tar"
    before = shard.stat()
    data_ = bytearray(shard.read_bytes())
    data_[700] ^= 0xFF  # inside the first member's bytes: the tar index still reads
    shard.write_bytes(bytes(data_))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    for _ in range(2):  # named by every process: no marker says ok
        said = read()
        assert said.startswith("error: corrupt shard") and "shard-000002.tar" in said, said
    data_[700] ^= 0xFF
    shard.write_bytes(bytes(data_))
    assert read() == "hashed 1"
    assert read() == "hashed 0"


# -- the tar index ------------------------------------------------------------------------


def tarfile_outcome(path):
    """What tarfile reads of a shard (keys, members in their order) or the error it gives."""
    with open(path, "rb") as fh:
        return index_outcome(lambda: wds.tarfile_index(fh, "S", os.path.getsize(path)))


def index_outcome(read):
    try:
        keys, members = read()
    except (StorageError, ValueError) as exc:  # tarfile: ValueError for a huge member size
        return type(exc).__name__, str(exc)
    return keys, [(ext, list(by_key.items())) for ext, by_key in members.items()]


def fast_path_reads(path) -> bool:
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        try:
            wds.fast_index(mm, os.path.getsize(path))
        except wds.UnusualTar:
            return False
    return True


def write_tar(path, fmt, long_name=True):
    """A tar written by Python's tarfile in `fmt`: a folder, members in folders, a name
    over 100 characters (ustar: its prefix field), a link, empty and odd-sized members."""
    with tarfile.open(path, "w", format=fmt) as tf:
        folder = tarfile.TarInfo("imgs")
        folder.type = tarfile.DIRTYPE
        tf.addfile(folder)
        names = ["00000000.jpg", "00000000.cls", "imgs/00000001.JPG", "imgs/00000001.cls",
                 "00000002.seg.png", "00000002.cls", "00000002.cls"]  # fmt: skip
        if long_name:
            names += [f"{'d' * 90}/{'e' * 60}/00000003.jpg", f"{'d' * 90}/{'e' * 60}/00000003.cls"]
        for n, name in enumerate(names):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = (0, 1, 511, 512, 513, 1000, 3, 70000, 2)[n], 1_700_000_000 + n
            tf.addfile(info, io.BytesIO(os.urandom(info.size)))
        link = tarfile.TarInfo("00000004.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, "00000000.jpg"
        tf.addfile(link)


def test_the_fast_tar_index_reads_what_tarfile_reads(data, tmp_path):
    """tar_index walks the tar headers itself (~10x faster than tarfile, which every
    DataLoader worker ran over every shard it opened): the same keys, members, offsets and
    order as tarfile for the packer's shards and for tars of the ustar, GNU and pax formats;
    GNU long names and pax headers are left to tarfile."""
    _root, pack = data
    for shard in sorted(pack.glob("*/*.tar")):
        assert fast_path_reads(shard), shard
        assert index_outcome(lambda s=shard: wds.tar_index(s, "S")) == tarfile_outcome(shard)
    for fmt, long_fast in ((tarfile.USTAR_FORMAT, True), (tarfile.GNU_FORMAT, False),
                           (tarfile.PAX_FORMAT, False)):  # fmt: skip
        for long_name in (False, True):
            path = tmp_path / f"{fmt}-{long_name}.tar"
            write_tar(path, fmt, long_name)
            assert fast_path_reads(path) == (long_fast or not long_name), (fmt, long_name)
            got = index_outcome(lambda p=path: wds.tar_index(p, "S"))
            assert got == tarfile_outcome(path) and len(got[0]) == 3 + long_name, got
    # a size in base-256 (GNU, for members of 8 GiB and more) reads as tarfile reads it
    raw = bytearray((tmp_path / f"{tarfile.USTAR_FORMAT}-True.tar").read_bytes())
    at = 1024  # the header of 00000000.cls (1 byte), after the folder's and 00000000.jpg's
    assert raw[at : at + 12] == b"00000000.cls" and raw[at + 124 : at + 136] == b"%011o\0" % 1
    raw[at + 124 : at + 136] = b"\x80" + (1).to_bytes(11, "big")
    raw[at + 148 : at + 156] = b" " * 8
    raw[at + 148 : at + 156] = b"%06o\0 " % sum(raw[at : at + 512])
    (tmp_path / "b256.tar").write_bytes(raw)
    assert fast_path_reads(tmp_path / "b256.tar")
    assert index_outcome(lambda: wds.tar_index(tmp_path / "b256.tar")) == tarfile_outcome(
        tmp_path / "b256.tar"
    )


def test_the_fast_tar_index_fails_as_tarfile_on_cut_and_damaged_shards(data, tmp_path):
    """A shard cut anywhere (in a header, a member, its padding) or with a damaged header
    (a wrong byte, with its checksum right or not) gives what tarfile gives: CorruptShard
    naming it, or the members before the damage (the reader then finds fewer samples than
    the manifest says)."""
    _root, pack = data
    good = (pack / "train" / "shard-000000.tar").read_bytes()
    path = tmp_path / "s.tar"
    rng = np.random.default_rng(0)
    ends = [0, 100, 511, 512, 700, 1024, len(good) - 1024, len(good) - 1]
    variants = [good[:n] for n in ends + rng.integers(0, len(good), 30).tolist()]
    heads = [0, 512 * (1 + -(-int(good[124:135], 8) // 512))]  # the first two headers
    for at in heads:
        for where in (0, 5, 103, 124, 130, 140, 148, 156, 200, 333, 345, 400):
            for value in (0x00, 0x20, 0x38, 0x80, 0xFF, 0x4C):
                raw = bytearray(good)
                raw[at + where] = value
                variants.append(bytes(raw))
                if where != 148:  # the same with its checksum right: fields tarfile refuses
                    raw[at + 148 : at + 156] = b" " * 8
                    raw[at + 148 : at + 156] = b"%06o\0 " % sum(raw[at : at + 512])
                    variants.append(bytes(raw))
    errors = 0
    for raw in variants:
        path.write_bytes(raw)
        want = tarfile_outcome(path)
        assert index_outcome(lambda: wds.tar_index(path, "S")) == want, raw[:64]
        errors += want[0] == "CorruptShard"
    assert errors > 20
    path.write_bytes(good[:1500])
    with pytest.raises(StorageError, match=r"corrupt shard S: truncated, member 00000000.jpg ends"):
        wds.tar_index(path, "S")


def test_a_reopened_shard_is_mapped_again_without_reading_its_headers_while_unchanged(
    data, tmp_path, monkeypatch
):
    """Every DataLoader worker opens nearly every shard, and opens again those its few
    memory maps let go: each opening read the tar headers and every .cls member again. What
    an opening computed is kept (8 bytes a sample: the image members' offsets and lengths)
    while the shard's file is the same; one written since is read, and its labels checked
    against the manifest, again."""
    root, pack = data
    local = tmp_path / "pack"
    shutil.copytree(pack, local)
    reader = WebDatasetStorage(url=str(local), cache_dir=tmp_path / "c").open(root, "train")
    reader.max_maps = 1  # each shard's map is closed when the next one opens
    indexed = []
    index = wds.file_index
    monkeypatch.setattr(wds, "file_index", lambda fh, name: indexed.append(name) or index(fh, name))
    first = [sample(reader, i) for i in range(len(reader))]
    assert len(indexed) == 6 and len(reader._maps) == 1
    assert [sample(reader, i) for i in range(len(reader))] == first
    assert len(indexed) == 6  # mapped again, not read again
    offsets, lengths = reader._kept[0][1]["image"]  # no .cls: the manifest has the labels
    assert list(reader._kept[0][1]) == ["image"] and offsets.dtype == lengths.dtype == np.int32
    shard = local / "train" / "shard-000001.tar"
    shutil.copyfile(shard, tmp_path / "copy.tar")
    os.replace(tmp_path / "copy.tar", shard)  # the same bytes in a new file
    assert [sample(reader, i) for i in range(len(reader))] == first
    assert indexed[6:] == [str(shard)]
    _keys, members = wds.tar_index(shard)
    at, _n = members["cls"]["00000005"]  # sample 1 of shard 1
    raw = bytearray(shard.read_bytes())
    raw[at] = ord("0") + (raw[at] - ord("0") + 1) % len(CLASSES)
    before = shard.stat()
    shard.write_bytes(bytes(raw))  # in place (the hash is checked once per process)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))  # not in the same tick
    with pytest.raises(StorageError, match="sample 00000005 has .cls .*, but the manifest"):
        sample(reader, 5)
