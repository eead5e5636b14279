"""Telemetry: step timing, resource sampling, metric files, the W&B sink, console report."""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from fastload.telemetry.report import ProgressBar, format_summary_table
from fastload.telemetry.sampler import ResourceSampler, percentile, resolve_nvml_handle
from fastload.telemetry.sinks import MetricsFiles, NullSink, to_jsonable
from fastload.telemetry.timer import StepTimer
from fastload.telemetry.wandb_sink import CONFIG_FILE, WandbSink

MB = 1024 * 1024

# --------------------------------------------------------------------------- StepTimer


class SlowLoader:
    """Iterable whose __next__ blocks `delay_s` (a starved loader); optional slow __iter__."""

    def __init__(self, n: int, delay_s: float, iter_delay_s: float = 0.0) -> None:
        self.n, self.delay_s, self.iter_delay_s = n, delay_s, iter_delay_s

    def __iter__(self):
        time.sleep(self.iter_delay_s)
        return self._gen()

    def _gen(self):
        for i in range(self.n):
            time.sleep(self.delay_s)
            yield i


def test_step_timer_splits_data_wait_from_compute():
    timer = StepTimer()
    timer.start()
    live = []
    for _ in timer.iter(SlowLoader(8, delay_s=0.05)):
        time.sleep(0.02)  # the "training step"
        timer.add_samples(32)
        live.append((timer.images_per_s, timer.data_wait_share))
    t = timer.stop()

    assert t.steps == 8 and t.samples == 256
    # 50 ms waiting vs 20 ms computing per step: ~0.71. Wide band for noisy machines.
    assert 0.5 <= t.data_wait_share <= 0.9
    assert t.compute_s == pytest.approx(t.wall_s - t.data_wait_s)
    assert t.images_per_s == pytest.approx(t.samples / t.wall_s)
    # Live values during the epoch agree with the final ones.
    assert live[-1][0] == pytest.approx(t.images_per_s, rel=0.3)
    assert 0.5 <= live[-1][1] <= 0.9
    d = t.as_dict()
    assert d["images_per_s"] == pytest.approx(t.images_per_s)
    assert d["data_wait_share"] == pytest.approx(t.data_wait_share)
    assert all(isinstance(v, float) for v in d.values())


def test_step_timer_leaves_a_checkpoint_inside_the_window_out_of_it():
    """A checkpoint written inside an epoch (trainer.checkpoint_every_steps) was timed as
    compute: it lowered images/s and diluted the data-wait share. It is counted apart."""
    timer = StepTimer()
    timer.start()
    for i in timer.iter(SlowLoader(4, delay_s=0.02)):
        time.sleep(0.02)
        timer.add_samples(8)
        if i == 1:
            with timer.outside():
                time.sleep(0.3)  # the checkpoint's write
    t = timer.stop()
    assert t.outside_s >= 0.3 and t.wall_s < 0.3  # 4 x (20 + 20) ms, give or take
    assert t.compute_s == pytest.approx(t.wall_s - t.data_wait_s)
    assert 0.3 <= t.data_wait_share <= 0.7


def test_step_timer_counts_loader_startup_and_survives_early_break():
    # iter() on a DataLoader starts workers: the GPU waits for that, so it is data wait.
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # CUDA's own start-up (a run's model did it) is not the loader's
    timer = StepTimer(cuda_sync=True)  # without a GPU stop() must still work
    timer.start()
    for i in timer.iter(SlowLoader(100, delay_s=0.0, iter_delay_s=0.15)):
        timer.add_samples(4)
        if i == 2:
            break
    t = timer.stop()
    assert t.steps == 3 and t.samples == 12
    assert t.data_wait_s >= 0.12
    assert t.data_wait_share > 0.8
    # A new window starts from zero.
    timer.start()
    for _ in timer.iter([1, 2]):
        timer.add_samples(1)
    t2 = timer.stop()
    assert t2.steps == 2 and t2.samples == 2 and t2.data_wait_s < 0.05


# --------------------------------------------------------------------------- ResourceSampler


def _touch(buf: bytearray) -> None:
    buf[::4096] = b"\x01" * len(range(0, len(buf), 4096))  # fault every page in


def sampled(sampler: ResourceSampler, key: str = "peak_pss_mib", samples: int = 1) -> dict:
    """The window's snapshot once the thread has a `key` sample and `samples` samples in it:
    on a machine busy with other tests a first PSS walk takes longer than any fixed sleep."""
    deadline = time.monotonic() + 20
    snap = sampler.snapshot()
    while (snap[key] is None or snap["resource_samples"] < samples) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.02)
        snap = sampler.snapshot()
    return snap


def _window_peak(sampler: ResourceSampler, settle_s: float = 0.35) -> float:
    sampler.reset()
    time.sleep(settle_s)
    return sampled(sampler, "peak_rss_sum_mib", samples=3)["peak_rss_sum_mib"]


def test_sampler_peak_rss_follows_own_allocation():
    with ResourceSampler(gpu_index=None, interval_s=0.05) as sampler:
        base = _window_peak(sampler)
        buf = bytearray(300 * MB)
        _touch(buf)
        grown = _window_peak(sampler)
        del buf
        snap = sampler.snapshot()
    assert grown - base > 250
    assert snap["resource_samples"] >= 3
    assert snap["cpu_percent"] is not None and 0.0 <= snap["cpu_percent"] <= 100.0


