"""`DataLoaderStream`, what loader=baseline builds: a torch DataLoader, every knob from the
config, a stream of epochs, transfer in the train thread. ("baseline" names the strategy that
adds no thread and no CUDA stream, not the textbook loader: the workers stack into reused
slots, the stream crosses epochs, a stream's tail is balanced over the workers.)

Also the base of the other strategies. A loader is two stages that subclasses override:

* `_host_batches()`: an iterator of collated (pinned) uint8 CPU batches, started at once;
  here the DataLoader iterator with the stall watchdog and first-batch checks (loader=bg
  runs it in a thread);
* `_device_batches(host)`: turns them into device-ready batches; here `DevicePrep` in the
  calling thread (loader=prefetch copies and converts the next batch on a side CUDA stream).

Epochs do not stop the data (loader.cross_epoch, training only). The host stage is a
*stream* over a plan of epochs (fastload/data/sampling.py: EpochBatches): from the epoch
`set_epoch` names to the run's last one. Each `__iter__` hands out one epoch's batches from
the stream, and when the next `set_epoch` names the epoch the stream is already producing,
iteration simply continues: while the last batches of epoch e are consumed, the workers (and
the background thread) are already building epoch e+1's first ones. Anything else (a resume
elsewhere, an abandoned epoch) closes the stream and starts a new one. Each epoch's batches
are exactly those of a fresh per-epoch iterator. Extra memory: none beyond what is always in
flight (num_workers x prefetch_factor batches, the reused slots, max_prefetch for loader=bg):
the same batches are in flight, they just belong to the next epoch.

`start()` begins producing the current epoch now: the engine starts the evaluation loader
before training's last step, so its workers and first batches are ready when it is needed
(its in-flight batches then coexist with training's for those last steps).

Composition is then plain cooperative inheritance (see fastload/loaders/prefetch_bg.py).
A loader is built by fastload/pipeline.py, which decides where normalisation happens and
hands the loader its `DevicePrep`; the loader never reaches into the dataset.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import time
import weakref

import torch
from torch.utils.data import DataLoader

from fastload.data import elastic
from fastload.data.batch import PART, Skipped, collate
from fastload.data.sampling import EpochBatches
from fastload.errors import DatasetError
from fastload.loaders import checks, watchdog
from fastload.loaders.batch_ring import LoaderSlots
from fastload.loaders.device_prep import DevicePrep, iter_tensors
from fastload.loaders.transport import SlotCollate, merge_parts, resolve_inline
from fastload.loaders.workers import (
    WorkerSeeding,
    register_workers,
    resolve_num_workers,
    stop_signals_blocked,
    worker_init,
)
from fastload.torch_internals import shutdown_workers, stop_persistent_workers

log = logging.getLogger(__name__)
SPARE_SCAN = 1000  # samples spare_batch reads at most for two decodable ones


def accelerator_available() -> bool:
    acc = getattr(torch, "accelerator", None)  # torch >= 2.6
    return acc.is_available() if acc is not None else torch.cuda.is_available()


_live: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    # Registered after torch's own exit hook, so it runs before it (atexit is LIFO): live
    # streams and persistent workers stop while the interpreter is whole, instead of being
    # torn down piecemeal during finalisation (which can trip torch's tensor bookkeeping).
    for loader in list(_live):
        loader.close()


def can_cut_batches(dataset, collate_fn, device_prep) -> bool:
    """Whether the stream's last round of batches may be cut across the workers
    (EpochBatches; the host stage joins the parts again): only with fastload's collate (it
    marks the parts), no deferred decode (whose encoded samples cannot be joined) and a
    dataset whose samples each have their own RNG (a part is seeded from its own first key,
    so a dataset drawing from the global RNGs would augment a cut batch differently)."""
    return (
        collate_fn is None
        and device_prep.decoder is None
        and getattr(dataset, "rng_per_sample", False)
    )


class DataLoaderStream:
    """A stream of epochs over a torch DataLoader; iterates device-ready batches:
    {"image": float NCHW on device, "target", ...}."""

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
        pin_memory_max_mb: float | str | None = "auto",
        persistent_workers: bool = False,
        prefetch_factor: int | None = 2,
        drop_last: bool = True,
        timeout: float = 0,
        reuse_batch_memory: bool = True,
        cross_epoch: bool = True,
        balanced_tail: bool | str = "auto",
        epochs: int | None = None,
        max_batches: int | None = None,
        collate_fn=None,
    ):
        checks.check_options(timeout, prefetch_factor)
        self.device_prep = device_prep
        self.num_workers = resolve_num_workers(num_workers, local_world_size)
        on_cuda = device_prep.device.type == "cuda"
        self.pin_memory = on_cuda if pin_memory == "auto" else bool(pin_memory)
        if self.pin_memory and not accelerator_available():
            log.warning("loader.pin_memory=true, but there is no GPU here: pinning is off")
            self.pin_memory = False
        self.pin_memory_max_option = pin_memory_max_mb
        self.pin_memory_max_mb = checks.resolve_pin_cap(pin_memory_max_mb, local_world_size)
        self.timeout = float(timeout)
        self.dataset, self.sampler, self.train = dataset, sampler, train
        self.seed, self.rank = seed, rank
        self.generator = torch.Generator()
        self._checked_first_batch = False
        self.joined_batches = 0  # batches cut across the workers and joined (all streams)
        self.device_drain_s = 0.0  # inside next(): waiting for the GPU's queue (`_drain_device`)
        workers = self.num_workers > 0
        self.prefetch_factor = (prefetch_factor or 2) if workers else 0
        self.collate = collate_fn or collate
        self.slots = None
        if workers and reuse_batch_memory and collate_fn is None and sample_bytes:
            self.slots = LoaderSlots(self.num_workers, *self._ring_size(batch_size, sample_bytes))
            self.collate = SlotCollate(collate, self.slots)
        cut = checks.resolve_balanced_tail(balanced_tail, on_cuda)
        cut = cut and can_cut_batches(dataset, collate_fn, device_prep)
        tail_workers = self.num_workers if cut else 0
        self.batches = EpochBatches(sampler, batch_size, drop_last and train, tail_workers)
        self.dataloader = DataLoader(
            WorkerSeeding(dataset, seed, rank, batched=collate_fn is None),
            batch_sampler=self.batches,
            num_workers=self.num_workers,
            collate_fn=self.collate,
            pin_memory=self.pin_memory,
            timeout=self.timeout if workers else 0,
            worker_init_fn=worker_init if workers else None,
            generator=self.generator,
            persistent_workers=persistent_workers and workers,
            prefetch_factor=prefetch_factor if workers else None,
        )
        whole = self.batches.epoch_batches()
        self.epoch_length = min(whole, max_batches) if max_batches else whole
        self.max_batches, self.drop_last = max_batches, drop_last and train
        self.left_out = 0  # samples a continued epoch could not give to every rank
        # The last epoch a stream may run into: the run's last (training), or none.
        self.last_epoch = epochs - 1 if (cross_epoch and train and epochs) else None
        self.batch_size = batch_size
        self._want = (0, 0)  # (epoch, skip_batches) of the next __iter__
        self._stream: _Stream | None = None
        self.first_batch_s: float | None = None  # stream start -> its first host batch
        checks.warn_small_shm(self.num_workers)
        _live.add(self)

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
        """Collated CPU batches of the planned epochs from the DataLoader, started now (its
        workers start and the first tasks go out before this returns)."""
        ring = self.slots.open() if self.slots is not None else None
        if ring is not None:
            ring.reset()  # before the iterator exists: no batch of this stream is in flight
        with stop_signals_blocked():  # forks the workers (the first time, if persistent)
            it = iter(self.dataloader)
        register_workers(it, "training" if self.train else "evaluation")
        return _DataLoaderBatches(self, it, ring, time.perf_counter())

    def _device_batches(self, host_batches):
        drain = self._device_stage_waits_for_gpu()
        for batch in host_batches:
            if drain:
                self._drain_device()
            yield self.device_prep(batch)

    def _device_stage_waits_for_gpu(self) -> bool:
        """Whether device prep in the training thread waits for the consumer's queued GPU
        work: a copy from pageable memory on CUDA, or a GPU decode (its call returns after
        the queue)."""
        return self.device_prep.device.type == "cuda" and (
            not self.pin_memory or self.device_prep.decoder is not None
        )

    def _drain_device(self) -> None:
        """Wait here for the consumer's queued GPU work, timed in `device_drain_s`, where the
        next device stage would wait for it anyway: a copy from pageable memory is
        synchronous, and a GPU decode's call returns after the queue. The step timer counts
        that time as the step's compute, not as data wait. It costs nothing: the host batch
        was fetched before (that overlap stays), and the copy or decode would have waited."""
        t = time.perf_counter()
        torch.cuda.current_stream(self.device_prep.device).synchronize()
        self.device_drain_s += time.perf_counter() - t

    def spare_batch(self, n: int = 2, scan: int = SPARE_SCAN) -> dict | None:
        """`n` decodable samples of this loader's dataset (the first by index, epoch 0's
        draw), collated and put on the device as the step takes a batch, or None where the
        first `scan` hold none or the storage cannot read by index: what a DDP rank whose
        first batch held no decodable sample trains on at weight 0 (Step.train_empty).
        Decoded here, in the main process: it happens once, if ever."""
        found = []
        try:
            for index in range(min(len(self.dataset), scan)):
                sample = self.dataset[(0, index)]
                if not isinstance(sample, Skipped):
                    found.append(sample)
                if len(found) == n:
                    break
        except Exception as exc:  # a streaming storage, a dataset that takes no such key
            log.warning("no spare samples for the step: %s", exc)
            return None
        if not found:
            return None
        inner = self.collate.collate if isinstance(self.collate, SlotCollate) else self.collate
        return self.device_prep(inner(found))  # fresh tensors: no worker's reused slot

    def _plan(self, epoch: int, skip: int) -> list[tuple[int, int, int]]:
        last = self.last_epoch if self.last_epoch is not None else epoch
        plan = [(e, 0, self.epoch_length) for e in range(epoch, max(epoch, last) + 1)]
        plan[0] = (epoch, skip, self.batches_in(epoch) - skip)
        return plan

    def start(self) -> None:
        """Begin producing the batches of the epoch `set_epoch` named, now (no-op when a
        stream is already there)."""
        if self._stream is not None and self._stream.position == self._want:
            return
        self._close_stream()
        epoch, skip = self._want
        self.batches.plan = self._plan(epoch, skip)
        self.generator.manual_seed(hash((self.seed, epoch, self.rank)) & (2**63 - 1))
        self._stream = _Stream(self._host_batches(), self.batches.plan)

    def __iter__(self):
        """One epoch's device-ready batches (the epoch and skip of the last `set_epoch`)."""
        return self._epoch(device=True)

    def host_batches(self):
        """One epoch's collated CPU batches, before device prep: what the benchmarks time
        and the tests inspect (the same stream as `__iter__`)."""
        return self._epoch(device=False)

    def _epoch(self, device: bool):
        self.start()
        stream, done = self._stream, False
        planned, epoch = stream.batches_now(), stream.position[0]
        host = _Counted(itertools.islice(stream.host, planned))
        try:
            yield from (self._device_batches(host) if device else host)
            if host.count < planned:
                raise self._ended_early(epoch, host.count, planned)
            done = True
        finally:
            # An early break or an error: stop threads and workers, persistent or not. The
            # plan's last epoch done: run the stream out (frees abandoned slots), stop it.
            # Otherwise the stream goes on into the next epoch: the next `__iter__` takes it
            # when `set_epoch` names that epoch (without, it yields the same epoch again).
            if not done:
                self.close()
            elif not stream.advance():
                next(stream.host, None)
                self._close_stream()

    def _ended_early(self, epoch: int, got: int, planned: int) -> DatasetError:
        """The DataLoader stopped before the epoch's planned batches: a dataset (or a
        transform) raised StopIteration, which ends any iteration it reaches; taken for the
        epoch's end, the epoch was short and every later one empty, without a word."""
        split = "training" if self.train else "evaluation"
        return DatasetError(
            f"the {split} data ended after {got} of epoch {epoch}'s {planned} batches: the "
            f"DataLoader stopped early. A StopIteration raised while loading a sample (in the "
            f"dataset, a transform or a storage reader) does that, as it ends any iteration "
            f"it reaches: raise another exception for a sample that cannot be loaded; so does "
            f"a storage that holds fewer samples than its index says (re-pack it)."
        )

    def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.host.close()

    # -- the rest of the contract --------------------------------------------------------

    def close(self) -> None:
        """Stop the stream and persistent workers now (they otherwise live until the loader
        is collected)."""
        self._close_stream()
        stop_persistent_workers(self.dataloader)
        self._close_slots()

    def _close_slots(self) -> None:
        if self.slots is not None:
            self.slots.close()

    def set_epoch(self, epoch: int, skip_batches: int = 0, stretches=()) -> None:
        """The epoch the next `__iter__` yields, from its batch `skip_batches` (resume).
        `stretches`: the (world size, steps) this epoch already ran at other world sizes; it
        then goes on with the samples it had left, over this run's ranks
        (fastload/data/elastic.py)."""
        self._want = (int(epoch), int(skip_batches))
        if stretches:
            self.batches.continued[int(epoch)] = self._continued(int(epoch), list(stretches))

    def _continued(self, epoch: int, stretches: list) -> list[list]:
        plan = elastic.epoch_plan(
            lambda w: self.sampler.rank_orders(epoch, w), stretches, self.sampler.world_size,
            self.batch_size, self.drop_last, self.max_batches,
        )  # fmt: skip
        self.left_out = plan.left_out
        return [[(epoch, int(i)) for i in b] for b in plan.batches[self.sampler.rank]]

    def batches_in(self, epoch: int) -> int:
        """Batches of epoch `epoch`: `len(self)`, or a continued epoch's own count."""
        continued = self.batches.continued.get(epoch)
        return self.epoch_length if continued is None else len(continued)

    def __len__(self) -> int:
        """Batches in one epoch (capped by trainer.max_steps_per_epoch)."""
        return self.epoch_length

    def _check_first_batch(self, batch) -> None:
        """Pinned-memory cap, unpinnable entries and /dev/shm room, from the real batch size."""
        batch_bytes = sum(t.numel() * t.element_size() for t in iter_tensors(batch))
        if self.pin_memory:
            checks.check_pinned(batch, batch_bytes, self)
        checks.check_shm_room(batch_bytes, self.num_workers, self.prefetch_factor)


