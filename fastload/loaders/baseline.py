"""loader=baseline: torch DataLoader, every knob from the config, transfer in the train thread.

Also the base of the other strategies. A loader is two stages that subclasses override:

* `_host_batches()`: an iterator of collated (pinned) uint8 CPU batches; here the DataLoader
  iterator with the stall watchdog and first-batch checks (loader=bg runs it in a thread);
* `_device_batches(host)`: turns them into device-ready batches; here `DevicePrep` in the
  calling thread (loader=prefetch copies and converts the next batch on a side CUDA stream).

Composition is then plain cooperative inheritance (see fastload/loaders/prefetch_bg.py).
A loader is built by fastload/pipeline.py, which decides where normalisation happens and
hands the loader its `DevicePrep`; the loader never reaches into the dataset.
"""

from __future__ import annotations

import logging

import torch
from torch.utils.data import DataLoader

from fastload.data.batch import collate
from fastload.errors import ConfigError
from fastload.loaders import checks, watchdog
from fastload.loaders.batch_ring import LoaderSlots
from fastload.loaders.device_prep import DevicePrep, iter_tensors
from fastload.loaders.workers import WorkerSeeding, resolve_num_workers, worker_init
from fastload.torch_internals import shutdown_workers, stop_persistent_workers

log = logging.getLogger(__name__)


def accelerator_available() -> bool:
    acc = getattr(torch, "accelerator", None)  # torch >= 2.6
    return acc.is_available() if acc is not None else torch.cuda.is_available()


class BaselineLoader:
    """Iterates device-ready batches: {"image": float NCHW on device, "target", ...}."""

    # A strategy that normalises on the device itself (loader=prefetch) sets this; the
    # builder then refuses loader.normalize_on=cpu, which would normalise twice (timm#73).
    normalizes_on_device = False

    def __init__(
        self,
        dataset,
        sampler,
        *,
        batch_size: int,
        device_prep: DevicePrep,
        train: bool = True,
        seed: int = 0,
        rank: int = 0,
        local_world_size: int = 1,
        sample_bytes: int | None = None,
        num_workers="auto",
        pin_memory="auto",
        pin_memory_max_mb: float | None = 4096,
        persistent_workers: bool = False,
        prefetch_factor: int | None = 2,
        drop_last: bool = True,
        timeout: float = 0,
        reuse_batch_memory: bool = True,
        collate_fn=None,
    ):
        if timeout < 0:
            raise ConfigError(f"loader.timeout={timeout}: use 0 (wait forever) or seconds > 0.")
        self.device_prep = device_prep
        self.num_workers = resolve_num_workers(num_workers, local_world_size)
        on_cuda = device_prep.device.type == "cuda"
        self.pin_memory = on_cuda if pin_memory == "auto" else bool(pin_memory)
        if self.pin_memory and not accelerator_available():
            log.warning("loader.pin_memory=true, but there is no GPU here: pinning is off")
            self.pin_memory = False
        self.pin_memory_max_mb = pin_memory_max_mb
        self.timeout = float(timeout)
        self.dataset, self.sampler = dataset, sampler
        self.seed, self.rank = seed, rank
        self.generator = torch.Generator()
        self._checked_first_batch = False
        workers = self.num_workers > 0
        self.prefetch_factor = (prefetch_factor or 2) if workers else 0
        self.collate = collate_fn or collate
        self.slots = None
        if workers and reuse_batch_memory and collate_fn is None and sample_bytes:
            self.slots = LoaderSlots(self.num_workers, *self._ring_size(batch_size, sample_bytes))
        self.dataloader = DataLoader(
            WorkerSeeding(dataset, seed, rank),
            batch_size=batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            collate_fn=self.collate,
            pin_memory=self.pin_memory,
            drop_last=drop_last and train,
            timeout=self.timeout if workers else 0,
            worker_init_fn=worker_init if workers else None,
            generator=self.generator,
            persistent_workers=persistent_workers and workers,
            prefetch_factor=prefetch_factor if workers else None,
        )
        checks.warn_small_shm(self.num_workers)

    def _ring_size(self, batch_size: int, sample_bytes: int) -> tuple[int, int]:
        """(slots per worker, bytes per slot) of the reused batch slots
        (fastload/loaders/batch_ring.py): prefetch_factor + 1 per worker (the most one worker
        has in flight) plus, unless pinning (which copies each slot out at once), its share
        of the batches the stages and the consumer hold (more held batches fall back to
        fresh segments)."""
        held = 0 if self.pin_memory else -(-(self.stage_batches + 1) // self.num_workers)
        return self.prefetch_factor + 1 + held, batch_size * sample_bytes

    def ring_stats(self) -> dict:
        """Batches stacked into a reused slot (hits) or a fresh segment (misses), all epochs."""
        return self.slots.stats() if self.slots is not None else {}

    @property
    def batch_ring(self):
        return self.slots.ring if self.slots is not None else None

    # -- the stages ----------------------------------------------------------------------

    @property
    def stage_batches(self) -> int:
        """Batches held past the DataLoader by this strategy's stages (the consumer's one
        here); the pinned-memory estimate adds them to the workers' prefetch."""
        return 1

    def _host_batches(self):
        """Collated CPU batches from the DataLoader, with the stall watchdog."""
        ring = self.slots.open(self.dataloader, collate) if self.slots is not None else None
        if ring is not None:
            ring.reset()  # before the iterator exists: no batch of this epoch is in flight
        it = iter(self.dataloader)
        try:
            while True:
                try:
                    with watchdog.main_process_batch(0 if self.num_workers else self.timeout):
                        batch = next(it)
                except StopIteration:
                    if ring is not None:
                        ring.reset()  # nothing in flight now: slots of abandoned tasks too
                    return
                except RuntimeError as exc:
                    if self.timeout and watchdog.is_timeout(exc):
                        raise watchdog.stall_error(it, self.timeout) from None
                    raise
                if ring is not None:
                    batch = ring.resolve_batch(batch, self.pin_memory)
                if not self._checked_first_batch:
                    self._checked_first_batch = True
                    self._check_first_batch(batch)
                yield batch
        finally:
            if not self.dataloader.persistent_workers:
                shutdown_workers(it)
                self._close_slots()

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
        stop_persistent_workers(self.dataloader)
        self._close_slots()

    def _close_slots(self) -> None:
        if self.slots is not None:
            self.slots.close(self.dataloader, self.collate)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.sampler.set_epoch(epoch, skip=skip_batches * self.dataloader.batch_size)
        self.generator.manual_seed(hash((self.seed, epoch, self.rank)) & (2**63 - 1))

    def __len__(self) -> int:
        return len(self.dataloader)

    def _check_first_batch(self, batch) -> None:
        """Pinned-memory cap, unpinnable entries and /dev/shm room, from the real batch size."""
        batch_bytes = sum(t.numel() * t.element_size() for t in iter_tensors(batch))
        if self.pin_memory:
            checks.check_pinned(batch, batch_bytes, self)
        checks.check_shm_room(batch_bytes, self.num_workers, self.prefetch_factor)