GRANDCHILD = (
    "import sys, time\n"
    "b = bytearray(200 * 2**20)\n"
    "b[::4096] = b'\\x01' * len(range(0, len(b), 4096))\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)
# The child only starts the grandchild, so the memory is two levels down (recursive=True).
CHILD = (
    "import subprocess, sys\n"
    f"p = subprocess.Popen([sys.executable, '-c', {GRANDCHILD!r}], stdout=sys.stdout)\n"
    "p.wait()\n"
)


def test_pss_counts_shared_pages_once_where_summed_rss_counts_them_per_process():
    """Forked children share the parent's pages: summed RSS counts them once per process,
    PSS once in all, so PSS stays near one process's memory while summed RSS multiplies."""
    import multiprocessing

    buf = bytearray(200 * MB)
    _touch(buf)
    ctx = multiprocessing.get_context("fork")
    events = [ctx.Event() for _ in range(3)]
    kids = [ctx.Process(target=e.wait, args=(30,)) for e in events]
    for k in kids:
        k.start()
    try:
        with ResourceSampler(gpu_index=None, interval_s=0.05) as sampler:
            time.sleep(0.3)
            snap = sampled(sampler)
    finally:
        for e in events:
            e.set()
        for k in kids:
            k.join(10)
    assert snap["peak_rss_sum_mib"] > 4 * 200  # the 200 MB buffer, once per process
    assert snap["peak_pss_mib"] < snap["peak_rss_sum_mib"] - 2 * 200


def test_sampler_counts_descendant_processes_and_tolerates_their_exit():
    with ResourceSampler(gpu_index=None, interval_s=0.05) as sampler:
        base = _window_peak(sampler)
        proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            with_child = _window_peak(sampler)
        finally:
            import psutil

            for p in psutil.Process(proc.pid).children(recursive=True):
                p.kill()
            proc.kill()
            proc.wait(10)
        # Processes vanished under the sampler: it keeps going, and memory drops back.
        after = _window_peak(sampler)
        assert sampler._thread is not None and sampler._thread.is_alive()
    assert with_child - base > 150
    assert after < with_child - 150


def test_sampler_without_gpu_has_none_gpu_fields_and_stops_its_thread(monkeypatch):
    broken = types.ModuleType("pynvml")  # no driver: NVML fails (also on a GPU machine)
    broken.nvmlInit = lambda: (_ for _ in ()).throw(OSError("NVML Shared Library Not Found"))
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    before = set(threading.enumerate())
    sampler = ResourceSampler(gpu_index=0, interval_s=0.02)
    sampler.start()
    sampler.start()  # idempotent: still one thread
    new = [t for t in threading.enumerate() if t not in before]
    assert len(new) == 1 and new[0].daemon  # a daemon never keeps the interpreter alive
    snap = sampled(sampler)
    assert snap["gpu_util_mean"] is None
    assert snap["gpu_util_p10"] is None
    assert snap["gpu_mem_used_max_mb"] is None
    assert snap["peak_rss_sum_mib"] > 10 and snap["peak_pss_mib"] > 10
    sampler.stop()
    assert not new[0].is_alive()
    assert set(threading.enumerate()) <= before
    sampler.stop()  # idempotent


def test_snapshot_leaves_memory_sampling_to_the_thread(monkeypatch):
    """Reading PSS walks every process's page tables (0.1-0.4 s for a tree of workers): the
    training thread's snapshot between epochs must not wait for it, and every window still
    gets a PSS sample (the thread takes one at its start)."""
    callers = []
    real = ResourceSampler._tree_memory

    def recording(self, pss):
        callers.append((threading.current_thread().name, pss))
        return real(self, pss)

    monkeypatch.setattr(ResourceSampler, "_tree_memory", recording)
    with ResourceSampler(gpu_index=None, interval_s=0.05, pss_interval_s=60) as sampler:
        for _ in range(2):
            sampler.reset()
            time.sleep(0.2)
            sampled(sampler)
            before = len(callers)
            snap = sampler.snapshot()
            assert len(callers) == before  # nothing sampled on this thread
            assert snap["peak_pss_mib"] > 10 and snap["peak_rss_sum_mib"] > 10
    assert {name for name, _ in callers} == {"fastload-resource-sampler"}
    assert sum(pss for _, pss in callers) >= 2  # once per window, though pss_interval_s=60


def test_a_paused_sampler_leaves_what_ran_inside_out_of_the_window(monkeypatch):
    """A checkpoint written inside an epoch is left out of its time (StepTimer.outside), and
    of its utilisation too: counted in, a GPU idle for the write lowered the epoch's
    gpu_util. The tick after the pause spans part of it, so it is dropped as well."""
    import psutil

    busy = [50.0]
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None: busy[0])
    with ResourceSampler(gpu_index=None, interval_s=0.02) as sampler:
        with sampler.paused():
            sampler.reset()
            busy[0] = 100.0  # the write's readings
            time.sleep(0.3)
            assert sampler.snapshot()["cpu_percent"] is None
            busy[0] = 10.0  # the readings after it (the next tick's still spans the pause)
        snap = sampled(sampler, "cpu_percent", samples=3)
        paused_memory = snap["peak_rss_sum_mib"]
    assert snap["cpu_percent"] == 10.0
    assert paused_memory is not None  # memory is sampled all along: its peak is the run's


