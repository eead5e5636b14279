"""One way to time a loader feeding a step: `python -m fastload.bench loaders`, the bottleneck
doctor (`python -m fastload.doctor`) and loader=auto's probe (fastload/autotune.py) all time
with this module, so their numbers mean the same thing.

* `SleepStep(ms, device)`: a stand-in training step of fixed duration. It sleeps, which
  releases the GIL the way a GPU step does (CUDA kernels launch asynchronously), so overlap
  between loading and the step shows; it has the Step interface the engine calls
  (fastload/tasks/base.py), so `bench train` runs the real loop with it.
* `feed(batches, step, ...)` -> `Feed`: `warmup` batches through the step untimed (worker
  start-up), then batches until `max_batches`, the end of the data or `budget_s`, timing the
  wait inside `next()` (the data wait) and the whole (wall).
* `host_epoch(loader, epoch)`: one epoch of a loader's host stage alone (read, decode,
  augment, collate), over the whole epoch and from its first batch on.
* `step_times(step, batch, ...)`: seconds of each of a step's calls on one resident batch
  (its own cost, no loading): the doctor's model stage and loader=auto's step time.

It sits beside the engine, not in bench/ or doctor/: loader=auto runs inside a training run,
which imports no tool (tests/test_layout.py).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from fastload.tasks.base import SumsEvaluator
from fastload.tasks.classification import ClassificationStep
from fastload.telemetry.timer import drain_s

EVAL_STEP_SHARE = 1 / 3  # a forward pass costs about a third of forward + backward


class SleepStep:
    """A training step of fixed duration that releases the GIL; counts samples like a
    classification step (train sums [loss, correct, count]), evaluation a third as long."""

    train_sums = ClassificationStep.train_sums
    train_metrics = staticmethod(ClassificationStep.train_metrics)

    def __init__(self, ms: float, device="cpu"):
        self.seconds, self.device = float(ms) / 1000, torch.device(device)

    def train_mode(self) -> None:
        pass

    eval_mode = after_step = sync = finish = train_mode
    settled = True  # no gradients, so none wait for an update

    def begin(self, batches) -> None:
        pass

    def train_empty(self, skipped_files=()) -> None:
        pass

    def train(self, batch) -> torch.Tensor:
        time.sleep(self.seconds)
        n = len(batch["target"])
        return torch.tensor([0.0, 0.0, n], dtype=torch.float64, device=self.device)

    def evaluator(self, model=None) -> SumsEvaluator:
        return SumsEvaluator(self.device, 4, self.eval_sums, ClassificationStep.val_metrics)

    def eval_sums(self, batch) -> torch.Tensor:
        time.sleep(self.seconds * EVAL_STEP_SHARE)
        n = len(batch["target"])
        return torch.tensor([0.0, 0.0, 0.0, n], dtype=torch.float64, device=self.device)


@dataclasses.dataclass
class Feed:
    """What `feed` measured over its timed batches."""

    images: int = 0
    batches: int = 0
    wall_s: float = 0.0
    wait_s: float = 0.0  # inside next(): the step waited for data

    @property
    def images_per_s(self) -> float:
        return self.images / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def data_wait_share(self) -> float:
        return self.wait_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def ms_per_step(self) -> float:
        return 1000 * self.wall_s / self.batches if self.batches else float("nan")

    def row(self) -> dict:
        return {
            "images_per_s": self.images_per_s,
            "data_wait_share": self.data_wait_share,
            "ms_per_step": self.ms_per_step,
        }


def feed(batches, step, *, warmup: int = 0, max_batches: int | None = None,
         budget_s: float | None = None, sync=None, loader=None) -> Feed:  # fmt: skip
    """Feed `batches` (a loader or any iterable of batch dicts) to `step.train`, the first
    `warmup` untimed; then time up to `max_batches` (None: to the end) within `budget_s`
    (None: no limit; checked before each batch). `sync` (default: the step's own `sync`)
    brackets the timed part, so a GPU step's queued work is inside it. `loader`: the one
    whose iterator `batches` is (default: `batches` itself), whose `device_drain_s` is the
    step's compute. Closes the iterator when it has `close`."""
    sync = sync or step.sync
    loader = batches if loader is None else loader
    it = iter(batches)
    out = Feed()
    try:
        for _ in range(warmup):
            batch = next(it, None)
            if batch is None:
                return out
            step.train(batch)
            step.after_step()
        sync()
        t0 = time.perf_counter()
        while max_batches is None or out.batches < max_batches:
            if budget_s is not None and time.perf_counter() - t0 >= budget_s:
                break
            w0, d0 = time.perf_counter(), drain_s(loader)
            batch = next(it, None)
            # the end too (a DataLoader joins its workers); less the loader's wait for the
            # GPU's queued work, which is the step's compute
            out.wait_s += time.perf_counter() - w0 - (drain_s(loader) - d0)
            if batch is None:
                break
            step.train(batch)
            step.after_step()  # the update (once per trainer.grad_accum_steps batches)
            out.batches += 1
            out.images += len(batch["target"])
        sync()
        out.wall_s = time.perf_counter() - t0
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    return out


def step_times(step, batch, *, steps: int, warmup: int, sync) -> list[float]:
    """Seconds of each of `steps` training steps on `batch` (`train` and `after_step`: the
    update, once per trainer.grad_accum_steps batches) after `warmup` untimed ones (lazy
    set-up, cuDNN's algorithm search, the allocator growing). `sync` runs after each, so a
    GPU step's queued work is timed with it."""
    for _ in range(warmup):
        step.train(batch)
        step.after_step()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step.train(batch)
        step.after_step()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def host_epoch(loader, epoch: int) -> dict:
    """One epoch of a loader's host stage: images/s over the whole epoch and from its first
    batch on (steady: leaves out start-up and the first batch)."""
    loader.set_epoch(epoch)
    t0 = time.perf_counter()
    t_first, n, n_first = None, 0, 0
    for batch in loader.host_batches():
        n += len(batch["target"])
        if t_first is None:
            t_first, n_first = time.perf_counter(), n
    t1 = time.perf_counter()
    return {
        "epoch_img_s": n / (t1 - t0),
        # None with no batch after the first (an epoch of one batch): nothing was measured
        "steady_img_s": (n - n_first) / (t1 - t_first) if n > n_first and t1 > t_first else None,
    }
