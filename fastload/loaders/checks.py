"""Checks a loader makes before and at its first batch: /dev/shm room for the workers'
batches, the pinned-memory cap, and batch entries that pinning silently left pageable."""

from __future__ import annotations

import logging

import numpy as np
import torch

from fastload.errors import ConfigError
from fastload.host import MB, SHM, SHM_FIX, shm_bytes, total_ram

log = logging.getLogger("fastload.loaders")

SHM_FLOOR = 256 * MB  # Docker's default is 64 MiB: workers die with "Bus error" well before 256


def check_options(timeout, prefetch_factor) -> None:
    """Values torch's DataLoader would reject with a traceback, named as options instead."""
    number = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
    if not (number and timeout >= 0):
        raise ConfigError(f"loader.timeout={timeout!r}: use 0 (wait forever) or seconds > 0.")
    whole = isinstance(prefetch_factor, int) and not isinstance(prefetch_factor, bool)
    if prefetch_factor is not None and not (whole and prefetch_factor >= 1):
        raise ConfigError(
            f"loader.prefetch_factor={prefetch_factor!r}: use a whole number >= 1 (batches in "
            f"flight per worker; 2 is torch's default)."
        )


def check_max_prefetch(value) -> None:
    """loader.max_prefetch (loader=bg): the background thread's queue, a whole number >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"loader.max_prefetch={value!r}: use a whole number >= 1 (batches queued ahead by "
            f"the thread; a bounded queue)."
        )


def resolve_balanced_tail(value, on_cuda: bool) -> bool:
    """loader.balanced_tail: true, false, or auto = on for CPU training, off on a CUDA run.
    On an H200 (ResNet-50, 14 workers, batches of 256) cut batches cost every evaluation
    pass of 8 batches 0.4-0.7 s against 0.10 s whole, and training's last epoch 37 % data
    wait against 1 %; on CPU training the cut keeps the last round's cores busy."""
    if value == "auto":
        return not on_cuda
    if isinstance(value, bool):
        return value
    raise ConfigError(
        f"loader.balanced_tail={value!r}: use auto (on for CPU training, off on a GPU), "
        "true (cut a stream's last round of batches across the workers) or false."
    )


PIN_RAM_SHARE = 0.25


def resolve_pin_cap(value, local_world_size: int) -> float | None:
    """loader.pin_memory_max_mb: MiB (2**20 bytes), null (no cap) or auto = a quarter of the
    host's RAM, shared by the node's ranks (on a 125 GiB host with one rank: ~31 GiB)."""
    if value is None:
        return None
    if value == "auto":
        return total_ram() * PIN_RAM_SHARE / max(1, local_world_size) / MB
    try:
        cap = float(value)
    except (TypeError, ValueError):
        cap = -1.0
    if cap <= 0:
        raise ConfigError(
            f"loader.pin_memory_max_mb={value!r}: use a number of MiB > 0, auto (a quarter of "
            f"the RAM per node, shared by its ranks) or null (no cap)."
        )
    return cap


def warn_small_shm(num_workers: int) -> None:
    """At construction: a /dev/shm far too small for any worker batches (Docker's 64 MiB)."""
    shm = shm_bytes()
    if num_workers and shm is not None and shm[0] < SHM_FLOOR:
        log.warning(
            "%s is only %d MiB and loader.num_workers=%d: workers pass every batch through "
            "it and die with 'Bus error' or hang when it fills. %s",
            SHM,
            shm[0] // MB,
            num_workers,
            SHM_FIX,
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


def check_pinned(batch, batch_bytes: int, loader) -> None:
    """Unpinnable entries warn; pinned memory in flight above loader.pin_memory_max_mb stops
    the run: too much page-locked memory can freeze the host (pytorch#135794), and silently
    unpinning would hide a slowdown."""
    missed = unpinned_entries(batch)
    if missed:
        log.warning(
            "loader.pin_memory=true, but these batch entries could not be pinned and are "
            "copied from pageable memory: %s",
            ", ".join(missed[:5]) + (" ..." if len(missed) > 5 else ""),
        )
    in_flight = loader.num_workers * loader.prefetch_factor + loader.stage_batches
    pinned, cap = batch_bytes * in_flight, loader.pin_memory_max_mb
    if cap is not None and pinned > cap * MB:
        raise ConfigError(
            f"pinned memory in flight would be about {pinned / MB:.0f} MiB (batches of "
            f"{batch_bytes / MB:.1f} MiB x {in_flight}: loader.num_workers="
            f"{loader.num_workers} x loader.prefetch_factor={loader.prefetch_factor} + "
            f"{loader.stage_batches} held by the loader stages), above "
            f"loader.pin_memory_max_mb={loader.pin_memory_max_option} ({cap:,.0f} MiB). Lower loader.prefetch_factor, "
            f"loader.num_workers or trainer.batch_size, raise loader.pin_memory_max_mb "
            f"(null: no cap) if the host has the RAM, or set loader.pin_memory=false."
        )


def check_shm_room(batch_bytes: int, num_workers: int, prefetch_factor: int) -> None:
    """At the first batch: /dev/shm free space against the workers' batches in flight."""
    shm = shm_bytes()
    need = 2 * num_workers * prefetch_factor * batch_bytes
    if num_workers and shm is not None and shm[1] < need:
        log.warning(
            "%s has %d MiB free; loader.num_workers=%d x loader.prefetch_factor=%d batches of "
            "%.1f MiB want about %d MiB (with 2x headroom). %s",
            SHM,
            shm[1] // MB,
            num_workers,
            prefetch_factor,
            batch_bytes / MB,
            need // MB,
            SHM_FIX,
        )