def test_a_reading_taken_before_a_reset_is_not_the_new_windows(monkeypatch):
    """A tick's CPU % (and GPU utilisation) averages the time since the tick before: one
    that spans the reset between an evaluation and the next epoch was counted in the epoch
    (an 8 % error on a 2.5 s epoch's mean GPU utilisation)."""
    import psutil

    sampler = ResourceSampler(gpu_index=None, interval_s=0.02)
    reset_now = threading.Event()

    def reading(interval=None):
        if reset_now.is_set():  # the engine's reset() lands between a read and its record
            reset_now.clear()
            sampler.reset()
            return 99.0
        return 10.0

    monkeypatch.setattr(psutil, "cpu_percent", reading)
    with sampler:
        sampled(sampler, "cpu_percent", samples=2)
        reset_now.set()
        while reset_now.is_set():
            time.sleep(0.01)
        snap = sampled(sampler, "cpu_percent", samples=3)
    assert snap["cpu_percent"] == 10.0


def test_a_checkpoint_inside_the_epoch_pauses_the_sampler_and_the_timer():
    from types import SimpleNamespace

    from fastload.engine import Epochs, EpochSpan

    seen = []
    sampler = ResourceSampler(gpu_index=None)
    timer = StepTimer()
    timer.start()
    record = SimpleNamespace(save=lambda state: seen.append((sampler._paused, timer.outside_s)))
    epochs = SimpleNamespace(
        cfg=SimpleNamespace(trainer=SimpleNamespace(checkpoint_every_steps=2)),
        step=SimpleNamespace(settled=True), healthy=lambda: True,
        state=SimpleNamespace(epoch_skipped=[]),
        record=record, timer=timer, ctx=SimpleNamespace(distributed=False),
    )  # fmt: skip
    after_step = Epochs.checkpoint_inside(epochs, 0, EpochSpan(0, 0, 5), sampler)
    for steps in range(1, 6):
        after_step(steps, [])
    assert [paused for paused, _ in seen] == [True, True]  # after steps 2 and 4
    assert not sampler._paused and timer.outside_s > 0


def test_percentile_matches_numpy():
    xs = [float(x) for x in np.random.default_rng(0).uniform(0, 100, 37)]
    assert percentile(xs, 10) == pytest.approx(float(np.percentile(xs, 10)))
    assert percentile([5.0], 10) == 5.0
    assert percentile([], 10) is None


def _fake_pynvml(utils: dict[int, float], uuids: dict[int, str]):
    """A stand-in for pynvml: physical GPU i has utilisation utils[i] and UUID uuids[i]."""

    class NVMLError(Exception):
        pass

    def by_index(i):
        if i not in utils:
            raise NVMLError("bad index")
        return i

    def by_pci(bus_id):
        raise NVMLError("not found")

    return types.SimpleNamespace(
        NVMLError=NVMLError,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(utils),
        nvmlDeviceGetHandleByIndex=by_index,
        nvmlDeviceGetHandleByPciBusId=by_pci,
        nvmlDeviceGetHandleByUUID=lambda u: next(i for i, x in uuids.items() if x == u),
        nvmlDeviceGetUUID=lambda h: uuids[h],
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=utils[h]),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=(h + 1) * 1024 * MB),
    )


def test_sampler_gpu_fields_from_nvml_follow_cuda_visible_devices(monkeypatch):
    fake = _fake_pynvml({0: 5.0, 1: 10.0, 2: 20.0, 3: 70.0}, {i: f"GPU-{i}aaa" for i in range(4)})
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    # torch's device 0 is physical GPU 3 under this mask; the sampler must not read GPU 0.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    with ResourceSampler(gpu_index=0, interval_s=0.02) as sampler:
        sampler.reset()
        time.sleep(0.15)
        snap = sampled(sampler, "gpu_util_mean")
    assert snap["gpu_util_mean"] == pytest.approx(70.0)
    assert snap["gpu_util_p10"] == pytest.approx(70.0)
    assert snap["gpu_mem_used_max_mb"] == pytest.approx(4 * 1024)


def test_resolve_nvml_handle_prefers_uuid_over_index(monkeypatch):
    fake = _fake_pynvml({0: 0.0, 1: 0.0, 2: 0.0}, {0: "GPU-aa", 1: "GPU-bb", 2: "GPU-cc"})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # torch prints UUIDs without the "GPU-" prefix.
    assert resolve_nvml_handle(fake, 0, uuid="cc") == 2
    assert resolve_nvml_handle(fake, 1) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bb")
    assert resolve_nvml_handle(fake, 0) == 1


# --------------------------------------------------------------------------- MetricsFiles


def test_metrics_files_round_trip_and_serialise_numpy_torch_nan(tmp_path):
    files = MetricsFiles(tmp_path / "run")
    assert files.read_epochs() == []
    e0 = {
        "epoch": np.int64(0),
        "loss": np.float32(1.5),
        "acc1": torch.tensor(12.5),
        "lr": 0.1,
        "gpu_util_mean": None,
        "bad": float("nan"),
        "inf": float("inf"),
        "hist": np.array([1, 2]),
        "path": Path("/x"),
    }
    files.append_epoch(e0)
    files.append_epoch({"epoch": 1, "loss": 0.75})
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    for line in lines:
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
    got = files.read_epochs()
    assert got[0] == {
        "epoch": 0,
        "loss": 1.5,
        "acc1": 12.5,
        "lr": 0.1,
        "gpu_util_mean": None,
        "bad": None,
        "inf": None,
        "hist": [1, 2],
        "path": "/x",
    }
    assert got[1] == {"epoch": 1, "loss": 0.75}