class _Counted:
    """An iterator that counts what it yielded."""

    def __init__(self, it):
        self.it, self.count = it, 0

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.it)
        self.count += 1
        return item


class _Stream:
    """A running host stage over a plan of epochs, and where it stands in that plan."""

    def __init__(self, host, plan: list[tuple[int, int, int]]):
        self.host, self.plan, self.step = host, plan, 0

    @property
    def position(self) -> tuple[int, int] | None:
        """(epoch, skip) whose batches come next; None when the plan is done."""
        return self.plan[self.step][:2] if self.step < len(self.plan) else None

    def batches_now(self) -> int:
        return self.plan[self.step][2]

    def advance(self) -> bool:
        """One planned epoch consumed; whether the stream goes on into another."""
        self.step += 1
        return self.step < len(self.plan)


class _DataLoaderBatches:
    """One stream's DataLoader iterator: batches out of their reused slots, the stall
    watchdog, the first-batch checks; `close()` stops its workers unless they persist."""

    def __init__(self, loader: DataLoaderStream, it, ring, t0: float):
        # A weak reference: the loader holds this stream, and a cycle would keep a dropped
        # loader's workers alive until the garbage collector happens to run. What `close()`
        # needs is held directly, so it also works once the loader is gone.
        self.loader, self.it, self.ring, self.t0 = weakref.ref(loader), it, ring, t0
        self.persistent = loader.dataloader.persistent_workers
        self.slots = loader.slots
        self.closed = False
        loader.first_batch_s = None

    def __iter__(self):
        return self

    def __next__(self):
        loader = None if self.closed else self.loader()
        if loader is None:  # closed, or the loader was dropped while a thread still pulled
            self.close()
            raise StopIteration
        return self._next(loader)

    def _next(self, loader):
        batch = self._fetch(loader)
        if isinstance(batch, dict) and PART in batch:  # a cut batch's first part: join them
            parts = [batch]
            while len(parts) < batch[PART][1]:
                parts.append(self._fetch(loader))
            batch = merge_parts(parts, loader.pin_memory)
            loader.joined_batches += 1
        if not loader._checked_first_batch:
            loader._checked_first_batch = True
            loader._check_first_batch(batch)
        return batch

    def _fetch(self, loader):
        """The DataLoader's next batch (or part), out of its reused slot."""
        try:
            with watchdog.main_process_batch(0 if loader.num_workers else loader.timeout):
                batch = next(self.it)
        except StopIteration:
            if self.ring is not None:
                self.ring.reset()  # nothing in flight now: slots of abandoned tasks too
            self.close()
            raise
        except RuntimeError as exc:
            if loader.timeout and loader.num_workers and watchdog.is_timeout(exc):
                raise watchdog.stall_error(self.it, loader.timeout) from exc
            raise
        if loader.first_batch_s is None:
            loader.first_batch_s = time.perf_counter() - self.t0
        if self.ring is not None:
            batch = self.ring.resolve_batch(batch, loader.pin_memory)
        elif loader.slots is not None:  # a stream without slots: its targets came inline
            batch = resolve_inline(batch, loader.pin_memory)
        return batch

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.persistent:
            shutdown_workers(self.it)
            if self.slots is not None:
                self.slots.close()
