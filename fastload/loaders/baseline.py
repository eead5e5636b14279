"""loader=baseline: torch DataLoader, every knob from the config, transfer in the train thread."""

from __future__ import annotations

import logging
import os
import random
import signal
import sys

import numpy as np
import torch
from torch.utils.data import DataLoader

from fastload.data.dataset import collate
from fastload.errors import ConfigError
from fastload.loaders.device_prep import DevicePrep

log = logging.getLogger(__name__)


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


def worker_init(worker_id: int) -> None:
    # torch already seeded this worker's torch RNG with base_seed + worker_id, where the base
    # seed is drawn per epoch and rank from the loader's generator; derive numpy and random
    # from it so user transforms that use the global RNGs differ across workers (pytorch#5059).
    seed = torch.initial_seed()
    np.random.seed(seed % 2**32)
    random.seed(seed)
    # One intra-op thread per worker: N workers x all-core thread pools oversubscribe the CPU.
    torch.set_num_threads(1)
    if "cv2" in sys.modules:
        sys.modules["cv2"].setNumThreads(0)
    # Ctrl-C is the main process's to handle (it writes a checkpoint, then stops the workers);
    # a worker dying of SIGINT mid-batch would turn that into "worker exited unexpectedly".
    signal.signal(signal.SIGINT, signal.SIG_IGN)


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
        persistent_workers: bool = False,
        prefetch_factor: int | None = 2,
        drop_last: bool = True,
        timeout: float = 0,
        normalize_on: str = "device",
    ):
        if normalize_on not in ("device", "cpu"):
            raise ConfigError(f"loader.normalize_on={normalize_on!r}: use 'device' or 'cpu'.")
        device = torch.device(device)
        self.num_workers = resolve_num_workers(num_workers, local_world_size)
        self.pin_memory = device.type == "cuda" if pin_memory == "auto" else bool(pin_memory)
        # Normalise exactly once: in the workers (textbook) or after transfer (uint8 moves).
        dataset.normalize = normalize if normalize_on == "cpu" else None
        self.device_prep = DevicePrep(
            device,
            normalize if normalize_on == "device" else None,
            channels_last,
            decoder=getattr(dataset.backend, "device_decoder", None),  # backend=nvjpeg
        )
        self.sampler = sampler
        self.seed, self.rank = seed, rank
        self.generator = torch.Generator()
        workers = self.num_workers > 0
        self.dataloader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            collate_fn=collate,
            pin_memory=self.pin_memory,
            drop_last=drop_last and train,
            timeout=timeout if workers else 0,
            worker_init_fn=worker_init if workers else None,
            generator=self.generator,
            persistent_workers=persistent_workers and workers,
            prefetch_factor=prefetch_factor if workers else None,
        )

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.sampler.set_epoch(epoch, skip=skip_batches * self.dataloader.batch_size)
        self.generator.manual_seed(hash((self.seed, epoch, self.rank)) & (2**63 - 1))

    def __len__(self) -> int:
        return len(self.dataloader)

    def __iter__(self):
        for batch in self.dataloader:
            yield self.device_prep(batch)