def test_metrics_files_recover_from_a_torn_last_line(tmp_path):
    files = MetricsFiles(tmp_path)
    files.append_epoch({"epoch": 0})
    with open(files.metrics_path, "a") as f:
        f.write('{"epoch": 1, "lo')  # crash mid-write
    files = MetricsFiles(tmp_path)  # resumed run
    files.append_epoch({"epoch": 1})
    assert files.read_epochs() == [{"epoch": 0}, {"epoch": 1}]
    files.rewrite_epochs([{"epoch": 0}])
    assert files.read_epochs() == [{"epoch": 0}]


def test_summary_is_atomic_valid_json_and_leaves_no_temp_file(tmp_path):
    files = MetricsFiles(tmp_path)
    files.write_summary({"epochs": 1, "best_acc1": np.float64(50.0), "x": float("nan")})
    files.write_summary({"epochs": 2, "best_acc1": np.float64(75.0), "x": float("nan")})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data == {"epochs": 2, "best_acc1": 75.0, "x": None}
    assert files.read_summary() == data


def test_to_jsonable_nested():
    assert to_jsonable({"a": (np.float16(0.5), {1: torch.tensor([1, 2])})}) == {
        "a": [0.5, {"1": [1, 2]}]
    }
    assert to_jsonable(np.float32("nan")) is None
    # Hydra configs (DictConfig/ListConfig) become plain data too.
    from omegaconf import OmegaConf

    assert to_jsonable(OmegaConf.create({"a": [1, {"b": 2.5}]})) == {"a": [1, {"b": 2.5}]}


def test_null_sink_does_nothing(tmp_path):
    sink = NullSink()
    sink.start(config={"a": 1}, run_dir=tmp_path)
    sink.log({"loss": 1.0}, step=0)
    assert sink.finish() is None
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- WandbSink


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """Offline W&B with every wandb folder under tmp_path, so nothing touches $HOME."""
    for var, sub in [
        ("WANDB_DIR", "wandb_dir"),
        ("WANDB_CACHE_DIR", "wandb_cache"),
        ("WANDB_CONFIG_DIR", "wandb_config"),
        ("WANDB_DATA_DIR", "wandb_data"),
    ]:
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    wandb = pytest.importorskip("wandb")
    yield wandb
    wandb.teardown()  # stop wandb's service process and forget the global state


