"""Checks that a run is still learning something, made while it trains, so that a run whose
numbers mean nothing ends with an error instead of a normal-looking summary:

* `LossWatch`: the first step whose loss is not finite (nan, inf) stops the run, naming the
  epoch, the step, the loss and the likely causes. The weights are non-finite from that step
  on, so every later step, evaluation and checkpoint would be worthless: the newest
  checkpoint on disk is kept as it was. On a GPU the watch costs no host sync per step: the
  loss is checked on the device and the verdict copied back asynchronously.
* `SkipBudget`: more undecodable samples skipped (dataset.skip_corrupt=true) than
  dataset.max_skipped_share of an epoch stops the run, naming the first files: a truncated
  shard that skips every sample must not "succeed" with a train loss of 0.

The loop (fastload/engine.py) asks both at the same points where the ranks agree to stop, so
every rank stops at the same step.
"""

from __future__ import annotations

import math

import torch

from fastload.errors import ConfigError, FastloadError


class TrainingDiverged(FastloadError):
    """The training loss became non-finite; the message names the step and the causes."""


class TooManySkipped(FastloadError):
    """More samples were skipped as undecodable than dataset.max_skipped_share allows."""


class LossWatch:
    """Records, on the device, the first step of an epoch whose loss is not finite."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.state = torch.zeros(3, dtype=torch.float64, device=device)
        self._host = self._event = None

    def start(self, first_step: int) -> None:
        """[steps counted, the first non-finite step, its loss]; nan: none yet."""
        self.state.copy_(torch.tensor([first_step, math.nan, math.nan], dtype=torch.float64))
        self._event = None

    def add(self, sums: torch.Tensor) -> None:
        """One step's sums (a Step's `train` result: loss sum first, sample count last)."""
        loss = sums[0] / sums[-1].clamp(min=1)
        new = ~torch.isfinite(loss) & torch.isnan(self.state[1])
        self.state[1:] = torch.where(new, torch.stack((self.state[0], loss)), self.state[1:])
        self.state[0] += 1

    def first_bad(self, wait: bool = False) -> tuple[int, float] | None:
        """(step, loss) of the first non-finite loss seen, or None. On a GPU without `wait`
        this answers from the previous call's asynchronous copy (one call late at most)."""
        if not self.cuda or wait:
            values = self.state.tolist()
        else:
            values = None
            if self._event is not None and self._event.query():
                values = self._host.tolist()
            if self._host is None:
                self._host = torch.empty(3, dtype=torch.float64, pin_memory=True)
            self._host.copy_(self.state, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        if values is None or math.isnan(values[1]):
            return None
        return int(values[1]), values[2]


def weights_finite(model: torch.nn.Module) -> bool:
    """Whether every parameter is finite (one host sync; called once per epoch): a step whose
    loss was still finite can leave non-finite weights, which only the next loss would show."""
    flags = [torch.isfinite(p).all() for p in model.parameters()]
    return bool(torch.stack(flags).all()) if flags else True


def diverged_message(epoch: int, found: tuple[int, float] | None, lr: float, fp16: bool,
                     cfg) -> str:  # fmt: skip
    """`found`: this rank's first non-finite (step, loss); None: the weights (or another
    rank's loss) went non-finite while this rank's losses were finite."""
    what = (
        f"the training loss became non-finite at epoch {epoch} step {found[0]} (loss {found[1]})"
        if found is not None
        else f"the model's weights became non-finite in epoch {epoch} (its losses here were finite)"
    )
    return (
        f"{what}: from there nothing the run learns is usable, so it stops (the newest "
        f"checkpoint on disk is kept as it was). Likely causes: a learning rate too high "
        f"(optim.base_lr={cfg.optim.base_lr}, {lr:.4g} at this step after scaling by the "
        f"global batch and warm-up: lower it, or raise optim.warmup_epochs); "
        + ("fp16 overflow (trainer.precision=bf16 or fp32); " if fp16 else "")
        + "labels outside the model's classes or broken inputs (check the data with "
        "`python -m fastload.doctor`); a custom loss that divides by zero."
    )


def checked_share(max_share) -> float:
    """dataset.max_skipped_share as a float; ConfigError outside [0, 1]."""
    number = isinstance(max_share, (int, float)) and not isinstance(max_share, bool)
    if not (number and 0 <= max_share <= 1):
        raise ConfigError(
            f"dataset.max_skipped_share={max_share!r}: use a fraction in [0, 1] of an epoch's "
            f"samples that dataset.skip_corrupt=true may skip (e.g. 0.01)."
        )
    return float(max_share)


class SkipBudget:
    """dataset.max_skipped_share of an epoch's samples may be skipped as undecodable."""

    def __init__(self, max_share: float, epoch_samples: int):
        self.max_share = checked_share(max_share)
        self.limit = self.max_share * epoch_samples  # of the whole epoch, all ranks

    def exceeded_early(self, skipped_here: int) -> bool:
        """This rank alone already skipped more than the whole epoch may: stop now instead of
        running the rest of an epoch that cannot pass."""
        return skipped_here > self.limit

    def check(self, epoch: int, what: str, skipped: int, used: int, files: list[str],
              part: bool = False) -> None:  # fmt: skip
        """An epoch's (or evaluation's) totals over all ranks: TooManySkipped when the share
        of skipped samples is above the bound. `part`: the epoch was stopped by a signal or
        resumed inside: the share of the part seen says little of the whole epoch's (one
        file in a stopped epoch's first 8 samples is 12.5 %), so only more skips than the
        whole epoch may have stop it; else a preempted run ended without its checkpoint."""
        seen = skipped + used
        over = skipped > self.limit if part else seen and skipped > self.max_share * seen
        if not over:
            return
        shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        raise TooManySkipped(
            f"epoch {epoch}: {skipped} of {seen} {what} samples ({100 * skipped / seen:.1f} "
            f"%) could not be decoded and were skipped (dataset.skip_corrupt=true), more than "
            f"dataset.max_skipped_share={self.max_share} allows, so the run stops: its "
            f"numbers would describe a fraction of the data. First: {shown or 'n/a'}. Repair "
            f"or re-pack the data (a truncated shard or download?), or raise "
            f"dataset.max_skipped_share if that share is expected."
        )
