"""loader=baseline: torch DataLoader, every knob from the config, transfer in the train thread.

Also the base of the other strategies. A loader is two stages that subclasses override:

* `_host_batches()`: an iterator of collated (pinned) uint8 CPU batches; here the DataLoader
  iterator with the stall watchdog and first-batch checks (loader=bg runs it in a thread);
* `_device_batches(host)`: turns them into device-ready batches; here `DevicePrep` in the
  calling thread (loader=prefetch copies and converts the next batch on a side CUDA stream).

Composition is then plain cooperative inheritance (see fastload/loaders/prefetch_bg.py).
"""

from __future__ import annotations

import faulthandler
import functools
import io
import logging
import os
import random
import shutil
import signal
import sys
import threading
import time
import traceback

import numpy as np
import torch
from torch.utils.data import DataLoader, get_worker_info

from fastload.data.batch_ring import BatchRing
from fastload.data.dataset import collate
from fastload.errors import ConfigError, LoaderStallError
from fastload.loaders.device_prep import DTYPES, DevicePrep, iter_tensors

log = logging.getLogger(__name__)

MB = 2**20
SHM = "/dev/shm"
SHM_FLOOR = 256 * MB  # Docker's default is 64 MB: workers die with "Bus error" well before 256


def usable_cores() -> int:
    """Cores this process may run on (cpuset / taskset aware, unlike os.cpu_count())."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def resolve_num_workers(value, local_world_size: int) -> int:
    if value == "auto":
        return max(1, usable_cores() // max(1, local_world_size))
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = -1
    if n < 0:
        raise ConfigError(f"loader.num_workers={value!r}: use a whole number >= 0 or 'auto'.")
    return n


def accelerator_available() -> bool:
    acc = getattr(torch, "accelerator", None)  # torch >= 2.6
    return acc.is_available() if acc is not None else torch.cuda.is_available()


def fault_stream():
    """Where faulthandler can write: sys.stderr when it has a file descriptor, else the
    process's real stderr (in Jupyter or under pytest's capture sys.stderr has none, and
    faulthandler refuses such a stream); None when neither has one."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            stream.fileno()
            return stream
        except (AttributeError, ValueError, io.UnsupportedOperation):
            continue
    return None


def worker_init(worker_id: int) -> None:
    # Global RNGs are seeded per worker, rank and epoch by WorkerSeeding (below), at the first
    # sample of each epoch, which also covers persistent workers.
    # One intra-op thread per worker: N workers x all-core thread pools oversubscribe the CPU.
    torch.set_num_threads(1)
    if "cv2" in sys.modules:
        sys.modules["cv2"].setNumThreads(0)
    # Ctrl-C is the main process's to handle (it writes a checkpoint, then stops the workers);
    # a worker dying of SIGINT mid-batch would turn that into "worker exited unexpectedly".
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The stall watchdog sends SIGUSR1 to a stuck worker: it prints its own Python stacks
    # (from C, so it works even while the worker is blocked in a read or a decoder).
    stream = fault_stream()
    if hasattr(faulthandler, "register") and hasattr(signal, "SIGUSR1") and stream is not None:
        faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True, chain=False)


def worker_seed(seed: int, rank: int, epoch: int, worker_id: int) -> int:
    return int(np.random.SeedSequence([seed, rank, epoch, worker_id]).generate_state(1)[0])


class WorkerSeeding(torch.utils.data.Dataset):
    """Seeds numpy, `random` and torch in each worker from (seed, rank, epoch, worker id) at
    the first sample of every epoch (keys are `(epoch, index)`): distinct across workers
    (pytorch#5059), different every epoch even with persistent workers, reproducible across
    runs. Our own transforms need none of it (they use a per-sample RNG); user code that
    draws from the global RNGs does. In the main process (num_workers=0) the global RNGs
    belong to the training loop and are left alone."""

    def __init__(self, dataset, seed: int, rank: int):
        self.dataset, self.seed, self.rank = dataset, int(seed), int(rank)
        self._epoch = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        epoch = key[0] if isinstance(key, tuple) else 0
        if epoch != self._epoch:
            self._epoch = epoch
            info = get_worker_info()
            if info is not None:
                s = worker_seed(self.seed, self.rank, epoch, info.id)
                np.random.seed(s)
                random.seed(s)
                torch.manual_seed(s)
        return self.dataset[key]


def shutdown_workers(it) -> None:
    """Stop a DataLoader iterator's workers now instead of whenever it is garbage collected
    (an early `break` or an exception would otherwise leave them running for a while)."""
    stop = getattr(it, "_shutdown_workers", None)  # torch's own, used by its __del__
    if stop is not None:
        stop()