def read_wandb_records(path: Path) -> list:
    """Records of a ``.wandb`` file: wandb's LevelDB-style log of protobuf Records.

    wandb 0.31 has no Python reader any more (its writer lives in the Go wandb-core), so
    this decodes the documented framing: a 7-byte header ``:W&B`` + magic + version, then
    32 KiB blocks of chunks (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle,
    4 last); a block tail shorter than a chunk header is zero padding.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0)
    block, pos, records, parts = 32768, 7, [], []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # padding / not yet written
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 2):
            parts = [chunk]
        else:
            parts.append(chunk)
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
    return records


def _items(items) -> dict:
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}


def _wandb_history(records) -> list[dict]:
    return [_items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]


def test_wandb_sink_offline_writes_config_at_start_and_metrics(tmp_path, wandb_env):
    run_dir = tmp_path / "run"
    config = {"model": {"name": "resnet50"}, "optim": {"lr": 0.1}, "seed": 0}
    sink = WandbSink(project="fastload-test", mode="offline", tags=["t1"], init_timeout_s=60)
    sink.start(config=config, run_dir=run_dir)
    assert sink.active

    run_folders = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(run_folders) == 1
    run_folder = run_folders[0]
    assert sink.sync_dir == str(run_folder)
    # The config is on disk as soon as start() returns, not only at finish.
    saved = json.loads((run_folder / "files" / CONFIG_FILE).read_text())
    assert saved == config

    sink.log({"epoch": 0, "loss": 1.5, "images_per_s": 100.0, "gpu_util_mean": None}, step=0)
    sink.log({"epoch": 1, "loss": 0.5, "images_per_s": np.float32(200.0)}, step=1)

    # The shortened flush interval puts run + config into the record log before finish:
    # a crashed run stays syncable.
    (record_file,) = run_folder.glob("run-*.wandb")
    deadline = time.monotonic() + 8  # wandb default flush: 15 s
    while time.monotonic() < deadline:
        if record_file.stat().st_size > 7 and any(
            r.WhichOneof("record_type") == "run" for r in read_wandb_records(record_file)
        ):
            break
        time.sleep(0.25)
    else:
        pytest.fail("wandb did not flush the run record before finish")

    # the run's summary: summary.json's numbers, not the last epoch's
    msg = sink.finish({"images_per_s": 150.0, "best_acc1": 71.5, "gpu_util_mean": None})
    assert msg == f"wandb sync {run_folder}"
    assert not sink.active
    assert sink.finish() is None  # idempotent

    records = read_wandb_records(record_file)
    (run_record,) = [r for r in records if r.WhichOneof("record_type") == "run"]
    run_config = _items(run_record.run.config.update)
    assert run_config["model"] == {"name": "resnet50"} and run_config["optim"] == {"lr": 0.1}
    assert list(run_record.run.tags) == ["t1"]
    history = _wandb_history(records)
    assert [(h["_step"], h["loss"], h["images_per_s"]) for h in history] == [
        (0, 1.5, 100.0),
        (1, 0.5, 200.0),
    ]
    assert all("gpu_util_mean" not in h for h in history)  # None values are dropped
    summaries = [
        _items(r.summary.update) for r in records if r.WhichOneof("record_type") == "summary"
    ]
    final = {k: v for update in summaries for k, v in update.items()}
    assert final["images_per_s"] == 150.0 and final["best_acc1"] == 71.5, summaries
    assert "gpu_util_mean" not in final
    # The config file was registered for upload by `wandb sync`.
    saved_files = [
        f.path for r in records if r.WhichOneof("record_type") == "files" for f in r.files.files
    ]
    assert CONFIG_FILE in saved_files
    summary_file = run_folder / "files" / "wandb-summary.json"
    if summary_file.exists():  # not written offline by wandb 0.31; older versions did
        assert json.loads(summary_file.read_text())["loss"] == 0.5


def test_wandb_sink_falls_back_when_init_raises(tmp_path, wandb_env, monkeypatch, caplog):
    def boom(**kwargs):
        raise RuntimeError("no backend")

    monkeypatch.setattr(wandb_env, "init", boom)
    sink = WandbSink(mode="offline", init_timeout_s=5)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        sink.start(config={"a": 1}, run_dir=tmp_path)
    # the fastload logger's (train.log), not a Python warning only stderr showed
    assert "W&B init failed (RuntimeError: no backend)" in caplog.text
    assert sink.error == "init failed (RuntimeError: no backend)"  # for summary.json
    assert not sink.active
    sink.log({"loss": 1.0}, step=0)  # no-op, no error
    assert sink.finish() is None


def test_wandb_sink_times_out_a_hanging_init(tmp_path, wandb_env, monkeypatch, caplog):
    late_finished = threading.Event()

    class LateRun:
        def finish(self, exit_code=None):
            late_finished.set()

    def hang(**kwargs):
        time.sleep(2.0)
        return LateRun()

    monkeypatch.setattr(wandb_env, "init", hang)
    sink = WandbSink(mode="offline", init_timeout_s=0.1)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="fastload"):
        sink.start(config={"a": 1}, run_dir=tmp_path)
    assert "did not return" in caplog.text and "did not return" in sink.error
    assert time.monotonic() - t0 < 1.9  # deadline: 0.1 * 1.1 + 1 s
    assert not sink.active
    sink.log({"loss": 1.0}, step=0)
    assert sink.finish() is None
    # The run that completes after the deadline is closed, not left dangling.
    assert late_finished.wait(5)


def test_wandb_sink_log_failure_stops_logging_but_still_finishes(tmp_path, monkeypatch, caplog):
    calls = []

    class FailingRun:
        offline = True
        settings = types.SimpleNamespace(
            sync_dir=str(tmp_path / "wandb" / "offline-run-x"),
            files_dir=str(tmp_path / "wandb" / "offline-run-x" / "files"),
        )

        def log(self, data, step=None, commit=None):
            calls.append("log")
            raise OSError("disk full")

        def save(self, *args, **kwargs):
            calls.append("save")

        def finish(self, exit_code=None):
            calls.append("finish")

    fake = types.ModuleType("wandb")
    fake.Settings = lambda **kwargs: kwargs
    fake.init = lambda **kwargs: FailingRun()
    fake.teardown = lambda: calls.append("teardown")
    monkeypatch.setitem(sys.modules, "wandb", fake)
    sink = WandbSink(mode="offline")
    sink.start(config={"a": [1, 2]}, run_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        sink.log({"loss": 1.0}, step=0)
    assert "W&B log failed (OSError: disk full)" in caplog.text
    sink.log({"loss": 0.5}, step=1)  # not attempted again
    assert sink.finish() == f"wandb sync {tmp_path / 'wandb' / 'offline-run-x'}"
    assert calls == ["save", "log", "finish", "teardown"]
    saved = tmp_path / "wandb" / "offline-run-x" / "files" / CONFIG_FILE
    assert json.loads(saved.read_text()) == {"a": [1, 2]}


def test_wandb_sink_without_wandb_package_warns(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    sink = WandbSink()
    with caplog.at_level(logging.WARNING, logger="fastload"):
        sink.start(config={}, run_dir=tmp_path)
    assert "pip install wandb" in caplog.text and "pip install wandb" in sink.error
    assert not sink.active and sink.finish() is None


def test_wandb_sink_disabled_mode_writes_nothing(tmp_path):
    sink = WandbSink(mode="disabled")
    sink.start(config={"a": 1}, run_dir=tmp_path / "run")
    sink.log({"loss": 1.0}, step=0)
    assert sink.finish() is None
    assert not (tmp_path / "run").exists()


def test_wandb_sink_rejects_unknown_mode():
    from fastload.errors import ConfigError

    with pytest.raises(ConfigError, match="logger.mode"):
        WandbSink(mode="cloud")


def test_wandb_sink_takes_one_word_as_one_tag():
    """logger.tags=baseline was eight one-letter tags."""
    from omegaconf import OmegaConf

    from fastload.errors import ConfigError

    assert WandbSink(tags="baseline").tags == ["baseline"]
    assert WandbSink(tags=OmegaConf.create(["a", 7])).tags == ["a", "7"]
    assert WandbSink(tags=None).tags == []
    with pytest.raises(ConfigError, match=r"logger.tags=5: use one tag \(logger.tags=baseline\)"):
        WandbSink(tags=5)
    with pytest.raises(ConfigError, match="logger.tags: {'a': 1} is not a tag"):
        WandbSink(tags=[{"a": 1}])
    with pytest.raises(ConfigError, match="has 65 characters; W&B takes tags of 1 to 64"):
        WandbSink(tags=["x" * 65])


class FakeRun:
    """A wandb run whose finish() records its exit code and can be made to hang."""

    offline = True

    def __init__(self, folder: Path, hang_s: float = 0.0):
        self.settings = types.SimpleNamespace(sync_dir=str(folder), files_dir=str(folder / "f"))
        self.summary, self.hang_s, self.exit_codes = {}, hang_s, []

    def save(self, *args, **kwargs):
        pass

    def finish(self, exit_code=None):
        self.exit_codes.append(exit_code)
        time.sleep(self.hang_s)


def fake_wandb(monkeypatch, run: FakeRun) -> list:
    """`import wandb` gives a module whose init returns `run`; the list records teardowns."""
    teardowns: list = []
    fake = types.ModuleType("wandb")
    fake.Settings = lambda **kwargs: kwargs
    fake.init = lambda **kwargs: run
    fake.teardown = lambda: teardowns.append(True)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return teardowns


def test_wandb_sink_gives_up_on_a_close_that_takes_too_long(tmp_path, monkeypatch, caplog):
    """run.finish() had no deadline: a slow W&B close held the end of a trained run."""
    from fastload.telemetry import wandb_sink

    monkeypatch.setattr(wandb_sink, "_FINISH_TIMEOUT_S", 0.3)
    run = FakeRun(tmp_path / "wandb" / "offline-run-x", hang_s=3.0)
    teardowns = fake_wandb(monkeypatch, run)
    sink = WandbSink(mode="offline")
    sink.start(config={}, run_dir=tmp_path)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="fastload"):
        sync = sink.finish({"epochs": 2})
    assert time.monotonic() - t0 < 2.0
    assert sync == f"wandb sync {tmp_path / 'wandb' / 'offline-run-x'}"  # uploads what it holds
    assert "W&B did not close its run within 0.3 s" in caplog.text
    assert sink.error == "closing the run took over 0.3 s"
    assert not teardowns  # it would wait for the same stuck service


def test_wandb_sink_passes_the_exit_code_to_the_run(tmp_path, monkeypatch):
    run = FakeRun(tmp_path / "wandb" / "offline-run-x")
    fake_wandb(monkeypatch, run)
    sink = WandbSink(mode="offline")
    sink.start(config={}, run_dir=tmp_path)
    sink.finish(None, exit_code=143)
    assert run.exit_codes == [143] and sink.error is None


def test_a_stopped_runs_offline_wandb_record_holds_its_exit_code(tmp_path, wandb_env):
    """A run stopped by SIGTERM was recorded in W&B with exit code 0 (finished, not failed)."""
    run_dir = tmp_path / "run"
    sink = WandbSink(project="fastload-test", mode="offline", init_timeout_s=60)
    sink.start(config={"seed": 0}, run_dir=run_dir)
    sink.log({"epoch": 0, "loss": 1.5}, step=0)
    sink.finish(None, exit_code=143)
    (record_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    exits = [
        r.exit for r in read_wandb_records(record_file) if r.WhichOneof("record_type") == "exit"
    ]
    assert [e.exit_code for e in exits] == [143], exits


# --------------------------------------------------------------------------- report


def test_format_summary_table_renders_values_and_na():
    table = format_summary_table(
        {
            "epochs": 5,
            "epoch_time_s_mean": 12.34,
            "images_per_s": 4512.4,
            "data_wait_share": 0.123,
            "gpu_util_mean": None,
            "best_acc1": 76.1,
            "run_dir": "/runs/a",
            "wandb_sync": "wandb sync /runs/a/wandb/offline-run-x",
        }
    )
    lines = table.splitlines()
    rows = dict(line.split("  ", 1) for line in lines)
    rows = {k.strip(): v.strip() for k, v in rows.items()}
    assert rows["epochs"] == "5"
    assert rows["time / epoch"] == "12.3 s"
    assert rows["images / s"] == "4,512"
    assert rows["data wait"] == "12.3 %"
    assert rows["GPU util"] == "n/a"
    assert rows["peak memory"] == "n/a"
    assert rows["best top-1"] == "76.10 %"
    assert rows["run directory"] == "/runs/a"
    assert rows["W&B"] == "wandb sync /runs/a/wandb/offline-run-x"
    # Values start in one column.
    assert len({len(line) - len(line[len(line.split("  ")[0]) :].lstrip()) for line in lines}) == 1

    empty = format_summary_table({})
    assert all(line.split()[-1] == "n/a" for line in empty.splitlines())


def test_summary_json_is_written_before_wandb_closes_and_survives_a_ctrl_c_there(tmp_path, capsys):
    """summary.json and the final table were written only once W&B had closed its run: a
    Ctrl-C during a slow close lost both, although every epoch had trained."""
    from conftest import compose_config, tiny_overrides
    from omegaconf import open_dict

    from fastload.dist import DistContext
    from fastload.engine import RunRecord
    from fastload.tasks.base import build_task

    run_dir = tmp_path / "out" / "x" / "r"
    cfg = compose_config(tiny_overrides(tmp_path, run_dir), run_dir)
    with open_dict(cfg):
        del cfg["hydra"]  # as train.py's run sees it
    record = RunRecord(cfg, DistContext(), run_dir, [], build_task(cfg))
    seen = []

    class CtrlCWhileClosing(NullSink):
        sync_dir = "/r/wandb/offline-run-x"

        def finish(self, summary=None, exit_code=0):
            seen.append(json.loads((run_dir / "summary.json").read_text()))
            raise KeyboardInterrupt

    record.sink = CtrlCWhileClosing()
    row = {"epoch": 0, "epoch_time_s": 2.0, "images_per_s": 10.0, "val_acc1": 50.0,
           "train_loss": 1.0, "peak_pss_mib": None, "peak_rss_sum_mib": None}  # fmt: skip
    state = types.SimpleNamespace(history=[row], best_metric=50.0, ema=None)
    summary = record.finish(state)
    assert seen[0]["epochs"] == 1 and seen[0]["best_acc1"] == 50.0  # before the close
    written = json.loads((run_dir / "summary.json").read_text())
    assert written == json.loads(json.dumps(summary))
    assert written["wandb_error"] == "closing the run was interrupted (Ctrl-C)"
    assert written["wandb_dir"] == "/r/wandb/offline-run-x" and written["wandb_sync"] is None
    table = capsys.readouterr().out
    assert "failed: closing the run was interrupted (Ctrl-C); /r/wandb/offline-run-x" in table


def test_the_summary_table_says_when_wandb_failed():
    """A failed W&B start read "W&B  n/a", as logger=none."""

    def wandb_row(**summary):
        (row,) = [
            line for line in format_summary_table(summary).splitlines() if line.startswith("W&B")
        ]
        return row.split("  ", 1)[1].strip()

    assert wandb_row() == "n/a"
    assert (
        wandb_row(wandb_error="init failed (UsageError: bad)")
        == "failed: init failed (UsageError: bad)"
    )
    assert wandb_row(
        wandb_error="closing the run took over 120 s", wandb_sync="wandb sync /r/w"
    ) == ("failed: closing the run took over 120 s; wandb sync /r/w")
    assert len(wandb_row(wandb_error="x" * 500)) == len("failed: ") + 100


def test_the_summary_table_says_peak_memory_is_one_ranks_under_ddp():
    """Each rank samples its own process tree and the row keeps the largest: under DDP the
    table showed it as the job's peak memory."""
    memory = {"peak_pss_mib": 562.2, "peak_rss_sum_mib": 1539.0}

    def peak(**more):
        (line,) = [x for x in format_summary_table({**memory, **more}).splitlines()
                   if x.startswith("peak memory")]  # fmt: skip
        return line.split("  ", 1)[1].strip()

    assert peak(world_size=1) == peak() == "562 MiB PSS (summed RSS 1,539 MiB)"
    assert peak(world_size=2) == "562 MiB PSS of the largest rank (summed RSS 1,539 MiB)"


