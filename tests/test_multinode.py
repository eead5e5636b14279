"""Two nodes on one machine: two torchrun launches (`--nnodes=2 --node-rank=0|1`, c10d
rendezvous) of 2 ranks each, one job of world size 4. Each node has its own node-local
folders on its command line (tmpfs staging, shard cache, pack); output_root is shared, like a
shared file system. What is done once per node must happen once on each node, into its own
folder, and both launches must write one run directory."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from conftest import gets, make_image_folder, run_two_nodes, tails, web_server

from fastload.data.sampling import shard_stream_order
from fastload.pack import main as pack_main
from fastload.storage import tmpfs
from fastload.storage.user_dir import user_folder

RANKS_PER_NODE = 2


def the_run_dir(out_root: Path, name: str, rdzv_id: str) -> Path:
    """The one run directory both launches wrote, named after the rendezvous id."""
    runs = sorted(p.name for p in (out_root / name).iterdir())
    assert runs == [f"torchrun-{rdzv_id}"], runs  # not one per node, not a `-1` sibling
    return out_root / name / runs[0]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_trained_as_one_job(run_dir: Path, nodes, per_node: int = RANKS_PER_NODE) -> list[dict]:
    """2 epochs of world size 2 x per_node, written once (by global rank 0), config and
    claim once."""
    rows = metrics(run_dir)
    assert [r["epoch"] for r in rows] == [0, 1], rows
    assert all(r["world_size"] == 2 * per_node for r in rows), rows
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    claim = json.loads((run_dir / ".fastload-run.json").read_text())
    assert claim["launch"] == f"torchrun:{run_dir.name.removeprefix('torchrun-')}", claim
    # global rank 0 (on whichever node) prints the end table
    assert sum(f"run directory  {run_dir}" in n.stdout for n in nodes) == 1, tails(nodes)
    return rows


@pytest.mark.parametrize(
    "cleanup", [pytest.param(False, marks=pytest.mark.slow), True], ids=["kept", "cleanup"]
)  # what a staged copy holds: tests/test_storage.py, in the default suite
def test_two_nodes_stage_to_tmpfs_once_each_into_their_own_folder(tiny_folder, tmp_path, cleanup):
    """storage=tmpfs stages once per node, by its local rank 0 (global ranks 0 and 2), into
    the node's own target_dir; storage.cleanup=true removes each node's copy at the end."""
    out_root, record = tmp_path / "shared" / "outputs", tmp_path / "shared" / "staged-by.txt"
    target = [tmp_path / f"node{k}" / "stage" for k in range(2)]
    nodes = run_two_nodes(
        tiny_folder, tmp_path, f"output_root={out_root}", "name=tmpfs", "trainer.batch_size=2",
        "storage=tmpfs", "storage._target_=tests.helpers.RecordingTmpfs",
        f"+storage.record={record}", f"storage.cleanup={str(cleanup).lower()}",
        per_node=lambda k: [f"storage.target_dir={target[k]}"], rdzv_id="tmpfs-job",
    )  # fmt: skip
    assert [n.returncode for n in nodes] == [0, 0], tails(nodes)
    check_trained_as_one_job(the_run_dir(out_root, "tmpfs", "tmpfs-job"), nodes)
    # Staged once per node: by the two local ranks 0, one on each node (global ranks 0, 2).
    assert sorted(record.read_text().split(), key=int) == ["0", "2"], tails(nodes)
    staged = tmpfs.staged_name(tiny_folder)
    logs = [
        the_run_dir(out_root, "tmpfs", "tmpfs-job") / f for f in ("train.log", "train.rank2.log")
    ]
    for k in range(2):
        said = nodes[k].stdout + nodes[k].stderr
        mine = tmpfs.user_folder(target[k])
        assert f"into {mine / staged} in" in said, tails(nodes)  # its own folder
        assert str(target[1 - k]) not in said, tails(nodes)  # not the other node's
        # each node's own log file: rank 0's train.log, the second node's first rank's own
        assert f"into {mine / staged} in" in logs[k].read_text()
        assert str(target[1 - k]) not in logs[k].read_text()
        if cleanup:
            assert os.listdir(mine) == [], os.listdir(mine)
        else:
            assert os.listdir(mine) == [staged]  # the copy, no temporary folder left
            copy = mine / staged
            assert (copy / tmpfs.MANIFEST).is_file()
            assert sorted(p.relative_to(copy) for p in copy.rglob("*.jpg")) == sorted(
                p.relative_to(tiny_folder) for p in tiny_folder.rglob("*.jpg")
            )


@pytest.fixture(scope="module")
def two_copies(tmp_path_factory):
    """A dataset and a copy of it, as two nodes' own dataset.root; a third copy with one
    training file fewer."""
    base = tmp_path_factory.mktemp("copies")
    root = make_image_folder(base / "a", per_split=(4, 2), size=(40, 32))
    shutil.copytree(root, base / "b")
    shutil.copytree(root, base / "short")
    (base / "short" / "train" / "dog" / "dog_003.jpg").unlink()
    return root, base / "b", base / "short"


def test_two_nodes_with_static_rendezvous_write_one_run_directory(two_copies, tmp_path):
    """torchrun --master-addr/--master-port without --rdzv-id (static rendezvous): no run id
    is given and each node's agent starts at its own time, yet both nodes agree on one run
    directory, named by the launch's first process through the launch's TCP store. Node 1
    reads its own copy of the dataset: dataset.root is node-local, and two copies alike
    (file names, labels) are the same data (fastload/agreement.py)."""
    root, copy, _ = two_copies
    out_root = tmp_path / "shared" / "outputs"
    nodes = run_two_nodes(root, tmp_path, f"output_root={out_root}", "name=static",
                          "trainer.batch_size=2", rdzv_id=None, nproc=1,
                          per_node=lambda k: [f"dataset.root={copy}"] if k == 1 else [])  # fmt: skip
    assert [n.returncode for n in nodes] == [0, 0], tails(nodes)
    (run_dir,) = (out_root / "static").iterdir()  # not one per node
    stamp = run_dir.name.removeprefix("torchrun-")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d", stamp), run_dir.name
    check_trained_as_one_job(run_dir, nodes, per_node=1)


@pytest.fixture(scope="module")
def wds_pack(tmp_path_factory):
    """21 train samples in 2 shards (11 + 10), 9 val samples in 1 shard. Cut so that every
    node needs every shard in each epoch (see the test), so "once per node" is exactly two
    fetches of each shard in all."""
    base = tmp_path_factory.mktemp("wds-nodes")
    root = make_image_folder(base / "tiny", per_split=(7, 3), size=(48, 40))
    assert pack_main(["webdataset", str(root), str(base / "pack"), "--shard-samples", "11"]) == 0
    return root, base / "pack"


def shards_of_ranks(ranks, epoch: int, sizes=(11, 10), world_size=4, seed=0) -> set[int]:
    """The training shards that `ranks` read in `epoch` (the sampler's order)."""
    starts = [0, sizes[0]]
    need = set()
    for r in ranks:
        order, _ = shard_stream_order(
            sizes, seed=seed, epoch=epoch, rank=r, world_size=world_size, window=6
        )
        need |= {k for i in order for k in range(2) if starts[k] <= i < starts[k] + sizes[k]}
    return need


def cached_shards(cache: Path) -> list[str]:
    """The complete shards in a node's cache (`<hash>-shard-NNNNNN.tar`)."""
    mine = user_folder(cache)
    return sorted(p.name.split("-", 1)[1] for p in mine.iterdir() if p.name.endswith(".tar"))


def test_two_nodes_fetch_each_shard_once_per_node_into_their_own_cache(wds_pack, tmp_path):
    """storage=webdataset over HTTP with a node-local cache_dir each: every shard is fetched
    once per node (the two ranks of a node share their node's fetch), so twice in all, and
    each node's cache holds the shards; one run directory."""
    root, pack = wds_pack
    # The premise: both nodes (global ranks 0-1 and 2-3, whichever node got which) read both
    # training shards in both epochs, and all of val's single shard is read by every node.
    assert all(shards_of_ranks(rs, e) == {0, 1} for rs in ((0, 1), (2, 3)) for e in (0, 1))
    val = json.loads((pack / "val" / "manifest.json").read_text())
    assert [s["count"] for s in val["shards"]] == [9]
    out_root = tmp_path / "shared" / "outputs"
    cache = [tmp_path / f"node{k}" / "cache" for k in range(2)]
    with web_server(pack, tmp_path / "srv") as (url, _, log):
        nodes = run_two_nodes(
            root, tmp_path, f"output_root={out_root}", "name=wds", "storage=webdataset",
            f"storage.url='{url}'", "storage.shuffle_buffer=6", "storage.retry_backoff_s=0.05",
            "trainer.batch_size=2", "loader.drop_last=false", "dataset.skip_corrupt=false",
            per_node=lambda k: [f"storage.cache_dir={cache[k]}"], rdzv_id="wds-job",
        )  # fmt: skip
        requests = gets(log)
    assert [n.returncode for n in nodes] == [0, 0], tails(nodes)
    rows = check_trained_as_one_job(the_run_dir(out_root, "wds", "wds-job"), nodes)
    assert all(r["train_images"] == 4 * 6 for r in rows), rows  # 21 + 3 padded, 6 per rank
    tars = {p: n for p, n in requests.items() if p.endswith(".tar")}
    want = ["/train/shard-000000.tar", "/train/shard-000001.tar", "/val/shard-000000.tar"]
    assert sorted(tars) == want and set(tars.values()) == {2}, requests  # once per node
    for k in range(2):
        names = ["shard-000000.tar", "shard-000000.tar", "shard-000001.tar"]  # val, train x2
        assert cached_shards(cache[k]) == names, sorted(os.listdir(user_folder(cache[k])))


def packed_lines(text: str, dst: Path) -> list[str]:
    return [line for line in text.splitlines() if f"into {dst} in" in line and "packed" in line]


@pytest.mark.slow  # the same packing code as the shared-folder test below, with other paths
def test_two_nodes_pack_once_each_into_their_own_pack_path(tmp_path):
    """storage=shards with a node-local storage.path each: each node packs every split once
    (its local rank 0), into its own folder; nothing is packed beside the shared dataset."""
    root = make_image_folder(tmp_path / "shared" / "data")
    out_root = tmp_path / "shared" / "outputs"
    path = [tmp_path / f"node{k}" / "pack" for k in range(2)]
    nodes = run_two_nodes(
        root, tmp_path, f"output_root={out_root}", "name=pack", "trainer.batch_size=2",
        "storage=shards", per_node=lambda k: [f"storage.path={path[k]}"], rdzv_id="pack-job",
    )  # fmt: skip
    assert [n.returncode for n in nodes] == [0, 0], tails(nodes)
    check_trained_as_one_job(the_run_dir(out_root, "pack", "pack-job"), nodes)
    for k in range(2):
        said = nodes[k].stdout + nodes[k].stderr
        for split in ("train", "val"):
            assert len(packed_lines(said, path[k] / split)) == 1, tails(nodes)
            assert (path[k] / split / "meta.json").is_file()
        assert str(path[1 - k]) not in said, tails(nodes)
    assert sorted(os.listdir(root.parent)) == ["data", "outputs"]  # no data.packs beside it


@pytest.mark.slow  # a race made on purpose (PackTogetherShards); the default suite's budget
def test_two_nodes_packing_into_one_shared_folder_at_once_both_go_on(tmp_path):
    """The default pack folder lies beside dataset.root, on a shared file system for every
    node, and the local ranks 0 of two nodes pack it at the same time: the node that
    finishes second finds the other's complete pack in place and trains on it."""
    root = make_image_folder(tmp_path / "shared" / "data")
    out_root = tmp_path / "shared" / "outputs"
    nodes = run_two_nodes(
        root,
        tmp_path,
        f"output_root={out_root}",
        "name=shared",
        "trainer.batch_size=2",
        "storage=shards",
        "storage._target_=tests.helpers.PackTogetherShards",
        f"+storage.sync_dir={tmp_path / 'shared' / 'sync'}",
        rdzv_id="shared-job",
        nproc=1,
    )  # fmt: skip  (one rank per node: a node's local rank 0 packs, alone or not)
    assert [n.returncode for n in nodes] == [0, 0], tails(nodes)
    check_trained_as_one_job(the_run_dir(out_root, "shared", "shared-job"), nodes, per_node=1)
    pack = Path(f"{root}.packs") / "shards-jpeg-orig"
    said = nodes[0].stdout + nodes[1].stdout
    for split in ("train", "val"):
        assert len(list((tmp_path / "shared" / "sync").glob("*-1"))) == 2  # both packed
        assert len(packed_lines(said, pack / split)) == 1, tails(nodes)  # one of them won
        assert said.count(f"{pack / split} was packed meanwhile") == 1, tails(nodes)
    assert sorted(p.name for p in pack.iterdir()) == ["train", "val"]  # no temporary left


# -- every rank alike: config, code, data ----------------------------------------------------


def run_unlike_nodes(root, tmp_path, name: str, node1: list[str], *extra: str):
    """Two nodes of one rank each, node 1 with `node1` at the end of its command line."""
    out_root = tmp_path / "shared" / "outputs"
    return run_two_nodes(
        root, tmp_path, f"output_root={out_root}", f"name={name}", "trainer.batch_size=2",
        "trainer.epochs=1", *extra, per_node=lambda k: node1 if k == 1 else [],
        rdzv_id=f"{name}-job", nproc=1, timeout=120, grace=20,
    )  # fmt: skip


def refused_alike(nodes, *needles: str) -> None:
    """Both nodes stopped by themselves (not killed after a wait), each rank with the one
    error line that has every needle (the same on every rank)."""
    assert all(n.returncode not in (0, None) for n in nodes), tails(nodes)
    assert not any("[run_two_nodes: killed" in n.stderr for n in nodes), tails(nodes)
    said = []
    for n in nodes:
        errors = [line for line in n.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and all(w in errors[0] for w in needles), tails(nodes)
        # no traceback of fastload's (torchrun's agent prints its own of the failed worker)
        assert not re.search(r'File ".*/fastload/', n.stderr), tails(nodes)
        said += errors
    assert said[0] == said[1], said


def test_a_node_whose_dataset_copy_differs_is_refused_on_every_rank(two_copies, tmp_path):
    """Node 1's dataset.root lacks a file: its rank would plan other batches (some samples
    trained twice, others never) and run another number of steps, and the ranks then hung in
    mismatched collectives until the process group's timeout. Every rank stops at once with
    the same error, naming the split."""
    root, _, short = two_copies
    nodes = run_unlike_nodes(root, tmp_path, "short", [f"dataset.root={short}"])
    # the record's rank 0 is whichever node the rendezvous made it
    refused_alike(nodes, "reads another train split than rank 0", " 11 ", " 12 ",
                  str(short), "rsync")  # fmt: skip


def test_a_node_started_with_another_setting_is_refused_naming_the_key(two_copies, tmp_path):
    """Node 1 got optim.base_lr=0.5: its replica would step with another LR, silently (and
    the run's config.yaml and checkpoints would hold rank 0's alone)."""
    root, _, _ = two_copies
    nodes = run_unlike_nodes(root, tmp_path, "lr", ["optim.base_lr=0.5"])
    refused_alike(nodes, "was started with another configuration than rank 0",
                  "optim.base_lr: ", "0.2", "0.5", "same command line")  # fmt: skip
    # refused before any work: no epoch ran
    assert not list((tmp_path / "shared" / "outputs").rglob("metrics.jsonl"))