def format_thread_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f'Thread "{names.get(ident, ident)}":\n{stack}')
    return "\n".join(parts)


def shm_bytes() -> tuple[int, int] | None:
    """(total, free) bytes of /dev/shm, where worker batches travel; None where absent."""
    try:
        usage = shutil.disk_usage(SHM)
    except OSError:
        return None
    return usage.total, usage.free


SHM_FIX = (
    "Give the container more shared memory (docker run --shm-size=8g, or in Kubernetes mount "
    "an emptyDir with medium: Memory at /dev/shm), or lower loader.num_workers / "
    "loader.prefetch_factor."
)


def unpinned_entries(batch, path="batch") -> list[str]:
    """Entries of a batch that pinning left in pageable memory: tensors that are not pinned
    and objects of types torch's pin_memory does not know (it returns those unchanged)."""
    if torch.is_tensor(batch):
        return [] if batch.is_pinned() else [f"{path} (tensor)"]
    if isinstance(batch, dict):
        return [e for k, v in batch.items() for e in unpinned_entries(v, f"{path}[{k!r}]")]
    if isinstance(batch, (list, tuple)):
        return [e for i, v in enumerate(batch) for e in unpinned_entries(v, f"{path}[{i}]")]
    if batch is None or isinstance(batch, (str, bytes, int, float, bool, np.number)):
        return []
    return [f"{path} ({type(batch).__name__}: give it a pin_memory() method)"]