def test_the_summary_leaves_out_each_processs_start_up_and_the_partial_epoch(tmp_path):
    """A run resumed inside epoch 2: epochs 0 and 2 each start a process (workers, caches,
    compilation), and epoch 2's time covers only its last steps. The steady-state means take
    epochs 1 and 3; time / epoch takes the epochs trained whole."""
    from fastload.engine import summarize

    def row(epoch, time_s, images_per_s, **extra):
        return {"epoch": epoch, "epoch_time_s": time_s, "images_per_s": images_per_s,
                "data_wait_share": images_per_s / 1000, "gpu_util_mean": None,
                "peak_pss_mib": 1.0, "peak_rss_sum_mib": 1.0, **extra}  # fmt: skip

    history = [
        row(0, 30.0, 50.0, start_up_epoch=True),
        row(1, 10.0, 100.0),
        row(2, 4.0, 20.0, start_up_epoch=True, resumed_at_step=60),
        row(3, 12.0, 80.0),
    ]
    task = types.SimpleNamespace(metric="val_acc1", metric_label=None, metric_unit=" %")
    summary = summarize(history, tmp_path, None, task)
    assert summary["images_per_s"] == 90.0 and summary["data_wait_share"] == pytest.approx(0.09)
    assert summary["epoch_time_s_mean"] == pytest.approx((30 + 10 + 12) / 3)
    # rows written before they marked the start-up: the first is taken for it
    old = [{k: v for k, v in r.items() if k != "start_up_epoch"} for r in history[:2]]
    assert summarize(old, tmp_path, None, task)["images_per_s"] == 100.0


