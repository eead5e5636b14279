"""The one builder (fastload/pipeline.py): normalisation placed exactly once and told to both
sides, impossible combinations refused when building; the shared temp-folder helper."""

from __future__ import annotations

import os
import time

import pytest
import torch
from conftest import build_test_loader, compose_config

from fastload import atomic
from fastload.data.dataset import ImageDataset
from fastload.errors import ConfigError
from fastload.pipeline import build_data, normalize_on


@pytest.mark.parametrize("where", ["device", "cpu"])
def test_normalisation_happens_in_exactly_one_place(tiny_folder, where):
    loader = build_test_loader(f"loader.normalize_on={where}", folder=tiny_folder)
    assert isinstance(loader.dataset, ImageDataset)
    in_workers = loader.dataset.normalize is not None
    on_device = loader.device_prep.normalize is not None
    assert (in_workers, on_device) == ((True, False) if where == "cpu" else (False, True))
    loader.set_epoch(0)
    host = next(iter(loader.host_batches()))["image"]
    assert host.dtype == (torch.float32 if where == "cpu" else torch.uint8)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["loader.normalize_on=gpu"], "loader.normalize_on='gpu': use 'device' or 'cpu'"),
        (["loader.input_dtype=fp8"], "loader.input_dtype='fp8'"),
        (["loader=prefetch", "loader.normalize_on=cpu"], "loader.normalize_on=device"),
        (["loader=prefetch+bg", "loader.normalize_on=cpu"], "normalising twice"),
    ],
)
def test_impossible_combinations_are_refused_when_building(tiny_folder, overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("+", r"\+").replace("(", r"\(")):
        build_test_loader(*overrides, folder=tiny_folder)


def test_a_gpu_decoder_with_cpu_normalisation_is_refused_before_any_worker():
    class GpuDecoding:
        name = "nvjpeg"
        device_decoder = object()

    cfg = compose_config(["loader.normalize_on=cpu"])
    with pytest.raises(ConfigError, match="backend=nvjpeg decodes in device prep"):
        normalize_on(cfg, GpuDecoding())
    assert normalize_on(compose_config([]), GpuDecoding()) == "device"


def test_build_data_shares_one_backend_and_refuses_a_batch_too_big(tiny_folder):
    from fastload.dist import DistContext
    from fastload.pipeline import build_plan, build_storage

    over = [f"dataset.root={tiny_folder}", "dataset.prepare=null", "dataset.num_classes=3"]
    cfg = compose_config([*over, "trainer.batch_size=4", "loader.num_workers=0"])
    data = build_data(
        build_plan(cfg, storage=build_storage(cfg)), DistContext(), channels_last=False
    )
    assert data.train.dataset.backend is data.val.dataset.backend is data.backend
    assert len(data.train.dataset) == 18 and len(data.val.dataset) == 9
    assert data.train_reader is data.train.dataset.reader
    big = compose_config([*over, "trainer.batch_size=64"])
    with pytest.raises(ConfigError, match="trainer.batch_size=64 is larger than the 18"):
        build_data(build_plan(big), DistContext(), channels_last=False)


# -- fastload/atomic.py: build in a temporary folder, rename into place ------------------------


def dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_two_hosts_sharing_a_folder_never_remove_each_others_build(tmp_path, monkeypatch):
    final = tmp_path / "shared" / "pack"
    final.parent.mkdir()
    gone = dead_pid()
    ours_dead = atomic.temp_path(final, host="node-a", pid=gone)
    theirs = atomic.temp_path(final, host="node-b", pid=gone)  # alive or not: node-b's business
    theirs_old = atomic.temp_path(final, host="node-c", pid=1)
    for d in (ours_dead, theirs, theirs_old):
        d.mkdir()
    day_ago = time.time() - 2 * atomic.DAY_S
    os.utime(theirs_old, (day_ago, day_ago))

    monkeypatch.setattr(atomic, "process_space", lambda: "node-a")
    with atomic.building(final) as tmp:
        assert tmp == atomic.temp_path(final, host="node-a", pid=os.getpid())
        (tmp / "data").write_text("x")
    assert (final / "data").read_text() == "x" and not tmp.exists()
    assert not ours_dead.exists()  # this host, process gone: stale
    assert theirs.exists()  # another host's folder: its pid means nothing here
    assert not theirs_old.exists()  # another host's, untouched for over a day: stale


def test_a_failed_build_leaves_nothing_and_a_concurrent_one_is_reported(tmp_path):
    final = tmp_path / "pack"
    with pytest.raises(RuntimeError), atomic.building(final) as tmp:
        (tmp / "half").write_text("x")
        raise RuntimeError("disk full")
    assert not final.exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(atomic.AlreadyBuilt), atomic.building(final) as tmp:
        final.mkdir()
        (final / "theirs").write_text("complete")  # another process finished first
        (tmp / "ours").write_text("x")
    assert [p.name for p in final.iterdir()] == ["theirs"] and not tmp.exists()


def test_a_rebuild_replaces_only_the_folder_it_judged(tmp_path):
    """`replacing`: the outdated folder is swapped for the new one; a folder another process
    put in its place meanwhile (its readers already on it) is kept and AlreadyBuilt raised."""
    final = tmp_path / "pack"
    final.mkdir()
    (final / "v").write_text("old")
    with atomic.building(final, replacing=atomic.folder_id(final)) as tmp:
        (tmp / "v").write_text("ours")
    assert (final / "v").read_text() == "ours"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pack"]  # the old one deleted

    judged = atomic.folder_id(final)
    with pytest.raises(atomic.AlreadyBuilt), atomic.building(final, replacing=judged) as tmp:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        (theirs / "v").write_text("theirs")
        os.rename(final, tmp_path / "aside")
        os.rename(theirs, final)  # another node's re-pack, published first
        (tmp / "v").write_text("ours again")
    assert (final / "v").read_text() == "theirs" and not tmp.exists()
