"""An epoch interrupted at one world size and continued at another (a lost node, a smaller
or larger allocation): exactly the samples it had not trained yet, each once, over the new
ranks.

A training epoch is a *plan*: every rank's batches of sample indices. A fresh epoch's plan
is its sampler's (`rank_orders`: EpochSampler's DistributedSampler shuffle and split, or
ShardStreamSampler's shard stream), cut into batches as the loader cuts it (drop_last,
trainer.max_steps_per_epoch). An epoch stopped after `s` steps at world size W has trained
each rank's first `s` batches. Continuing it at world size W' != W:

1. `rest`: every rank's remaining batches, rank after rank, keeping each index once and
   none that was trained already (the padding that gives every rank as many samples as
   the others repeats a few; those repeats go);
2. `split_rest`: steps of batch_size x W' indices; each step's indices are shared out as
   evenly as possible (rank sizes differ by at most one), each rank taking one contiguous
   run of the rest across the steps (a store read shard by shard keeps its locality). DDP
   needs every rank at every step's all-reduce, so no rank may run out first, and a batch of
   one sample fails BatchNorm: when the last step would give a rank fewer than MIN_BATCH,
   the step before it gives some up. Only what cannot be shared that way (a rest under
   2 x MIN_BATCH x the new world size; never more than that) is left out, counted in
   `RestPlan.left_out` and logged. No batch grows beyond batch_size (it may be what fits in
   GPU memory).

A continued epoch may stop again and go on at yet another world size: the checkpoint keeps
the *stretches* the epoch has run, `(world size, steps)` each, and `epoch_plan` rebuilds
the plan through them. A sample's augmentation is a function of (seed, epoch, index) only
(fastload/data/rng.py), so it is the same whichever rank trains it, and when.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastload.data.sampling import epoch_batch_count

Stretch = tuple[int, int]  # (world size, steps trained at it)

# The fewest samples a rank gets in a step of a continued epoch (batch_size 1: one): with
# one, BatchNorm fails in training ("Expected more than 1 value per channel").
MIN_BATCH = 2


@dataclass(frozen=True)
class RestPlan:
    """Every rank's batches of one epoch (index arrays), and what building it left out."""

    batches: list[list[np.ndarray]]  # [rank][step]
    left_out: int = 0  # samples a continuation could not give to every rank

    @property
    def steps(self) -> int:
        return len(self.batches[0]) if self.batches else 0


def fresh_plan(orders: list[np.ndarray], batch_size: int, drop_last: bool,
               cap: int | None = None) -> RestPlan:  # fmt: skip
    """A fresh epoch's plan from each rank's sample order (equal lengths), batched as the
    loader batches it."""
    n = epoch_batch_count(len(orders[0]), batch_size, drop_last)
    n = min(n, cap) if cap else n
    cut = [
        [np.asarray(o[b * batch_size : (b + 1) * batch_size], np.int64) for b in range(n)]
        for o in orders
    ]
    return RestPlan(cut)


def rest(plan: RestPlan, steps: int, seen: np.ndarray) -> np.ndarray:
    """The indices `plan` had still to train after `steps` steps, rank after rank, each once,
    none of those marked in `seen` (which this marks with the ones trained)."""
    for rank in plan.batches:
        for b in rank[:steps]:
            seen[b] = True
    parts = [b for rank in plan.batches for b in rank[steps:]]
    left = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    _, first = np.unique(left, return_index=True)
    once = np.zeros(len(left), bool)
    once[first] = True
    return left[once & ~seen[left]]


def split_rest(indices: np.ndarray, world_size: int, batch_size: int) -> RestPlan:
    """`indices` over `world_size` ranks in steps of `batch_size` per rank (see the module
    docstring): every rank the same number of steps, in every step at least MIN_BATCH
    samples on every rank (batch_size 1: one) and at most batch_size."""
    total, w = len(indices), int(world_size)
    full = batch_size * w
    n = -(-total // full)
    totals = [full] * (n - 1) + ([total - (n - 1) * full] if n else [])
    least = min(MIN_BATCH, batch_size) * w  # a step's fewest samples: MIN_BATCH on every rank
    left_out = 0
    if totals and totals[-1] < least:
        if len(totals) > 1 and totals[-2] + totals[-1] >= 2 * least:
            both = totals[-2] + totals[-1]  # the step before gives some up
            totals[-2:] = [both - least, least]
        else:  # too few to give every rank its MIN_BATCH: left out, counted
            left_out = totals.pop()
    sizes = np.array([[t // w + (r < t % w) for t in totals] for r in range(w)], np.int64)
    sizes = sizes.reshape(w, len(totals))
    starts = np.concatenate([[0], np.cumsum(sizes.sum(axis=1))])
    batches = []
    for r in range(w):
        run = indices[starts[r] : starts[r + 1]]
        batches.append(np.split(run, np.cumsum(sizes[r])[:-1]) if len(totals) else [])
    return RestPlan(batches, left_out)


def epoch_plan(orders_at, stretches: list[Stretch], world_size: int, batch_size: int,
               drop_last: bool, cap: int | None = None) -> RestPlan:  # fmt: skip
    """The plan of an epoch at `world_size` after `stretches` (none: a fresh epoch).
    `orders_at(w)` is the sampler's per-rank orders of this epoch at world size w."""
    first = stretches[0][0] if stretches else world_size
    orders = orders_at(first)
    plan = fresh_plan(orders, batch_size, drop_last, cap)
    if not stretches:
        return plan
    seen = np.zeros(int(max((o.max() for o in orders if len(o)), default=-1)) + 1, bool)
    worlds = [w for w, _ in stretches[1:]] + [world_size]
    left_out = 0
    for (w, steps), after in zip(stretches, worlds, strict=True):
        if len(plan.batches) != w:
            raise ValueError(f"a stretch at world size {w} follows a plan of "
                             f"{len(plan.batches)} ranks")  # fmt: skip
        plan = split_rest(rest(plan, steps, seen), after, batch_size)
        left_out += plan.left_out
    return RestPlan(plan.batches, left_out)