class BaselineLoader:
    """Iterates device-ready batches: {"image": float NCHW on device, "target", ...}."""

    def __init__(
        self,
        dataset,
        sampler,
        *,
        batch_size: int,
        device: torch.device,
        normalize,
        channels_last: bool = False,
        train: bool = True,
        seed: int = 0,
        rank: int = 0,
        local_world_size: int = 1,
        num_workers="auto",
        pin_memory="auto",
        pin_memory_max_mb: float | None = 4096,
        persistent_workers: bool = False,
        prefetch_factor: int | None = 2,
        drop_last: bool = True,
        timeout: float = 0,
        normalize_on: str = "device",
        input_dtype: str = "fp32",
        reuse_batch_memory: bool = True,
        collate_fn=None,
    ):
        if normalize_on not in ("device", "cpu"):
            raise ConfigError(f"loader.normalize_on={normalize_on!r}: use 'device' or 'cpu'.")
        if input_dtype not in DTYPES:
            raise ConfigError(f"loader.input_dtype={input_dtype!r}: use one of {list(DTYPES)}.")
        if timeout < 0:
            raise ConfigError(f"loader.timeout={timeout}: use 0 (wait forever) or seconds > 0.")
        device = torch.device(device)
        self.num_workers = resolve_num_workers(num_workers, local_world_size)
        self.pin_memory = device.type == "cuda" if pin_memory == "auto" else bool(pin_memory)
        if self.pin_memory and not accelerator_available():
            log.warning("loader.pin_memory=true, but there is no GPU here: pinning is off")
            self.pin_memory = False
        self.pin_memory_max_mb = pin_memory_max_mb
        self.timeout = float(timeout)
        # Normalise exactly once: in the workers (textbook) or after transfer (uint8 moves).
        dataset.normalize = normalize if normalize_on == "cpu" else None
        self.device_prep = DevicePrep(
            device,
            normalize if normalize_on == "device" else None,
            channels_last,
            DTYPES[input_dtype],
            decoder=getattr(getattr(dataset, "backend", None), "device_decoder", None),  # nvjpeg
        )
        self.sampler = sampler
        self.seed, self.rank = seed, rank
        self.generator = torch.Generator()
        self._checked_first_batch = False
        workers = self.num_workers > 0
        self.prefetch_factor = (prefetch_factor or 2) if workers else 0
        # Reused batch slots: sized now, allocated at the first epoch (a loader never iterated
        # costs nothing) and, with non-persistent workers, released after each epoch (the
        # eval loader's slots do not sit in /dev/shm while training runs).
        self.batch_ring = None
        self._ring_spec = None
        self._ring_totals = {"ring_hits": 0, "ring_misses": 0}
        if workers and reuse_batch_memory and collate_fn is None:
            self._ring_spec = self._ring_size(dataset, batch_size, normalize_on)
        self.dataloader = DataLoader(
            WorkerSeeding(dataset, seed, rank),
            batch_size=batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            collate_fn=collate_fn or collate,
            pin_memory=self.pin_memory,
            drop_last=drop_last and train,
            timeout=self.timeout if workers else 0,
            worker_init_fn=worker_init if workers else None,
            generator=self.generator,
            persistent_workers=persistent_workers and workers,
            prefetch_factor=prefetch_factor if workers else None,
        )
        shm = shm_bytes()
        if workers and shm is not None and shm[0] < SHM_FLOOR:
            log.warning(
                "%s is only %d MB and loader.num_workers=%d: workers pass every batch through "
                "it and die with 'Bus error' or hang when it fills. %s",
                SHM,
                shm[0] // MB,
                self.num_workers,
                SHM_FIX,
            )

    def _ring_size(self, dataset, batch_size: int, normalize_on: str) -> tuple[int, int] | None:
        """(slots per worker, bytes per slot) of the reused batch slots
        (fastload/data/batch_ring.py), from the transform's output (size x size x 3, uint8;
        float32 when normalising on the CPU): prefetch_factor + 1 per worker (the most one
        worker has in flight) plus, unless pinning (which copies each slot out at once), its
        share of the batches the stages and the consumer hold (more held batches fall back
        to fresh segments). None when the sample size is unknown or decode is deferred."""
        size = getattr(getattr(dataset, "transform", None), "size", None)
        if not isinstance(size, int) or self.device_prep.decoder is not None:
            return None
        itemsize = 4 if normalize_on == "cpu" else 1
        held = 0 if self.pin_memory else -(-(self.stage_batches + 1) // self.num_workers)
        return self.prefetch_factor + 1 + held, batch_size * 3 * size * size * itemsize

    def _open_ring(self) -> BatchRing | None:
        """The epoch's batch slots (allocated if needed, before the workers start), wired
        into the DataLoader's collate; None when off or /dev/shm has no room for them."""
        if self._ring_spec is None or self.batch_ring is not None:
            return self.batch_ring
        slots, slot_bytes = self._ring_spec
        nbytes = self.num_workers * slots * slot_bytes
        shm = shm_bytes()
        if shm is not None and nbytes > shm[1] // 2:
            log.warning(
                "loader.reuse_batch_memory: %d MB of batch slots would take more than half of "
                "the %d MB free in %s; this epoch falls back to a new shared segment per "
                "batch. %s",
                nbytes // MB,
                shm[1] // MB,
                SHM,
                SHM_FIX,
            )
            return None
        self.batch_ring = BatchRing(self.num_workers, slots, slot_bytes)
        self.dataloader.collate_fn = functools.partial(collate, ring=self.batch_ring)
        return self.batch_ring

    def _close_ring(self) -> None:
        """Drop the slots (batches the consumer still holds keep their own slot alive)."""
        ring, self.batch_ring = self.batch_ring, None
        if ring is not None:
            for k, v in ring.stats().items():
                self._ring_totals[k] += v
            self.dataloader.collate_fn = collate

    def ring_stats(self) -> dict:
        """Batches stacked into a reused slot (hits) or a fresh segment (misses), all epochs."""
        now = self.batch_ring.stats() if self.batch_ring is not None else {}
        return {k: v + now.get(k, 0) for k, v in self._ring_totals.items()}

    # -- the stages ----------------------------------------------------------------------

    @property
    def stage_batches(self) -> int:
        """Batches held past the DataLoader by this strategy's stages (the consumer's one
        here); the pinned-memory estimate adds them to the workers' prefetch."""
        return 1

    def _host_batches(self):
        """Collated CPU batches from the DataLoader, with the stall watchdog."""
        ring = self._open_ring()
        if ring is not None:
            ring.reset()  # before the iterator exists: no batch of this epoch is in flight
        it = iter(self.dataloader)
        try:
            while True:
                try:
                    if (
                        self.timeout
                        and not self.num_workers
                        and (stream := fault_stream()) is not None
                    ):
                        # No worker to time out: at least dump the stacks if one batch hangs.
                        faulthandler.dump_traceback_later(self.timeout, exit=False, file=stream)
                    batch = next(it)
                except StopIteration:
                    if ring is not None:
                        ring.reset()  # nothing in flight now: slots of abandoned tasks too
                    return
                except RuntimeError as exc:
                    if self.timeout and "timed out" in str(exc):
                        raise self._stall_error(it) from None
                    raise
                finally:
                    if self.timeout and not self.num_workers:
                        faulthandler.cancel_dump_traceback_later()
                if ring is not None:
                    batch = ring.resolve_batch(batch, self.pin_memory)
                if not self._checked_first_batch:
                    self._checked_first_batch = True
                    self._check_first_batch(batch)
                yield batch
        finally:
            if not self.dataloader.persistent_workers:
                shutdown_workers(it)
                self._close_ring()

    def _device_batches(self, host_batches):
        for batch in host_batches:
            yield self.device_prep(batch)

    def __iter__(self):
        host = self._host_batches()
        try:
            yield from self._device_batches(host)
        finally:
            host.close()  # early break, crash or exhaustion: stop threads and workers now

    # -- the rest of the contract --------------------------------------------------------

    def close(self) -> None:
        """Stop persistent workers now (they otherwise live until the loader is collected)."""
        it = getattr(self.dataloader, "_iterator", None)
        if it is not None:
            shutdown_workers(it)
            self.dataloader._iterator = None
        self._close_ring()

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.sampler.set_epoch(epoch, skip=skip_batches * self.dataloader.batch_size)
        self.generator.manual_seed(hash((self.seed, epoch, self.rank)) & (2**63 - 1))

    def __len__(self) -> int:
        return len(self.dataloader)

    # -- checks ----------------------------------------------------------------------------

    def _check_first_batch(self, batch) -> None:
        """Pinned-memory cap, unpinnable entries and /dev/shm room, from the real batch size."""
        batch_bytes = sum(t.numel() * t.element_size() for t in iter_tensors(batch))
        in_flight = self.num_workers * self.prefetch_factor + self.stage_batches
        if self.pin_memory:
            missed = unpinned_entries(batch)
            if missed:
                log.warning(
                    "loader.pin_memory=true, but these batch entries could not be pinned and "
                    "are copied from pageable memory: %s",
                    ", ".join(missed[:5]) + (" ..." if len(missed) > 5 else ""),
                )
            pinned = batch_bytes * in_flight
            cap = self.pin_memory_max_mb
            if cap is not None and pinned > cap * MB:
                # Refuse rather than silently unpin: too much page-locked memory can freeze the
                # host (pytorch#135794), and silently losing async copies hides a slowdown.
                raise ConfigError(
                    f"pinned memory in flight would be about {pinned / MB:.0f} MB (batches of "
                    f"{batch_bytes / MB:.1f} MB x {in_flight}: loader.num_workers="
                    f"{self.num_workers} x loader.prefetch_factor={self.prefetch_factor} + "
                    f"{self.stage_batches} held by the loader stages), above "
                    f"loader.pin_memory_max_mb={cap}. Lower loader.prefetch_factor, "
                    f"loader.num_workers or trainer.batch_size, raise loader.pin_memory_max_mb "
                    f"(null: no cap) if the host has the RAM, or set loader.pin_memory=false."
                )
        shm = shm_bytes()
        if self.num_workers and shm is not None:
            need = 2 * self.num_workers * self.prefetch_factor * batch_bytes
            if shm[1] < need:
                log.warning(
                    "%s has %d MB free; loader.num_workers=%d x loader.prefetch_factor=%d "
                    "batches of %.1f MB want about %d MB (with 2x headroom). %s",
                    SHM,
                    shm[1] // MB,
                    self.num_workers,
                    self.prefetch_factor,
                    batch_bytes / MB,
                    need // MB,
                    SHM_FIX,
                )

    def _stall_error(self, it) -> LoaderStallError:
        """No batch within loader.timeout: say which worker owes it, dump stacks, and how to fix."""
        workers = list(getattr(it, "_workers", []))
        waiting = getattr(it, "_rcvd_idx", None)
        info = getattr(it, "_task_info", {}).get(waiting)
        stuck = info[0] if info else None
        who = ", ".join(
            f"worker {i} (pid {w.pid}, {'alive' if w.is_alive() else 'dead'})"
            for i, w in enumerate(workers)
        )
        if stuck is not None and stuck < len(workers):
            pid = workers[stuck].pid
            culprit = f"worker {stuck} (pid {pid}) owes batch #{waiting} of this epoch"
            if hasattr(signal, "SIGUSR1"):
                try:
                    os.kill(pid, signal.SIGUSR1)  # it prints its own stacks to stderr
                    time.sleep(0.2)
                    culprit += "; its Python stacks were printed to stderr"
                except OSError:
                    pass
        else:
            culprit = "no single worker could be named"
        log.error(
            "loader stalled for %ss; workers: %s. Main-process stacks:\n%s",
            self.timeout,
            who or "none",
            format_thread_stacks(),
        )
        return LoaderStallError(
            f"the data loader produced no batch for loader.timeout={self.timeout:g}s: {culprit} "
            f"(workers: {who or 'none'}; main-process stacks are in the log). Check the "
            f"dataset's I/O for that item (network file system, a lock, a huge or corrupt file), "
            f"check /dev/shm (df -h /dev/shm; docker run --shm-size=8g), or raise loader.timeout "
            f"if items are legitimately this slow."
        )
