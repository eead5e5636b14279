"""Loader strategies (baseline, bg, prefetch, prefetch+bg): same content, clean failure,
no leaks, seeding, watchdog, pinned-memory and /dev/shm checks. CUDA-only tests are marked."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from conftest import (
    REPO,
    build_test_loader,
    can_mount_privately,
    make_image_folder,
    run_train,
    tiny_overrides,
)

import fastload.loaders.checks as checks_mod
import fastload.loaders.cuda_prefetch as prefetch_mod
import fastload.loaders.workers as workers_mod
from fastload.data.dataset import ImageDataset, Normalize
from fastload.data.transforms import RandomResizedCropFlip
from fastload.decode.pil import PILBackend
from fastload.errors import ConfigError, DatasetError, LoaderStallError
from fastload.loaders.background import BackgroundIterator
from fastload.storage.disk import DiskReader

STRATEGIES = ["baseline", "bg", "prefetch", "prefetch+bg"]
NORM = Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


def make_loader(strategy, data, *overrides, shuffle=True, **kw):
    """loader=<strategy> through the builder, over an image folder (a Path) or a dataset;
    shuffle=False builds the evaluation loader (in order, nothing dropped)."""
    where = {"folder": data} if isinstance(data, Path) else {"dataset": data}
    split = "train" if shuffle else "val"
    return build_test_loader(f"loader={strategy}", *overrides, split=split, **where, **kw)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("loaders") / "d", per_split=(6, 1))


def epoch(loader, n=0):
    loader.set_epoch(n)
    return list(loader)


# -- same content from every strategy ------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_every_strategy_yields_the_same_batches(folder, workers):
    for drop_last in (True, False):
        opts = [f"loader.num_workers={workers}", f"loader.drop_last={drop_last}"]
        runs = {s: epoch(make_loader(s, folder, *opts), 1) for s in STRATEGIES}
        ref = runs["baseline"]
        assert len(ref) == (4 if drop_last else 5)  # 18 images, batch 4
        for name, batches in runs.items():
            assert len(batches) == len(ref), name
            for a, b in zip(ref, batches, strict=True):
                assert a["image"].dtype == b["image"].dtype == torch.float32, name
                assert torch.equal(a["image"], b["image"]), name  # bit-identical
                assert torch.equal(a["target"], b["target"]) and a["skipped"] == b["skipped"]


def test_uint8_path_and_cpu_normalisation_agree(folder):
    # the host stage: the uint8 crops themselves, before device prep
    loader = make_loader("bg", folder, "loader.num_workers=0")
    loader.set_epoch(0)
    raw = list(loader.host_batches())
    assert all(b["image"].dtype == torch.uint8 for b in raw)
    cpu = epoch(make_loader("bg", folder, "loader.normalize_on=cpu"))
    dev = epoch(make_loader("prefetch+bg", folder))
    for a, b, r in zip(cpu, dev, raw, strict=True):
        torch.testing.assert_close(a["image"], b["image"], rtol=0, atol=1e-5)
        torch.testing.assert_close(NORM(r["image"].to(torch.uint8)), b["image"], rtol=0, atol=1e-5)


class NestedDataset(torch.utils.data.Dataset):
    """Detection-like items: an image plus a dict of variable-length targets and a meta dict."""

    def __len__(self):
        return 10

    def __getitem__(self, key):
        _, i = key
        g = torch.Generator().manual_seed(i)
        n = i % 3 + 1
        return {
            "image": torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8, generator=g),
            "target": {"boxes": torch.rand(n, 4, generator=g), "labels": torch.arange(n)},
            "meta": {"id": i, "path": f"img_{i}.jpg", "size": (8, 8)},
        }


def nested_collate(items):
    return {
        "image": torch.stack([it["image"] for it in items]),
        "targets": [it["target"] for it in items],
        "meta": [it["meta"] for it in items],
        "pair": (torch.tensor([it["meta"]["id"] for it in items]), "tag"),
        "skipped": 0,
    }


@pytest.mark.parametrize("workers", [0, 1])
def test_nested_batches_pass_through_unchanged(workers):
    def run(strategy):
        loader = make_loader(
            strategy,
            NestedDataset(),
            f"loader.num_workers={workers}",
            "loader.drop_last=false",
            batch_size=4,
            collate_fn=nested_collate,
        )
        return epoch(loader)

    ref = run("baseline")
    assert len(ref) == 3 and ref[0]["meta"][0]["path"].startswith("img_")
    for strategy in STRATEGIES:
        for a, b in zip(ref, run(strategy), strict=True):
            assert set(b) == {"image", "targets", "meta", "pair", "skipped"}
            assert b["image"].dtype == torch.float32 and torch.equal(a["image"], b["image"])
            assert b["meta"] == a["meta"] and b["pair"][1] == "tag"
            assert torch.equal(a["pair"][0], b["pair"][0]) and isinstance(b["pair"], tuple)
            for ta, tb in zip(a["targets"], b["targets"], strict=True):
                assert torch.equal(ta["boxes"], tb["boxes"]) and torch.equal(
                    ta["labels"], tb["labels"]
                )
            # the images are the collated uint8 pixels, normalised once
            raw = nested_collate([NestedDataset()[(0, int(i))] for i in b["pair"][0]])["image"]
            torch.testing.assert_close(b["image"], NORM(raw), rtol=0, atol=1e-5)


# -- failures surface, nothing leaks ---------------------------------------------------------


class Exploding(torch.utils.data.Dataset):
    def __init__(self, bad=5, n=12):
        self.bad, self.n = bad, n

    def __len__(self):
        return self.n

    def __getitem__(self, key):
        i = key[1]
        if i == self.bad:
            raise ValueError(f"item {i} is broken")
        return torch.full((3, 4, 4), i, dtype=torch.uint8), i


def children() -> set:
    alive = set()
    for p in psutil.Process().children(recursive=True):
        try:  # a child that exits between the listing and this look is gone: not a leak
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.add(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def wait_clean(threads_before, kids_before=frozenset(), timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        extra = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
        kids = children() - kids_before
        if not extra and not kids:
            return
        time.sleep(0.05)
    raise AssertionError(f"leaked threads {extra} / processes {kids}")


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("workers", [0, 1])
def test_item_error_surfaces_in_main_thread_and_nothing_leaks(strategy, workers):
    before, kids = set(threading.enumerate()), children()
    loader = make_loader(strategy, Exploding(), f"loader.num_workers={workers}")
    loader.set_epoch(0)
    with pytest.raises(ValueError, match="item 5 is broken") as err:
        for _ in loader:
            pass
    if workers:  # torch re-raises in the main process with the worker's traceback as text
        assert "in __getitem__" in str(err.value)
    else:  # the same exception object: its traceback still reaches the dataset's frame
        frames = [f.name for f in traceback.extract_tb(err.value.__traceback__)]
        assert frames[-1] == "__getitem__", frames
    del err
    wait_clean(before, kids)


class RaisesAt(Exploding):
    """Item `bad` raises `exc` (a type whose meaning the stream's own code also uses)."""

    def __init__(self, exc, bad=5, n=12):
        super().__init__(bad, n)
        self.exc = exc

    def __getitem__(self, key):
        if key[1] == self.bad:
            raise self.exc(f"item {key[1]}: connection timed out after 3 retries")
        return super().__getitem__(key)


@pytest.mark.parametrize("strategy", ["baseline", "bg"])
@pytest.mark.parametrize("workers", [0, 1])
def test_a_stop_iteration_from_a_sample_is_an_error_not_the_epochs_end(strategy, workers):
    """It ended the DataLoader's iteration like its end: the epoch was short and, the stream
    taken for done, every later epoch empty (a 3-epoch run trained 1, 0 and 0 batches)."""
    loader = make_loader(strategy, RaisesAt(StopIteration), f"loader.num_workers={workers}",
                         "trainer.epochs=3", batch_size=2, shuffle=False)  # fmt: skip
    for epoch in range(2):  # every epoch says so, none is cut short
        loader.set_epoch(epoch)
        with pytest.raises(DatasetError, match=f"ended after 2 of epoch {epoch}'s 6 batches"):
            list(loader)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_samples_own_errors_reach_the_step_as_they_are(workers):
    """A ReferenceError from a sample ended the epoch as a dropped loader's does; a
    RuntimeError whose text says "timed out" became a stall of loader.timeout, its own
    message (the file, the cause) lost and a healthy worker's stacks dumped."""
    loader = make_loader("baseline", RaisesAt(ReferenceError), f"loader.num_workers={workers}")
    loader.set_epoch(0)
    with pytest.raises(ReferenceError, match="item 5"):
        list(loader)
    loader = make_loader("baseline", RaisesAt(RuntimeError), f"loader.num_workers={workers}",
                         "loader.timeout=600")  # fmt: skip
    loader.set_epoch(0)
    with pytest.raises(RuntimeError, match="item 5: connection timed out") as err:
        list(loader)
    assert not isinstance(err.value, LoaderStallError)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("workers", [0, 2])
def test_early_break_leaves_no_thread_or_worker(folder, strategy, workers):
    before, kids = set(threading.enumerate()), children()
    loader = make_loader(
        strategy, folder, f"loader.num_workers={workers}", batch_size=1
    )  # 18 batches: more than the workers and the thread can run ahead
    loader.set_epoch(0)
    for i, _ in enumerate(loader):
        if i == 1:
            assert len(children() - kids) == workers  # they were running...
            break
    wait_clean(before, kids)  # ...and are gone, with no thread left behind
    assert len(epoch(loader)) == 18  # and the loader starts the next epoch cleanly


def test_background_iterator_reraises_closes_and_is_collected():
    def source():
        yield 1
        raise KeyError("from the thread")

    it = BackgroundIterator(source(), max_prefetch=1)
    assert next(it) == 1
    with pytest.raises(KeyError) as err:
        next(it)
    assert "source" in [f.name for f in traceback.extract_tb(err.value.__traceback__)]
    with pytest.raises(StopIteration):
        next(it)

    stopped = threading.Event()

    def endless():
        try:
            while True:
                yield np.zeros(10)
        finally:
            stopped.set()  # closed in the producer thread on the way out

    it = BackgroundIterator(endless(), max_prefetch=2)
    next(it)
    thread = it._thread
    del it  # garbage collection stops a producer blocked on its full queue
    thread.join(5)
    assert not thread.is_alive() and stopped.is_set()
    with pytest.raises(ConfigError, match="loader.max_prefetch"):
        BackgroundIterator(iter([]), max_prefetch=0)


def test_no_hang_at_interpreter_exit(folder):
    script = textwrap.dedent(
        f"""
        import sys; sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
        from test_loaders import make_loader
        from pathlib import Path
        loader = make_loader("prefetch+bg", Path({str(folder)!r}),
                             "loader.num_workers=1", "loader.max_prefetch=1")
        loader.set_epoch(0)
        it = iter(loader)
        next(it)
        print("exiting with the thread and the worker running", flush=True)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert out.returncode == 0 and "exiting" in out.stdout, out.stderr[-3000:]


# -- seeding ---------------------------------------------------------------------------------


class GlobalRngDraws(torch.utils.data.Dataset):
    """An item whose 'augmentation' draws from the global RNGs (what user code often does)."""

    def __len__(self):
        return 16

    def __getitem__(self, key):
        return (key, np.random.randint(2**31), random.random(), torch.randint(2**31, ()).item())


def draws_collate(items):
    return {"draws": items, "skipped": 0}


def test_workers_draw_distinct_reproducible_numbers_every_epoch():
    def run(epochs=(0, 1)):
        loader = make_loader(
            "baseline",
            GlobalRngDraws(),
            "loader.num_workers=2",
            "loader.persistent_workers=true",
            "loader.prefetch_factor=1",
            collate_fn=draws_collate,
        )
        return [[d for b in epoch(loader, e) for d in b["draws"]] for e in epochs]

    first = run()
    for draws in first:
        for column in (1, 2, 3):  # numpy, random, torch: no two items share a draw
            values = [d[column] for d in draws]
            assert len(set(values)) == len(values), column
    assert {d[1] for d in first[0]}.isdisjoint({d[1] for d in first[1]})  # new every epoch
    assert run() == first  # and the same on a re-run
    # epoch 1 depends on the epoch, not on the persistent workers' history (exact resume)
    assert run(epochs=(1,)) == first[1:]


def test_crops_differ_between_items_and_repeat_with_the_seed(folder):
    class SameBytes(DiskReader):  # every item is the same picture: only the RNG differs
        def get(self, i, name):
            return super().get(0, name)

    def crops(seed):
        ds = ImageDataset(
            SameBytes(folder / "train"), PILBackend(), RandomResizedCropFlip(24), seed=seed
        )
        loader = make_loader("bg", ds, "loader.num_workers=2", seed=seed)
        return torch.cat([b["image"] for b in epoch(loader, 3)])

    a = crops(0)
    flat = {tuple(c.flatten().tolist()) for c in a}
    assert len(flat) == len(a) == 16  # two workers, 16 items, 16 different crops
    assert torch.equal(a, crops(0)) and not torch.equal(a, crops(1))


# -- watchdog, config checks --------------------------------------------------------------


class Sleepy(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, key):
        if key[1] == 3:
            time.sleep(3)
        return torch.zeros(3, 4, 4, dtype=torch.uint8), 0


@pytest.mark.parametrize("strategy", ["baseline", "bg"])
def test_stall_watchdog_names_the_stuck_worker(strategy, caplog, capfd):
    # In order, batch #1 (items 2, 3) goes to worker 1, and item 3 takes 3 s.
    loader = make_loader(
        strategy, Sleepy(), "loader.num_workers=2", "loader.timeout=1", batch_size=2, shuffle=False
    )
    loader.set_epoch(0)
    with caplog.at_level(logging.ERROR), pytest.raises(LoaderStallError) as err:
        list(loader)
    msg = err.value.user_message
    assert "loader.timeout=1s" in msg and "worker 1 (pid " in msg and "--shm-size" in msg
    assert "Main-process stacks" in caplog.text and "stall_error" in caplog.text
    assert "in __getitem__" in capfd.readouterr().err  # the stuck worker's own stack


def test_prefetch_refuses_cpu_normalisation():
    for strategy in ("prefetch", "prefetch+bg"):
        with pytest.raises(ConfigError) as err:
            make_loader(strategy, Exploding(), "loader.normalize_on=cpu")
        assert "loader.normalize_on=device" in str(err.value)


def test_prefetch_without_cuda_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(prefetch_mod, "_said_no_cuda", False)
    with caplog.at_level(logging.INFO, logger="fastload.loaders"):
        for strategy in ("prefetch", "prefetch+bg", "prefetch"):
            loader = make_loader(strategy, Exploding(), "loader.num_workers=0")
            assert loader.stream is None
    assert caplog.text.count("same-thread transfer") == 1


def test_pinned_memory_cap_and_unpinnable_entries(monkeypatch, caplog):
    loader = make_loader("bg", Exploding(), "loader.num_workers=2", "loader.pin_memory_max_mb=1")
    loader.pin_memory = True  # no GPU here to pin with: check the first-batch logic directly
    small = {"image": torch.zeros(4, 3, 32, 32, dtype=torch.uint8), "meta": object()}
    with caplog.at_level(logging.WARNING):
        loader._check_first_batch(small)  # 12 KB x (2 x 2 + 1 + 3) batches: fine
    assert "batch['image'] (tensor)" in caplog.text and "batch['meta'] (object" in caplog.text
    big = {"image": torch.zeros(64, 3, 64, 64, dtype=torch.uint8)}  # 0.75 MB x 8 > 1 MB
    with pytest.raises(ConfigError) as err:
        loader._check_first_batch(big)
    assert "loader.pin_memory_max_mb=1" in str(err.value) and "x 8" in str(err.value)


def test_small_dev_shm_is_reported_with_the_fix(monkeypatch, caplog, folder):
    monkeypatch.setattr(checks_mod, "shm_bytes", lambda: (64 * 2**20, 1000))
    with caplog.at_level(logging.WARNING):
        loader = make_loader("baseline", folder, "loader.num_workers=1")
        assert "only 64 MiB" in caplog.text and "--shm-size" in caplog.text
        epoch(loader)
    assert "has 0 MiB free" in caplog.text and "want about" in caplog.text


def test_num_workers_auto_splits_the_cpuset_across_local_ranks(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)))
    assert workers_mod.resolve_num_workers("auto", 4) == 3
    assert workers_mod.resolve_num_workers("auto", 24) == 1
    with pytest.raises(ConfigError, match="loader.num_workers"):
        workers_mod.resolve_num_workers(-1, 1)


@pytest.mark.parametrize("strategy", ["bg", "prefetch+bg"])
def test_train_py_runs_with_the_strategy(tiny_folder, tmp_path, strategy):
    run_dir = tmp_path / "run"
    out = run_train(
        tiny_overrides(
            tiny_folder, run_dir, f"loader={strategy}", "loader.num_workers=1", "trainer.epochs=1"
        )
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 1


# -- CUDA (run with -m cuda on a GPU machine) ------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("workers", [0, 2])
def test_cuda_strategies_match_and_keep_one_stream(folder, workers):
    runs = {}
    for s in STRATEGIES:
        loader = make_loader(s, folder, f"loader.num_workers={workers}", device="cuda")
        runs[s] = [epoch(loader, e) for e in (0, 1)]
        if s.startswith("prefetch"):
            stream = loader.stream
            epoch(loader, 2)
            assert loader.stream is stream and stream != torch.cuda.current_stream()
    for s, epochs in runs.items():
        for a_epoch, b_epoch in zip(runs["baseline"], epochs, strict=True):
            assert len(a_epoch) == len(b_epoch)
            for a, b in zip(a_epoch, b_epoch, strict=True):
                assert b["image"].is_cuda and b["target"].is_cuda, s
                torch.testing.assert_close(a["image"], b["image"], rtol=0, atol=1e-6)
                assert torch.equal(a["target"], b["target"])


@pytest.mark.cuda
def test_cuda_prefetch_batches_are_not_overwritten_while_in_use(folder):
    """Slow consumer kernels + kept references: if the side stream reused memory too early,
    a batch would change under the consumer."""
    expected = [b["image"].cpu() for b in epoch(make_loader("baseline", folder))]
    loader = make_loader("prefetch+bg", folder, "loader.num_workers=2", device="cuda")
    loader.set_epoch(0)
    big = torch.randn(4096, 4096, device="cuda")
    kept = []
    for b in loader:
        for _ in range(20):  # queue ~100 ms of work before the batch is read
            big = big @ big
            big = big / big.norm()
        kept.append(b["image"].clone())  # read only after the slow work
    torch.cuda.synchronize()
    for e, g in zip(expected, kept, strict=True):
        torch.testing.assert_close(e, g.cpu(), rtol=0, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("strategy", ["baseline", "prefetch"])
def test_unpinned_copies_on_cuda_count_the_queued_step_as_compute(folder, strategy):
    """pin_memory=false: each copy from pageable memory waits for the consumer's queued
    work. The loader waits for it first (device_drain_s), so the step timer's data wait
    stays small behind ~50 ms of queued matrix products per batch."""
    from fastload.telemetry.timer import StepTimer

    opts = ("loader.num_workers=2", "loader.pin_memory=false")
    loader = make_loader(strategy, folder, *opts, device="cuda")
    epoch(loader, 0)  # the workers' start (real data wait) is not what is checked
    loader.set_epoch(1)
    big = torch.randn(4096, 4096, device="cuda")
    timer = StepTimer(cuda_sync=True)
    timer.start()
    for _ in timer.iter(loader):
        for _ in range(10):
            big = big @ big
            big = big / big.norm()
    t = timer.stop()
    assert loader.device_drain_s > 0.2 * t.wall_s, (loader.device_drain_s, t)
    assert t.data_wait_share < 0.3, t


class _FakeStream:
    """Stands in for a CUDA stream / event on the CPU: records what the prefetcher asks."""

    def __init__(self):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)

    def record(self, stream=None):
        pass


def test_prep_thread_on_the_cpu_keeps_order_and_stops_with_the_consumer(folder, monkeypatch):
    """The prep thread's mechanics, with CUDA's stream calls faked on the CPU (the GPU test
    below checks the streams): backend=nvjpeg's batches (its decoder on nvImageCodec's CPU
    backend) come out of loader=prefetch's thread in the same-thread loader's order and
    values, the consumer waits on one event per batch, and an early break stops the thread."""
    import contextlib

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # NvjpegBackend's check
    opts = ("backend=nvjpeg", "loader.num_workers=2")
    expected = [b["image"] for b in epoch(make_loader("baseline", folder, *opts))]
    loader = make_loader("prefetch", folder, *opts)
    assert loader.prep_thread and loader.stream is None  # a CPU device: no side stream
    consumer = _FakeStream()
    loader.stream = _FakeStream()
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: consumer)
    prepared_in = []

    class Recording(type(loader.device_prep)):
        def __call__(self, batch):
            prepared_in.append(threading.current_thread().name)
            return super().__call__(batch)

    loader.device_prep.__class__ = Recording
    got = [b["image"] for b in epoch(loader)]
    assert len(consumer.waited) == len(got) == len(expected) == len(prepared_in)
    assert all(name.startswith("fastload-prep") for name in prepared_in), prepared_in
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(e, g, rtol=0, atol=0)
    loader.set_epoch(1)
    for _ in loader:
        break  # the consumer leaves early: the thread and the workers stop
    assert not [t for t in threading.enumerate() if t.name.startswith("fastload-prep")]


@pytest.mark.cuda
def test_nvjpeg_prep_thread_gives_the_same_batches_and_keeps_them_while_in_use(folder):
    """backend=nvjpeg under loader=prefetch: device prep (the GPU decode) runs in the prep
    thread, batches ahead and not ordered after the model's queued work. Its batches equal
    the same-thread path's (loader=baseline, the same decode), and none changes under slow
    consumer kernels while it is kept."""
    opts = ("backend=nvjpeg", "loader.num_workers=2")
    expected = [
        b["image"].cpu() for b in epoch(make_loader("baseline", folder, *opts, device="cuda"))
    ]
    loader = make_loader("prefetch", folder, *opts, device="cuda")
    assert loader.prep_thread
    loader.set_epoch(0)
    big = torch.randn(4096, 4096, device="cuda")
    kept, threads = [], set()
    for b in loader:
        threads.update(t.name for t in threading.enumerate() if t.name.startswith("fastload-prep"))
        for _ in range(20):  # queue ~100 ms of work before the batch is read
            big = big @ big
            big = big / big.norm()
        kept.append(b["image"].clone())
    torch.cuda.synchronize()
    assert threads, "no prep thread ran"
    assert len(kept) == len(expected)
    for e, g in zip(expected, kept, strict=True):
        torch.testing.assert_close(e, g.cpu(), rtol=0, atol=1e-6)


@pytest.mark.cuda
def test_cuda_prefetch_channels_last_and_bf16():
    loader = make_loader(
        "prefetch",
        NestedDataset(),
        "loader.input_dtype=bf16",
        "loader.drop_last=false",
        device="cuda",
        channels_last=True,
        collate_fn=nested_collate,
    )
    b = epoch(loader)[0]
    assert b["image"].dtype == torch.bfloat16
    assert b["image"].is_contiguous(memory_format=torch.channels_last)
    assert b["targets"][0]["boxes"].is_cuda and b["meta"][0]["id"] == int(b["pair"][0][0])
    assert b["pair"][0].is_cuda and b["pair"][1] == "tag"


def test_benchmark_cli_smoke(tiny_folder, tmp_path, capsys):
    from fastload.bench.__main__ import main

    out = tmp_path / "loaders.json"
    argv = ["loaders", "--root", str(tiny_folder), "--batch-size", "4", "--size", "16"]
    argv += ["--warmup", "1", "--steps", "2", "--step-ms", "1", "--workers", "0"]
    argv += ["--strategies", "baseline,prefetch+bg", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "data_wait_share" in text and "prefetch+bg" in text
    rows = json.loads(out.read_text())["results"]
    assert [r["strategy"] for r in rows] == ["baseline", "prefetch+bg"]
    assert all(r["images_per_s"] > 0 and 0 <= r["data_wait_share"] <= 1 for r in rows)


def test_fault_stream_falls_back_to_the_real_stderr(monkeypatch):
    """Jupyter's and pytest's sys.stderr have no file descriptor; faulthandler (the stall
    watchdog's stack dumps, registered in every worker) needs one."""
    import io

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert workers_mod.fault_stream() is sys.__stderr__
    monkeypatch.setattr(sys, "__stderr__", None)
    assert workers_mod.fault_stream() is None


# -- cross-epoch pipelining (loader.cross_epoch) -----------------------------------------------


def run_epochs(loader, epochs, skip=0):
    """(epoch, target, image) of every batch of `epochs`; the first one from batch `skip`."""
    out = []
    for n, e in enumerate(epochs):
        loader.set_epoch(e, skip_batches=skip if n == 0 else 0)
        out += [(e, b["target"].clone(), b["image"].clone()) for b in loader]
    return out


@pytest.mark.parametrize("strategy", ["baseline", "bg"])
def test_pipelined_epochs_give_the_same_batches_resume_included(folder, strategy):
    opts = [f"loader={strategy}", "loader.num_workers=2", "trainer.epochs=4"]
    plain = run_epochs(
        build_test_loader(*opts, "loader.cross_epoch=false", folder=folder), range(4)
    )
    piped = build_test_loader(*opts, folder=folder)
    first = run_epochs(piped, [0, 1])
    resumed = build_test_loader(*opts, folder=folder)  # a new process resuming at epoch 2 step 1
    second = run_epochs(resumed, [2, 3], skip=1)
    per_epoch = len(plain) // 4
    want = plain[: 2 * per_epoch] + plain[2 * per_epoch + 1 :]
    got = first + second
    assert len(got) == len(want) == 4 * per_epoch - 1 and per_epoch == 4
    for (e, t, x), (we, wt, wx) in zip(got, want, strict=True):
        assert e == we and torch.equal(t, wt) and torch.equal(x, wx)
    assert {e for e, _, _ in plain} == {0, 1, 2, 3}
    assert not torch.equal(plain[0][2], plain[per_epoch][2])  # epochs differ


def test_the_stream_runs_into_the_next_epoch_and_stops_after_the_last(folder):
    before, kids = set(threading.enumerate()), children()
    loader = build_test_loader(
        "loader.num_workers=2", "loader.persistent_workers=false", "trainer.epochs=2", folder=folder
    )
    loader.set_epoch(0)
    it = iter(loader)
    for _ in range(len(loader)):
        next(it)
    stream = loader._stream
    with pytest.raises(StopIteration):
        next(it)  # epoch 0 is over for the consumer...
    assert loader._stream is stream and stream.position == (1, 0)  # ...not for the workers
    assert len(children() - kids) == 2
    assert len(run_epochs(loader, [1])) == len(loader)  # the same stream, no restart
    assert loader._stream is None  # epoch 1 is the run's last: the stream stopped
    wait_clean(before, kids)  # and its workers (not persistent) with it


def test_a_cold_cache_storage_gets_a_stream_per_epoch(folder, caplog):
    """storage.cold_cache=true evicts when an epoch starts: a stream across epochs would
    have read that epoch's first batches before, warm, so the run streams epoch by epoch."""
    opts = ["loader.num_workers=2", "trainer.epochs=2"]
    assert build_test_loader(*opts, folder=folder).last_epoch == 1  # streams across epochs
    with caplog.at_level(logging.INFO, logger="fastload.pipeline"):
        loader = build_test_loader(*opts, "storage.cold_cache=true", folder=folder)
    assert loader.last_epoch is None
    assert "storage.cold_cache=true: loader.cross_epoch is off" in caplog.text
    loader.set_epoch(0)
    assert len(list(loader)) == len(loader)
    assert loader._stream is None  # the epoch's stream ended with it


def test_iterating_again_without_set_epoch_gives_the_same_epoch(folder):
    """With a stream across epochs (loader.cross_epoch) a second pass gave the next epoch's
    batches, without it the same epoch's: `__iter__` yields the epoch `set_epoch` named."""
    opts = ["loader.num_workers=0", "trainer.epochs=2"]
    for cross in ("true", "false"):
        loader = build_test_loader(*opts, f"loader.cross_epoch={cross}", folder=folder)
        loader.set_epoch(0)
        first, again = list(loader), list(loader)
        assert all(torch.equal(a["image"], b["image"]) for a, b in zip(first, again, strict=True))


def test_an_unplanned_epoch_restarts_the_stream_with_the_right_batches(folder):
    opts = ["loader.num_workers=2", "trainer.epochs=4"]
    want = run_epochs(build_test_loader(*opts, "loader.cross_epoch=false", folder=folder), [3])
    loader = build_test_loader(*opts, folder=folder)
    run_epochs(loader, [0])  # the stream now produces epoch 1...
    got = run_epochs(loader, [3])  # ...but epoch 3 is asked for
    assert all(torch.equal(a[2], b[2]) for a, b in zip(got, want, strict=True))


def test_warm_started_evaluation_gives_the_same_batches(folder):
    loader = build_test_loader("loader.num_workers=2", split="val", folder=folder)
    cold = [b["image"].clone() for b in loader]
    loader.start()  # what the engine does a few steps before training's last one
    assert loader._stream is not None
    time.sleep(0.5)
    warm = [b["image"].clone() for b in loader]
    assert loader.first_batch_s is not None and loader.first_batch_s > 0
    assert len(cold) == len(warm) and all(
        torch.equal(a, b) for a, b in zip(cold, warm, strict=True)
    )
    loader.close()


def test_pinned_memory_cap_auto_scales_with_the_host(monkeypatch):
    monkeypatch.setattr(checks_mod, "total_ram", lambda: 128 * 2**30)
    assert checks_mod.resolve_pin_cap("auto", 1) == 32 * 1024  # a quarter of 128 GiB, in MB
    assert checks_mod.resolve_pin_cap("auto", 8) == 4 * 1024  # shared by 8 local ranks
    assert checks_mod.resolve_pin_cap(None, 1) is None and checks_mod.resolve_pin_cap(512, 1) == 512
    with pytest.raises(ConfigError, match="loader.pin_memory_max_mb='lots'"):
        checks_mod.resolve_pin_cap("lots", 1)


def test_bench_train_cli_smoke(tiny_folder, tmp_path, capsys):
    """python -m fastload.bench train: the engine's loop through the configured data path,
    then against one resident batch; one JSON row per epoch and the whole run's."""
    from fastload.bench.__main__ import main

    out = tmp_path / "train.json"
    data = [f"dataset.root={tiny_folder}", "dataset.prepare=null", "dataset.num_classes=3"]
    data += ["dataset.train_transform.size=32", "dataset.val_transform.size=32"]
    data += ["trainer.batch_size=4", "loader.num_workers=1", "backend=pil", "trainer.device=cpu"]
    argv = ["train", "--step-ms", "5", "--epochs", "3", "--steps-per-epoch", "3"]
    assert main([*argv, "--json", str(out), *data]) == 0
    text = capsys.readouterr().out
    assert "vs_ceiling" in text and "target <= 2 %" in text and "pillow" in text
    rows = json.loads(out.read_text())["results"]
    assert [r["epoch"] for r in rows] == [0, 1, 2, "all"]
    for r in rows[:3]:
        assert r["images_per_s"] > 0 and 0 <= r["data_wait_share"] < 1 and r["eval_s"] > 0
        # the ceiling's epoch over this one (a 3-step epoch of 5 ms steps is all noise on a
        # loaded 2-core machine: the ratio itself ran to 1.9 there)
        assert r["vs_ceiling"] > 0
        assert r["vs_ceiling"] == pytest.approx(r["ceiling_wall_s"] / r["wall_s"])
    run = rows[-1]
    assert run["epochs"] == 3 and run["wall_s"] > 3 * 3 * 0.005
    # the training part alone, epochs >= 2: where evaluation, not training, is behind
    trained = sum(r["train_s"] for r in rows[1:3])
    ceiling = sum(r["ceiling_train_s"] for r in rows[1:3])
    assert run["train_vs_ceiling_epochs_2_on"] == pytest.approx(ceiling / trained)
    waited = sum(r["data_wait_share"] * r["train_s"] for r in rows[:3])
    assert run["data_wait_share"] == pytest.approx(waited / sum(r["train_s"] for r in rows[:3]))
    assert run["steps_time_s"] == pytest.approx(3 * 3 * 0.005 + 3 * 3 * 0.005 / 3)  # 9 val imgs


def _refault_pages(keep: bool, queue) -> None:
    """In a fresh process: (optionally) a DataLoader worker's start, then two rounds of a
    batch's worth of 1 MB buffers; the page faults of the second round go to `queue`."""
    import resource

    from fastload.loaders.workers import worker_init

    if keep:
        worker_init(0)
    for _round in range(2):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        bufs = [np.ones(2**20, np.uint8) for _ in range(24)]  # every page written
        del bufs
    queue.put(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_workers_keep_freed_batch_buffers_instead_of_refaulting_them():
    """worker_init's malloc setting: a batch's freed buffers serve the next batch (glibc
    otherwise returns them and every page faults again: 4-15 faults per sample measured)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # a fresh heap, not this process's
    faults = {}
    for keep in (False, True):
        queue = ctx.Queue()
        proc = ctx.Process(target=_refault_pages, args=(keep, queue))
        proc.start()
        faults[keep] = queue.get(timeout=60)
        proc.join(30)
    assert faults[False] > 24 * 2**20 // 4096 // 2, faults  # most pages faulted again
    assert faults[True] < faults[False] // 10, faults


# -- the stream's tail cut across the workers (loader.balanced_tail) ------------------------


def round_robin_load(items, workers: int) -> list[int]:
    """Samples each worker builds when the DataLoader hands `items` out in turn."""
    load = [0] * workers
    for i, keys in enumerate(items):
        load[i % workers] += len(keys)
    return load


@pytest.mark.parametrize(
    ("samples", "batch", "drop_last", "workers", "cut"),
    [
        (2000, 64, True, 2, 1),  # 31 batches: the odd one cut in two
        (2000, 64, False, 2, 2),  # 32 batches, the last one short: the whole last round
        (1000, 64, True, 4, 3),  # 15 batches over 4 workers: the last 3, in 4 parts each
        (2000, 64, False, 8, 8),
        (2048, 64, True, 2, 0),  # 32 full batches on 2 workers: nothing to balance
    ],
)
def test_the_stream_tail_is_cut_so_every_worker_builds_the_same_share(
    samples, batch, drop_last, workers, cut
):
    from fastload.data.sampling import BatchPart, EpochBatches, EpochSampler

    sampler = EpochSampler(samples, rank=0, world_size=1, shuffle=True, seed=0)
    whole = EpochBatches(sampler, batch, drop_last)
    cuts = EpochBatches(sampler, batch, drop_last, tail_workers=workers)
    for eb in (whole, cuts):
        eb.plan = [(3, 0, whole.epoch_batches())]
    want, got = list(whole), list(cuts)
    parts = [x for x in got if isinstance(x, BatchPart)]
    assert len(got) == len(cuts) and len(want) == len(whole) == whole.epoch_batches()
    assert sum(1 for p in parts if p.part == 0) == cut
    assert all(p.parts == workers for p in parts)
    assert got[len(got) - len(parts) :] == parts  # only the last batches
    # The same keys in the same order, and the parts of a batch make exactly that batch.
    joined, pending = [], []
    for x in got:
        pending.append(x)
        if not isinstance(x, BatchPart) or len(pending) == x.parts:
            joined.append([k for p in pending for k in p])
            pending = []
    assert joined == [list(x) for x in want]
    load, before = round_robin_load(got, workers), round_robin_load(want, workers)
    assert max(load) - min(load) <= 1, load
    assert cut == 0 or max(before) - min(before) >= 16, before


def test_only_the_last_epoch_of_a_pipelined_stream_is_cut():
    """Across an epoch boundary the workers go on into the next epoch: nothing to balance
    there; the stream's end (3 x 31 batches on 2 workers) is."""
    from fastload.data.sampling import BatchPart, EpochBatches, EpochSampler

    sampler = EpochSampler(2000, rank=0, world_size=1, shuffle=True, seed=0)
    eb = EpochBatches(sampler, 64, True, tail_workers=2)
    eb.plan = [(e, 0, 31) for e in range(3)]
    got = list(eb)
    parts = [x for x in got if isinstance(x, BatchPart)]
    assert len(got) == len(eb) == 3 * 31 + 1 and len(parts) == 2
    assert {k[0] for p in parts for k in p} == {2} and got[-2:] == parts
    eb.plan = [(e, 0, 31) for e in range(2)]  # 62 batches: whole rounds, nothing cut
    assert not any(isinstance(x, BatchPart) for x in eb) and len(eb) == 62


@pytest.mark.parametrize("strategy", ["baseline", "bg"])
def test_cut_tail_batches_are_joined_into_the_same_batches(folder, strategy):
    """Training (18 images, batch 5: 3 batches, the third cut in two) and evaluation (3
    images: one short batch cut in two): the same batches as whole batches, and the cut
    batches really went through the join."""
    opts = [f"loader={strategy}", "loader.num_workers=2", "loader.cross_epoch=false"]
    for split in ("train", "val"):
        plain = build_test_loader(*opts, "loader.balanced_tail=false", split=split, folder=folder,
                                  batch_size=5)  # fmt: skip
        cut = build_test_loader(*opts, split=split, folder=folder, batch_size=5)
        for e in (0, 1):
            want, got = run_epochs(plain, [e]), run_epochs(cut, [e])
            assert len(got) == len(want) == (3 if split == "train" else 1)
            for (_, t, x), (_, wt, wx) in zip(got, want, strict=True):
                assert torch.equal(t, wt) and torch.equal(x, wx)
        assert plain.joined_batches == 0 and cut.joined_batches == 2
        plain.close()
        cut.close()


def test_balanced_tail_auto_cuts_for_cpu_training_only(folder):
    """auto: the tail is cut where training runs on the CPU, kept whole on a GPU (where the
    cut measured slower); true / false as given; anything else is named."""
    from fastload.loaders.checks import resolve_balanced_tail

    assert resolve_balanced_tail("auto", on_cuda=False) is True
    assert resolve_balanced_tail("auto", on_cuda=True) is False
    assert resolve_balanced_tail(True, on_cuda=True) is True
    assert resolve_balanced_tail(False, on_cuda=False) is False
    with pytest.raises(ConfigError, match="loader.balanced_tail='yes': use auto"):
        resolve_balanced_tail("yes", on_cuda=False)
    # the default config on this CPU run cuts (3 images of evaluation, batch 5, 2 workers)
    loader = build_test_loader("loader.num_workers=2", split="val", folder=folder, batch_size=5)
    run_epochs(loader, [0])
    assert loader.joined_batches == 1
    loader.close()


class GlobalRngImages(torch.utils.data.Dataset):
    """A user's dataset that augments with the global RNG (which the workers seed per batch
    from its first key): fastload's collate, no per-sample RNG of its own."""

    def __len__(self):
        return 23

    def __getitem__(self, key):
        return torch.randint(0, 255, (3, 2, 2), dtype=torch.uint8), key[1] % 3


def test_a_dataset_on_the_global_rng_gets_whole_tail_batches(folder):
    """Cutting a batch would seed each part from its own first key: different pixels for the
    same sample than uncut, or with another worker count; so such a dataset is not cut."""
    opts = ["loader.num_workers=2", "loader.cross_epoch=false"]
    got = {}
    for tail in ("true", "false"):
        loader = build_test_loader(*opts, f"loader.balanced_tail={tail}", folder=folder,
                                   dataset=GlobalRngImages(), collate_fn=None)  # fmt: skip
        got[tail] = run_epochs(loader, [0])
        assert loader.joined_batches == 0
        loader.close()
    assert len(got["true"]) == 5  # 23 images, batch 4, the last one short
    for (_, t, x), (_, wt, wx) in zip(got["true"], got["false"], strict=True):
        assert torch.equal(t, wt) and torch.equal(x, wx)


@pytest.mark.cuda
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cut_tail_batches_joined_under_pinned_memory_on_cuda(folder, strategy):
    """Pinned host batches (the pin thread copies each part out of its slot): the joined
    batch is pinned, reaches the GPU, and equals the whole-batch loader's."""
    opts = [f"loader={strategy}", "loader.num_workers=2", "loader.cross_epoch=false"]
    kw = {"folder": folder, "batch_size": 5, "device": "cuda"}
    plain = build_test_loader(*opts, "loader.balanced_tail=false", **kw)
    cut = build_test_loader(*opts, "loader.balanced_tail=true", **kw)  # auto: off on CUDA
    assert cut.pin_memory
    cut.set_epoch(0)
    host = list(cut.host_batches())
    assert host[-1]["image"].is_pinned() and host[-1]["target"].is_pinned()
    want, got = run_epochs(plain, [1]), run_epochs(cut, [1])
    assert cut.joined_batches == 2 and len(got) == len(want) == 3
    for (_, t, x), (_, wt, wx) in zip(got, want, strict=True):
        assert x.is_cuda and torch.equal(t, wt)
        torch.testing.assert_close(x, wx, rtol=0, atol=0)


def test_joined_images_fill_the_first_parts_slot_when_it_has_room():
    from fastload.loaders.transport import join_images

    rng = torch.Generator().manual_seed(0)
    whole = torch.randint(0, 255, (5, 3, 4, 6), dtype=torch.uint8, generator=rng)
    nchw = whole.contiguous(memory_format=torch.channels_last)
    slot = torch.empty(5 * 3 * 4 * 6, dtype=torch.uint8)  # a reused slot: room for a batch
    first = torch.empty(0, dtype=torch.uint8).set_(
        slot.untyped_storage(), 0, (3, 3, 4, 6), nchw.stride()
    )
    first.copy_(nchw[:3])
    got = join_images([first, nchw[3:].clone(memory_format=torch.channels_last)])
    assert got.data_ptr() == slot.data_ptr() and torch.equal(got, whole)
    assert got.is_contiguous(memory_format=torch.channels_last)
    # A first part without room after it (a pinned copy, a fresh segment): a new tensor.
    alone = nchw[:3].clone(memory_format=torch.channels_last)
    got = join_images([alone, nchw[3:]])
    assert got.data_ptr() != alone.data_ptr() and torch.equal(got, whole)
    assert got.is_contiguous(memory_format=torch.channels_last)
    flat = join_images([whole[:2].contiguous(), whole[2:].contiguous()])
    assert torch.equal(flat, whole) and flat.is_contiguous()


@pytest.mark.parametrize("split, owner", [("train", "training"), ("val", "evaluation")])
def test_a_killed_worker_is_named_with_its_loader_and_the_likely_cause(tiny_folder, split, owner):
    """torch says only "DataLoader worker (pid N) is killed by signal: Killed"; the run says
    which loader it served and what usually kills one (the OOM killer: dmesg, fewer workers)."""
    import signal

    loader = build_test_loader("loader.num_workers=2", "loader.persistent_workers=false",
                               folder=tiny_folder, split=split, batch_size=1)  # fmt: skip
    loader.set_epoch(0)
    before = {p.pid for p in psutil.Process().children()}
    batches = iter(loader)
    next(batches)
    worker = next(p for p in psutil.Process().children() if p.pid not in before)
    worker.send_signal(signal.SIGKILL)  # not reaped here: torch must see it die
    with pytest.raises(RuntimeError) as caught:
        for _ in batches:
            time.sleep(0.2)  # each step gives torch's SIGCHLD check time to see the death
    died = workers_mod.dead_worker_error(caught.value)
    assert died is not None, caught.value
    text = died.user_message
    assert f"the {owner} loader's worker (pid {worker.pid})" in text
    assert "OOM killer" in text and "dmesg" in text and "loader.num_workers" in text
    loader.close()
    assert workers_mod.dead_worker_error(RuntimeError("CUDA out of memory")) is None
    bus = RuntimeError("DataLoader worker (pid 4242) is killed by signal: Bus error. It is ...")
    assert "docker run --shm-size" in workers_mod.dead_worker_error(bus).user_message


def test_worker_owners_keep_only_workers_that_have_not_ended_cleanly(tiny_folder, monkeypatch):
    """Non-persistent workers are new every epoch: the pid -> loader table forgets the ones
    that exited cleanly when the next stream starts, so it holds the live ones only; a
    worker that died stays named (its error may come after another stream started)."""
    import signal

    monkeypatch.setattr(workers_mod, "_OWNERS", {})
    loader = build_test_loader("loader.num_workers=2", "loader.persistent_workers=false",
                               "loader.cross_epoch=false", folder=tiny_folder,
                               batch_size=1)  # fmt: skip
    seen = set()
    for e in range(4):
        loader.set_epoch(e)
        batches = iter(loader)
        next(batches)
        live = {p.pid for p in psutil.Process().children() if p.status() != "zombie"}
        assert len(workers_mod._OWNERS) == 2 and set(workers_mod._OWNERS) <= live
        assert not set(workers_mod._OWNERS) & seen  # new workers, the old ones forgotten
        seen |= set(workers_mod._OWNERS)
        for _ in batches:
            pass
    loader.set_epoch(4)
    batches = iter(loader)
    next(batches)
    victim = min(workers_mod._OWNERS)
    os.kill(victim, signal.SIGKILL)  # not reaped here: torch must see it die
    with pytest.raises(RuntimeError) as caught:
        for _ in batches:
            time.sleep(0.2)  # each step gives torch's SIGCHLD check time to see the death
    evaluation = build_test_loader("loader.num_workers=2", "loader.persistent_workers=false",
                                   folder=tiny_folder, split="val", batch_size=1)  # fmt: skip
    evaluation.set_epoch(0)
    next(iter(evaluation))  # another stream starts before the death is reported
    assert workers_mod._OWNERS[victim][0] == "training"
    died = workers_mod.dead_worker_error(caught.value)
    assert f"the training loader's worker (pid {victim})" in died.user_message
    evaluation.close()
    loader.close()


@pytest.mark.skipif(not can_mount_privately(), reason="needs unshare -m and mount (root)")
def test_a_full_dev_shm_is_one_message_and_leaves_no_segment(tmp_path):
    """/dev/shm (a private 24 MB tmpfs in its own mount namespace, 23 MB taken) with less free
    room than the workers' batches: with the pre-flight off, the first batch that does not
    fit stops the run with the fix, and no torch_* segment is left behind."""
    root = make_image_folder(tmp_path / "d", per_split=(8, 2), size=(256, 256))
    args = tiny_overrides(root, tmp_path / "run", "trainer.epochs=1", "trainer.batch_size=8",
                          "dataset.train_transform.size=224", "loader.num_workers=2",
                          "doctor.preflight=false")  # fmt: skip
    train = " ".join(f"'{a}'" for a in [sys.executable, str(REPO / "train.py"), *args])
    script = (
        "mount -t tmpfs -o size=24m tmpfs /dev/shm && head -c 23000000 /dev/zero > "
        f"/dev/shm/filler && {train}; rc=$?; ls /dev/shm; exit $rc"
    )
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                         capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert out.returncode == 2, out.stderr[-3000:]
    assert "error: /dev/shm is full" in out.stderr and "--shm-size" in out.stderr
    assert "Traceback" not in out.stderr
    assert out.stdout.split()[-1:] == ["filler"] and "torch_" not in out.stdout  # ls /dev/shm


@pytest.mark.parametrize(
    "message",
    [
        "unable to allocate shared memory(shm) for file </torch_1_2_3>: No space left on device (28)",
        # torch 2.10-2.12 name a stale errno for the same failed posix_fallocate
        "unable to allocate shared memory(shm) for file </torch_1_2_3>: Success (0)",
    ],
)
def test_a_segment_torch_cannot_fill_is_the_full_dev_shm_message(monkeypatch, message):
    from fastload import torch_internals

    def full(nbytes):
        raise RuntimeError(message)

    monkeypatch.setattr(torch_internals, "_new_shared", full)
    with pytest.raises(ConfigError, match=r"/dev/shm is full.*--shm-size"):
        torch_internals.new_shared_storage(1 << 20)

    def other(nbytes):
        raise RuntimeError("unable to open shared memory object </torch_1_2_3>: Permission denied")

    monkeypatch.setattr(torch_internals, "_new_shared", other)
    with pytest.raises(RuntimeError, match="Permission denied"):  # not called a full /dev/shm
        torch_internals.new_shared_storage(1 << 20)


def test_loaders_time_their_wait_for_the_gpus_queue_where_their_copy_waits_for_it(
    folder, monkeypatch
):
    """With pin_memory=false on CUDA the copy from pageable memory waits for the consumer's
    queued GPU work, so the loader waits for it first and times it (`device_drain_s`, which
    the step timer counts as compute); pinned copies wait for nothing, so no drain there.
    The CUDA calls are faked (no GPU here): what is checked is where the drain happens."""
    from fastload.loaders.dataloader_stream import DataLoaderStream

    drains = []

    def fake_drain(self):
        drains.append(self.pin_memory)
        self.device_drain_s += 0.01

    monkeypatch.setattr(DataLoaderStream, "_drain_device", fake_drain)
    for pinned in (False, True):
        loader = build_test_loader("loader.num_workers=0", folder=folder)
        assert loader.device_drain_s == 0.0
        real = loader.device_prep
        # the stage's choice only: a device prep that says cuda and passes batches through
        loader.device_prep = type(
            "Prep",
            (),
            {"device": torch.device("cuda", 0), "decoder": None, "__call__": lambda s, b: b},
        )()
        loader.pin_memory = pinned
        host = list(loader._device_batches(iter([{"n": 1}, {"n": 2}])))
        assert len(host) == 2
        assert loader.device_drain_s == pytest.approx(0.0 if pinned else 0.02)
        loader.device_prep = real
        loader.close()
    assert drains == [False, False]


@pytest.mark.parametrize("loader", ["baseline", "prefetch"])
def test_spare_batch_is_the_first_decodable_samples_as_the_step_takes_them(tmp_path, loader):
    """A DDP rank whose first batch held no decodable sample trains at weight 0 on two spare
    samples: the dataset's first decodable ones (the corrupt ones before them passed over),
    collated and through device prep like any batch; None when none is decodable."""
    root = make_image_folder(tmp_path / "d", per_split=(3, 1))  # 9 training images
    over = [f"loader={loader}", "dataset.skip_corrupt=true", "loader.num_workers=2"]
    loader_ = build_test_loader(*over, folder=root)
    reader = loader_.dataset.reader
    for index in (0, 1, 2):
        Path(reader.describe(index)).write_bytes(b"not an image")
    try:
        spare = loader_.spare_batch()
        assert spare["image"].shape == (2, 3, 24, 24) and spare["image"].dtype == torch.float32
        want = [int(loader_.dataset.labels[i]) for i in (3, 4)]
        assert spare["target"].tolist() == want and spare["skipped"] == 0
        assert abs(float(spare["image"].mean())) < 3  # normalised, not 0..255
    finally:
        loader_.close()
    for index in range(len(reader)):
        Path(reader.describe(index)).write_bytes(b"not an image")
    loader_ = build_test_loader(*over, folder=root)
    try:
        assert loader_.spare_batch() is None
    finally:
        loader_.close()


def test_a_stop_signal_landing_before_a_worker_ignores_it_does_not_kill_the_worker(
    tiny_folder, monkeypatch
):
    """torchrun and Slurm send SIGTERM to the whole process group, at any moment: one that
    reached a worker after its fork but before `worker_init` (which ignores it, leaving it to
    the main process's checkpoint) killed the worker, and the run ended "worker killed by
    signal Terminated" without its checkpoint. Here it lands there on purpose."""
    import signal

    import fastload.loaders.dataloader_stream as stream_mod

    real = workers_mod.worker_init

    def signalled_first(worker_id):
        os.kill(os.getpid(), signal.SIGTERM)  # as if the group's SIGTERM came right now
        real(worker_id)

    monkeypatch.setattr(stream_mod, "worker_init", signalled_first)
    loader = build_test_loader("loader.num_workers=2", "loader.persistent_workers=false",
                               folder=tiny_folder)  # fmt: skip
    loader.set_epoch(0)
    seen = sum(len(batch["target"]) for batch in loader)
    assert seen == len(loader.dataset) - len(loader.dataset) % 4  # drop_last, batch 4