def test_the_summarys_rates_are_the_steady_epochs_totals_over_their_seconds(tmp_path):
    """Means of per-epoch rates counted a 2 s epoch as much as an 8 s one: two epochs of
    1,000 images showed 312 img/s for a true 200 (and a data-wait share of 31 % for 20 %)."""
    from fastload.engine import summarize

    def row(epoch, time_s, wait_s, gpu, **extra):
        return {"epoch": epoch, "epoch_time_s": time_s, "train_images": 1000,
                "images_per_s": 1000 / time_s, "data_wait_s": wait_s,
                "data_wait_share": wait_s / time_s, "gpu_util_mean": gpu,
                "peak_pss_mib": 1.0, "peak_rss_sum_mib": 1.0, **extra}  # fmt: skip

    history = [row(0, 30.0, 20.0, 10.0, start_up_epoch=True), row(1, 2.0, 1.0, 50.0),
               row(2, 8.0, 1.0, 100.0)]  # fmt: skip
    task = types.SimpleNamespace(metric="val_acc1", metric_label=None, metric_unit=" %")
    summary = summarize(history, tmp_path, None, task)
    assert summary["images_per_s"] == pytest.approx(200.0)
    assert summary["data_wait_share"] == pytest.approx(0.2)
    assert summary["gpu_util_mean"] == pytest.approx(90.0)
    # what made them, which `python -m fastload.report` compares across runs
    import socket

    assert summary["host"] == socket.gethostname() and "commit" in summary


