"""Per-epoch wall time split into data wait (blocked in ``next()``) and compute.

The split is what tells a starved GPU from a slow model: time the training loop spends
blocked inside the loader's ``__next__`` is data wait, everything else is compute.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EpochTiming:
    """Timing of one epoch (or any window between `StepTimer.start()` and `stop()`)."""

    wall_s: float
    data_wait_s: float
    compute_s: float
    samples: int
    steps: int
    outside_s: float = 0.0  # left out of wall_s: work neither data nor training (`outside`)

    @property
    def images_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def data_wait_share(self) -> float:
        """Fraction (0..1) of the wall time spent blocked waiting for the next batch."""
        return self.data_wait_s / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        """Flat dict of floats: the fields plus ``images_per_s`` and ``data_wait_share``."""
        return {
            "wall_s": float(self.wall_s),
            "data_wait_s": float(self.data_wait_s),
            "compute_s": float(self.compute_s),
            "samples": float(self.samples),
            "steps": float(self.steps),
            "outside_s": float(self.outside_s),
            "images_per_s": float(self.images_per_s),
            "data_wait_share": float(self.data_wait_share),
        }


def drain_s(loader) -> float:
    """Seconds `loader` has waited inside `next()` for the GPU's queued work (a copy from
    pageable memory, a GPU decode in the training thread: fastload/loaders/
    dataloader_stream.py, `_drain_device`); 0 for any other iterable."""
    return getattr(loader, "device_drain_s", 0.0)


class StepTimer:
    """Measures an epoch: ``start()``, loop over ``iter(loader)``, ``add_samples(n)``, ``stop()``.

    Per step it costs two ``perf_counter()`` calls and a generator hop (about a microsecond).
    With ``cuda_sync=True`` the device is synchronised in ``stop()`` only, so the wall time
    includes queued GPU work; syncing every step would serialise the very overlap of data
    loading and compute this timer exists to measure. A loader whose `next()` must wait for
    the GPU's queued work (a copy from pageable memory) times that wait itself
    (`device_drain_s`), and it is counted as compute, not data wait.
    """

    def __init__(self, cuda_sync: bool = False) -> None:
        self.cuda_sync = cuda_sync
        self._t0: float | None = None
        self._data_wait_s = 0.0
        self._outside_s = 0.0
        self._samples = 0
        self._steps = 0

    def start(self) -> None:
        """Start a new window; clears the counters."""
        self._data_wait_s = 0.0
        self._outside_s = 0.0
        self._samples = 0
        self._steps = 0
        self._t0 = time.perf_counter()

    def iter(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield the items of `iterable`, counting time blocked in ``iter()``/``next()`` as data wait.

        ``iter()`` is inside the measurement because for a DataLoader it is where worker
        processes start and the first batches are requested: the GPU waits for that too.
        """
        if self._t0 is None:
            self.start()
        perf_counter = time.perf_counter  # local name: this loop runs once per step
        t, drained = perf_counter(), drain_s(iterable)
        it = iter(iterable)
        while True:
            try:
                item = next(it)
            except StopIteration:
                # Exhaustion can be slow too (a DataLoader joins its workers here).
                self._data_wait_s += perf_counter() - t
                return
            # less the loader's wait for the GPU's queued work inside next(): the step's compute
            self._data_wait_s += perf_counter() - t - (drain_s(iterable) - drained)
            self._steps += 1
            yield item
            t, drained = perf_counter(), drain_s(iterable)

    @contextlib.contextmanager
    def data_work(self) -> Iterator[None]:
        """Time the loop spends on the data path outside ``next()`` (starting the evaluation
        loader's workers before training's last steps): counted as data wait, like the
        worker start inside ``iter()``, not as compute."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self._data_wait_s += time.perf_counter() - t

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """Time the loop spends on what is neither data nor training (a checkpoint written
        inside the epoch): left out of the window's wall time, so that it lowers neither
        images/s nor the data-wait share, and counted apart (`outside_s`). With cuda_sync
        the GPU's queued work is waited for first, inside the window: it is the steps'."""
        self._sync()
        t = time.perf_counter()
        try:
            yield
        finally:
            self._outside_s += time.perf_counter() - t

    def add_samples(self, n: int) -> None:
        self._samples += int(n)

    def _sync(self) -> None:
        if self.cuda_sync:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()

    def _elapsed(self) -> float:
        if self._t0 is None:
            return 0.0
        return time.perf_counter() - self._t0 - self._outside_s

    @property
    def outside_s(self) -> float:
        """Seconds inside ``outside()`` since ``start()`` (left out of the window)."""
        return self._outside_s

    @property
    def images_per_s(self) -> float:
        """Live throughput since ``start()`` (no device sync: GPU work may still be queued)."""
        elapsed = self._elapsed()
        return self._samples / elapsed if elapsed > 0 else 0.0

    @property
    def data_wait_share(self) -> float:
        """Live fraction of the elapsed time spent waiting for data."""
        elapsed = self._elapsed()
        return min(1.0, self._data_wait_s / elapsed) if elapsed > 0 else 0.0

    def stop(self) -> EpochTiming:
        """End the window and return its timing. Safe after an early ``break`` from ``iter()``."""
        self._sync()
        wall_s = self._elapsed()
        data_wait_s = min(self._data_wait_s, wall_s)
        timing = EpochTiming(
            wall_s=wall_s,
            data_wait_s=data_wait_s,
            compute_s=max(0.0, wall_s - data_wait_s),
            samples=self._samples,
            steps=self._steps,
            outside_s=self._outside_s,
        )
        self._t0 = None
        return timing
