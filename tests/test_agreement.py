"""What the ranks of a run compare (fastload/agreement.py), without a process group: the
fingerprint of a split, and the errors made of differing records. tests/test_multinode.py
runs the comparison between two nodes."""

from __future__ import annotations

import shutil

import pytest
from conftest import make_image_folder

from fastload.agreement import check_data_alike, check_runs_alike, split_fingerprint
from fastload.errors import ConfigError, DatasetError
from fastload.storage.disk import DiskReader
from fastload.storage.shards import ShardStorage


def test_a_splits_fingerprint_is_its_names_and_labels_wherever_it_lies(tmp_path):
    root = make_image_folder(tmp_path / "a", per_split=(3, 1), size=(24, 16))
    copy = shutil.copytree(root, tmp_path / "b")
    print_of = lambda r: split_fingerprint(DiskReader(r / "train"))  # noqa: E731
    first = print_of(root)
    assert first.startswith("files:") and print_of(copy) == first  # another folder, alike
    cat = copy / "train" / "cat"
    (cat / "cat_000.jpg").rename(cat / "cat_zzz.jpg")  # as many files, another order
    assert print_of(copy) != first
    renamed = print_of(copy)
    (cat / "cat_zzz.jpg").rename(copy / "train" / "dog" / "cat_zzz.jpg")  # another class
    assert print_of(copy) not in (first, renamed)
    # a pack of it has its own kind: a checkpoint of the folder is not compared with it
    storage = ShardStorage(path=str(tmp_path / "pack"))
    storage.prepare(root, ["train"])
    packed = split_fingerprint(storage.open(root, "train"))
    assert packed.startswith("pack:") and packed.split(":")[0] != first.split(":")[0]


def test_a_folders_fingerprint_is_that_of_its_names_as_text(tmp_path):
    """The index holds its names as the file system's bytes, 1 a character where numpy's
    '<U' strings took 4; the fingerprint is still that of the '<U' array of them (split
    fingerprints are kept in checkpoints), names of several widths, not UTF-8 included,
    and every name reads back as os.walk spelled it."""
    import os

    import numpy as np
    import xxhash

    from fastload.agreement import feed

    root = make_image_folder(tmp_path / "a", per_split=(3, 1), size=(24, 16))
    cat = root / "train" / "cat"
    jpeg = (cat / "cat_000.jpg").read_bytes()
    for name in ("ça_été.jpg", "猫" * 9 + ".jpg"):
        (cat / name).write_bytes(jpeg)
    (root / "train" / "dog" / "x").mkdir()
    with open(os.path.join(os.fsencode(root / "train" / "dog" / "x"), b"caf\xe9.jpg"), "wb") as f:
        f.write(jpeg)  # Latin-1, not UTF-8
    reader = DiskReader(root / "train")
    index = reader.index
    walked = sorted(
        os.path.relpath(os.path.join(d, n), root / "train")
        for d, _, names in os.walk(root / "train") for n in names
    )  # fmt: skip
    names = [index.name(i) for i in range(len(index))]
    assert sorted(names) == walked and "dog/x/caf\udce9.jpg" in names
    assert index.paths.dtype.kind == "S" and index.names(0, len(index)) == names
    assert [reader.source.file(i) for i in range(len(index))] == [
        os.path.join(root / "train", n) for n in names
    ]
    h = xxhash.xxh3_128()  # split_fingerprint as it was, on the '<U' array of the names
    h.update(f"{len(index)}\0{list(index.classes)!r}\0{list(reader.schema.names)!r}\n".encode())
    feed(h, np.asarray(reader.column("label"), np.int64))
    feed(h, np.array(names))
    assert split_fingerprint(reader) == f"files:{h.hexdigest()}"


def records(**rank1) -> list[dict]:
    rank0 = {"host": "node-a", "config": "c0", "code": "fastload 0.1.0, sources 11"}
    return [rank0, {**rank0, "host": "node-b", **rank1}]


def test_a_rank_on_other_code_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"rank 1 \(host node-b\) runs other fastload code "
                       r"than rank 0 \(host node-a\): fastload 0.1.0, sources 22 there"):  # fmt: skip
        check_runs_alike(None, None, records(code="fastload 0.1.0, sources 22"))
    check_runs_alike(None, None, records())  # alike: nothing gathered, nothing said


def data(samples: int, fingerprint: str, root: str) -> dict:
    return {"host": f"host-{root}", "root": root,
            "splits": {"train": {"samples": samples, "fingerprint": fingerprint},
                       "val": {"samples": 3, "fingerprint": "files:v"}}}  # fmt: skip


def test_a_rank_on_other_data_is_refused_naming_the_split():
    with pytest.raises(DatasetError, match=r"rank 1 \(host host-b\) reads another train split "
                       r"than rank 0 \(host host-a\): 11 samples from dataset.root=b there, 12 "
                       r"from dataset.root=a on rank 0"):  # fmt: skip
        check_data_alike([data(12, "files:x", "a"), data(11, "files:y", "b")])
    with pytest.raises(DatasetError, match=r"as many samples \(12\), but other files"):
        check_data_alike([data(12, "files:x", "a"), data(12, "files:x", "a"),
                          data(12, "files:y", "c")])  # fmt: skip
    check_data_alike([data(12, "files:x", "a"), data(12, "files:x", "b")])  # roots may differ
    # packs: their checksums, which packing again with another Pillow changes too
    with pytest.raises(DatasetError, match=r"but another pack of them \(other records or "):
        check_data_alike([data(12, "pack:fastload-shards:x", "a"),
                          data(12, "pack:fastload-shards:y", "b")])  # fmt: skip


def test_node_local_folders_and_host_resources_are_left_out_of_the_config_compared(tmp_path):
    from conftest import compose_config

    from fastload.agreement import config_digest, shared_config

    def digest(*overrides):
        # (HydraConfig set: the run name's interpolations read it, as in a run)
        return config_digest(shared_config(compose_config(list(overrides), tmp_path / "run")))

    base = digest()
    # unlike nodes: another dataset copy, more cores, less RAM for pinned memory
    assert digest("dataset.root=/local/copy", "loader.num_workers=14",
                  "loader.pin_memory_max_mb=2048") == base  # fmt: skip
    webdataset = digest("storage=webdataset")
    assert digest("storage=webdataset", "storage.cache_gb=64") == webdataset
    assert digest("optim.base_lr=0.5") != base
    assert digest("trainer.batch_size=7") != base
    assert digest("loader.drop_last=false") != base