def test_progress_bar_postfix_and_disabled(capsys, monkeypatch):
    import functools

    from fastload.telemetry import report

    # TQDM_DISABLE=1 in the environment (tqdm's own switch, honoured in runs; read at import)
    # would leave no bar to check here
    monkeypatch.setattr(report, "tqdm", functools.partial(report.tqdm, disable=False))
    off = ProgressBar(total=10, enabled=False)
    for _ in range(10):
        off.update(images_per_s=1.0, data_wait_share=0.5)
    off.close()
    assert capsys.readouterr().err == ""

    bar = ProgressBar(total=10, enabled=True, desc="epoch 0")
    bar.update(images_per_s=1234.0, data_wait_share=0.25)
    rendered = str(bar._bar)
    bar.close()
    assert "img/s=1,234" in rendered and "wait=25%" in rendered and "epoch 0" in rendered
    assert capsys.readouterr().out == ""  # progress goes to stderr, not stdout


class QueuedGpu:
    """A stand-in GPU: `queue(s)` adds s seconds of work behind what is queued (returns at
    once, as a kernel launch does); `synchronize()` waits until the queue has run."""

    def __init__(self):
        self.busy_until = time.perf_counter()

    def queue(self, seconds: float) -> None:
        self.busy_until = max(self.busy_until, time.perf_counter()) + seconds

    def synchronize(self, *args) -> None:
        time.sleep(max(0.0, self.busy_until - time.perf_counter()))


class PageableCopyLoader:
    """Batches ready on the host at once, whose copy to the GPU (pageable memory) returns
    only after the GPU's queued work: a loader with pin_memory=false on CUDA. `drains`: it
    waits for the queue itself first and says so in `device_drain_s`, as fastload's loaders
    do (DataLoaderStream._drain_device)."""

    def __init__(self, gpu: QueuedGpu, n: int, drains: bool):
        self.gpu, self.n, self.drains = gpu, n, drains
        if drains:
            self.device_drain_s = 0.0

    def __iter__(self):
        for _ in range(self.n):
            if self.drains:
                t = time.perf_counter()
                self.gpu.synchronize()
                self.device_drain_s += time.perf_counter() - t
            self.gpu.synchronize()  # the synchronous copy waits for the queue
            yield {"target": torch.zeros(4)}


@pytest.mark.parametrize("drains", [True, False])
def test_a_loader_whose_next_waits_for_the_gpu_is_not_charged_the_steps_compute(drains):
    """pin_memory=false on CUDA (or a GPU decode in the training thread): next() returns
    after the queued step. The loader times that wait, and the timer counts it as the step's
    compute, not as data wait: the batches were ready at once."""
    gpu = QueuedGpu()
    timer = StepTimer()
    timer.start()
    for _ in timer.iter(PageableCopyLoader(gpu, 6, drains=drains)):
        gpu.queue(0.05)  # the step: 50 ms of GPU work, launched asynchronously
    t = timer.stop()
    assert t.wall_s >= 5 * 0.05  # the last step still queued at stop() (no sync here)
    if drains:
        assert t.data_wait_share < 0.2, t
    else:  # a loader that does not say so: the step's compute lands in data wait
        assert t.data_wait_share > 0.6, t


def test_measure_feed_counts_a_loaders_wait_for_the_gpu_as_compute():
    from fastload.measure import feed

    gpu = QueuedGpu()

    class GpuStep:
        sync = staticmethod(gpu.synchronize)

        def train(self, batch):
            gpu.queue(0.05)

        def after_step(self):
            pass

    got = feed(PageableCopyLoader(gpu, 5, drains=True), GpuStep())
    assert got.batches == 5 and got.wait_s < 0.2 * got.wall_s, got
    slow = feed(PageableCopyLoader(gpu, 5, drains=False), GpuStep())
    assert slow.wait_s > 0.6 * slow.wall_s, slow


def test_loader_auto_trials_count_a_loaders_wait_for_the_gpu_as_compute(monkeypatch):
    """loader=auto's trials feed the loader's iterator, which has no `device_drain_s` of
    its own: read from it, the loader's wait for the GPU's queue was always 0 and that wait
    counted as data wait (the trial at 0.8 wait share instead of about 0)."""
    from types import SimpleNamespace

    from fastload import autotune, measure
    from fastload.autotune import Trial

    gpu = QueuedGpu()

    class QueueingStep:  # the stand-in step, here queueing 50 ms of GPU work as a decode's
        def __init__(self, ms, device="cpu"):
            pass

        def train(self, batch):
            gpu.queue(0.05)

        def after_step(self):
            pass

        def sync(self):
            gpu.synchronize()

    monkeypatch.setattr(measure, "SleepStep", QueueingStep)
    copies = PageableCopyLoader(gpu, 7, drains=True)
    copies.set_epoch = lambda epoch: None
    probe = SimpleNamespace(step_s=0.0, auto={"batches": 5}, remaining=lambda: 30.0)
    trial = Trial(1, 2, False, "turbo")
    autotune.timed(probe, copies, trial)
    assert trial.batches == 5 and trial.data_wait < 0.2, trial
