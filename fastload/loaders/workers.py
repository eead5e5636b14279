"""DataLoader worker processes: how many, how each starts, how each seeds the global RNGs."""

from __future__ import annotations

import contextlib
import faulthandler
import io
import random
import re
import signal
import sys

import numpy as np
import torch
from torch.utils.data import get_worker_info

from fastload.data.sampling import BatchPart
from fastload.errors import ConfigError, FastloadError
from fastload.host import auto_num_workers, usable_cores
from fastload.torch_internals import stuck_worker


def resolve_num_workers(value, local_world_size: int) -> int:
    """loader.num_workers: a whole number, or auto = usable cores / local ranks."""
    if value == "auto":
        return auto_num_workers(usable_cores(), local_world_size)
    return check_num_workers(value)


def check_num_workers(value) -> int | str:
    """loader.num_workers as given: a whole number >= 0 (also as digits: an environment
    variable's) or auto; ConfigError naming it otherwise (2.7 is not cut to 2, true is not
    1)."""
    if value == "auto":
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"loader.num_workers={value!r}: use a whole number >= 0 or 'auto'.")
    return value


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


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def stop_signals_blocked():
    """`with stop_signals_blocked(): iter(dataloader)`: the workers are forked with Ctrl-C
    and SIGTERM blocked (a signal mask survives fork), so one that lands between a worker's
    fork and its `worker_init`, which ignores them, waits there and is then dropped, instead
    of killing the worker with the default action (a preempted run then ended "worker killed
    by signal Terminated", without its checkpoint). The parent gets any that arrived once
    the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def worker_init(worker_id: int) -> None:
    # Global RNGs are seeded per batch by WorkerSeeding (below), which also covers
    # persistent workers and batches of an epoch reached across a pipelined boundary.
    # One intra-op thread per worker: N workers x all-core thread pools oversubscribe the CPU.
    torch.set_num_threads(1)
    if "cv2" in sys.modules:
        sys.modules["cv2"].setNumThreads(0)
    # Ctrl-C and SIGTERM are the main process's to handle (it writes a checkpoint, then stops
    # the workers); a worker dying of one mid-batch turned that into "worker exited
    # unexpectedly" and no checkpoint. Both reach the workers too: a terminal's Ctrl-C goes
    # to the foreground process group, and torchrun, Slurm and `kill -- -PGID` send SIGTERM
    # to the whole group. A worker still goes when its parent does (torch's watchdog), and
    # with SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # forked blocked: see below
    # The stall watchdog sends SIGUSR1 to a stuck worker: it prints its own Python stacks
    # (from C, so it works even while the worker is blocked in a read or a decoder).
    stream = fault_stream()
    if hasattr(faulthandler, "register") and hasattr(signal, "SIGUSR1") and stream is not None:
        faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True, chain=False)
    keep_freed_memory()


# glibc's malloc gives a batch's freed buffers (decoded regions, ~48 MB for 64 ROI crops of
# 400-500 px photos) back to the kernel at the end of every batch (its dynamic trim threshold
# is twice the largest buffer), so the next batch faults every page in again: 4-15 page faults
# and 30-50 us of kernel time per sample on 2 cores (user time ~700 us). Keeping up to
# MALLOC_TRIM_BYTES of freed heap, with buffers below MALLOC_MMAP_BYTES served from the heap,
# stops that at the cost of each worker holding its largest batch's buffers (the pages were
# re-faulted on every batch anyway). Batch-sized tensors stay above the mmap threshold.
MALLOC_MMAP_BYTES = 4 * 2**20
MALLOC_TRIM_BYTES = 128 * 2**20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def keep_freed_memory() -> bool:
    """In a worker: glibc keeps freed batch buffers for the next batch. False where the C
    library is not glibc (musl, macOS) or refuses; nothing changes there."""
    import ctypes

    try:
        # The process's own symbols (libc among them): ctypes.util.find_library would run
        # ldconfig in a subprocess at every worker's start.
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_BYTES)
        and mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_BYTES)
    )


def batch_seed(seed: int, rank: int, epoch: int, first_index: int) -> int:
    return int(np.random.SeedSequence([seed, rank, epoch, first_index]).generate_state(1)[0])


class WorkerSeeding(torch.utils.data.Dataset):
    """Seeds numpy, `random` and torch in a worker at the start of every batch, from (seed,
    rank, epoch, the batch's first index): distinct across batches and workers (pytorch#5059),
    new every epoch even with persistent workers, reproducible across runs, and independent of
    which worker builds the batch, of the worker count, and of whether the epoch was reached
    through a pipelined stream or a resume. Our own transforms need none of it (each sample
    has its own RNG); user code that draws from the global RNGs does. In the main process
    (num_workers=0) the global RNGs belong to the training loop and are left alone."""

    def __init__(self, dataset, seed: int, rank: int, batched: bool = False):
        self.dataset, self.seed, self.rank = dataset, int(seed), int(rank)
        # batched: the collate is fastload's (fastload/data/batch.py), so a whole batch of
        # keys goes to the dataset's `load_batch` when it has one (one call per batch; raw
        # crops resized straight into the batch's slot).
        self.load_batch = getattr(dataset, "load_batch", None) if batched else None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, keys: list) -> list:
        """The DataLoader's fetcher hands a worker a whole batch of keys at once."""
        if keys and get_worker_info() is not None:
            epoch, index = keys[0] if isinstance(keys[0], tuple) else (0, keys[0])
            s = batch_seed(self.seed, self.rank, epoch, index)
            np.random.seed(s)
            random.seed(s)
            # The CPU generator only: torch.manual_seed also queues a CUDA seeding, which in
            # a worker (CUDA never initialised there) formats the call stack every batch
            # (~2 % of a JPEG worker's time); a loader worker must not use CUDA anyway.
            torch.default_generator.manual_seed(s)
        samples = (
            self.load_batch(keys)
            if self.load_batch is not None
            else [self.dataset[k] for k in keys]
        )
        # A part of a cut batch (EpochBatches' stream tail) keeps its mark for collate.
        return keys.like(samples) if isinstance(keys, BatchPart) else samples

    def __getitem__(self, key):
        return self.__getitems__([key])[0]


class LoaderWorkerDied(FastloadError):
    """A DataLoader worker process died (a signal or an exit without a word)."""


# pid -> (owner, process): which loader ("training" / "evaluation") a worker belongs to, for
# the message below (torch names only the pid). Filled when a stream starts its workers; a
# worker that has since ended cleanly (exit code 0: its stream shut it down) is dropped then,
# or non-persistent workers (new ones every epoch) would pile up. One that died keeps its
# entry: its error may be reported after another stream started.
_OWNERS: dict[int, tuple[str, object]] = {}

# torch's wordings: "DataLoader worker (pid 123) is killed by signal: Killed." and
# "DataLoader worker (pid(s) 123, 456) exited unexpectedly".
_DIED = re.compile(r"DataLoader worker \(pids?\(?s?\)? ([\d, ]+)\) "
                   r"(?:is killed by signal: ([^.]+)|exited unexpectedly)")  # fmt: skip


def register_workers(it, owner: str) -> None:
    """Remember which loader the workers of DataLoader iterator `it` serve (and forget the
    workers that have exited cleanly since)."""
    for pid, (_, process) in list(_OWNERS.items()):
        # the status its stream's shutdown collected (join), not `exitcode`, which would
        # collect a dead worker's status itself before torch's SIGCHLD check could see it
        if getattr(getattr(process, "_popen", None), "returncode", None) == 0:
            del _OWNERS[pid]
    for process in stuck_worker(it)[0]:
        if process.pid is not None:
            _OWNERS[process.pid] = (owner, process)


def dead_worker_error(exc: BaseException) -> LoaderWorkerDied | None:
    """The clear error for torch's "DataLoader worker (pid N) is killed by signal" /
    "exited unexpectedly" RuntimeError: which loader, what usually kills a worker and what to
    do; None for any other error."""
    found = _DIED.search(str(exc)) if isinstance(exc, RuntimeError) else None
    if found is None:
        return None
    pids = [int(p) for p in found.group(1).replace(",", " ").split()]
    owners = sorted({_OWNERS.get(p, ("",))[0] for p in pids} - {""})
    whose = f"the {' and '.join(owners)} loader's" if owners else "a DataLoader"
    how = (
        f"was killed by signal {found.group(2).strip()}"
        if found.group(2)
        else "exited unexpectedly"
    )
    if found.group(2) and "bus" in found.group(2).lower():
        likely = ("a full /dev/shm (in Docker: docker run --shm-size=8g; `python -m "
                  "fastload.doctor env` checks it), or fewer loader.num_workers / a lower "
                  "loader.prefetch_factor; with storage=lmdb or shards, a damaged pack "
                  "(python -m fastload.pack verify <pack>)")  # fmt: skip
    else:
        likely = ("the kernel's OOM killer (see `dmesg | grep -i -E 'killed process|out of "
                  "memory'`): use fewer loader.num_workers, a smaller trainer.batch_size or "
                  "loader.prefetch_factor; else a crash in a native decoder (backend=pil "
                  "tells), or someone killed it")  # fmt: skip
    pid_text = ", ".join(str(p) for p in pids)
    return LoaderWorkerDied(f"{whose} worker (pid {pid_text}) {how}. The most likely cause: "
                            f"{likely}. resume=auto continues from the newest "
                            f"checkpoint.")  # fmt: skip
