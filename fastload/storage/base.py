"""What every storage shares: read accounting across DataLoader workers, cold-cache eviction,
and the factory hooks the engine calls (`prepare` once per node, `finish` at the end).

Read accounting: each process (main = slot 0, worker k = slot k + 1) adds its own bytes and
seconds to its own row of a small shared-memory tensor, so no lock is needed and the main
process can sum the rows after an epoch. The tensor crosses fork and spawn like any shared
torch tensor; file handles and mmaps do not cross at all (see `__getstate__` of each store).
"""

from __future__ import annotations

import abc
import functools
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("fastload")

_SLOTS = 256
_warned_tmpfs: set[str] = set()


def call_hook(factory, name: str, **kwargs):
    """Call an optional hook of a storage factory: `factory.<name>(**kwargs)` for an object,
    or, for the `functools.partial` that `_partial_: true` builds, the class's classmethod
    with the config's keywords added. Returns None when the storage has no such hook."""
    if isinstance(factory, functools.partial):
        hook = getattr(factory.func, name, None)
        return None if hook is None else hook(**{**factory.keywords, **kwargs})
    hook = getattr(factory, name, None)
    return None if hook is None else hook(**kwargs)


def fs_type(path: str | os.PathLike) -> str:
    """The file system type of the mount holding `path` (longest /proc/mounts prefix)."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def evict_page_cache(paths) -> int:
    """posix_fadvise(DONTNEED) over each file: drops its clean pages from the page cache
    (no root needed). Pages still mapped by a live process (persistent workers' mmaps) stay.
    Returns the number of bytes advised."""
    total = 0
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


class StoreBase(abc.ABC):
    """Mixin: read accounting + `before_epoch()` / `epoch_stats()` for the engine.

    A subclass sets `self.cold_cache`, implements `store_files()` (what to evict) and
    `store_root()` (for the tmpfs check), and wraps its reads in `self._account(n, t0)`.
    """

    cold_cache: bool = False

    def _init_stats(self) -> None:
        self._stats = torch.zeros(_SLOTS, 2, dtype=torch.float64).share_memory_()
        self._stats_np = None

    def _account(self, nbytes: int, t0: float) -> None:
        if self._stats_np is None:
            info = torch.utils.data.get_worker_info()
            slot = 0 if info is None else (info.id + 1) % _SLOTS
            self._stats_np = self._stats.numpy()[slot]
        row = self._stats_np
        row[0] += nbytes
        row[1] += time.perf_counter() - t0

    @abc.abstractmethod
    def store_files(self) -> list[str]:
        """Every file of this store (what cold_cache evicts)."""

    @abc.abstractmethod
    def store_root(self) -> str:
        """The folder the store lives in (tmpfs detection)."""

    def before_epoch(self) -> None:
        """Reset the read counters; with cold_cache, evict the store's files first."""
        if self.cold_cache:
            root = self.store_root()
            kind = fs_type(root)
            if kind in ("tmpfs", "ramfs"):
                if root not in _warned_tmpfs:
                    _warned_tmpfs.add(root)
                    log.warning(
                        "storage.cold_cache=true: %s is on %s, where the data IS the page "
                        "cache; nothing can be evicted, so this epoch reads from RAM.",
                        root,
                        kind,
                    )
            else:
                t0 = time.perf_counter()
                n = evict_page_cache(self.store_files())
                log.info(
                    "cold cache: evicted %.1f MB of %s from the page cache in %.2f s",
                    n / 1e6,
                    root,
                    time.perf_counter() - t0,
                )
        self._stats.zero_()

    def epoch_stats(self) -> dict:
        """Bytes read since `before_epoch()` and the time spent inside reads (summed over
        workers): read_mb_per_s is the bandwidth one reader saw."""
        nbytes, seconds = self._stats.sum(0).tolist()
        return {
            "read_mb": nbytes / 1e6,
            "read_s": seconds,
            "read_mb_per_s": nbytes / 1e6 / seconds if seconds > 0 else None,
            "cold_cache": bool(self.cold_cache),
        }

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_stats_np"] = None
        for key in getattr(self, "_unpicklable", ()):
            state[key] = None
        return state


class PackedStore(StoreBase):
    """The storage contract of a packed store (LMDB, shards): targets held in `_targets`,
    class names in the pack's metadata `meta["classes"]`."""

    meta: dict
    _targets: np.ndarray

    def __len__(self) -> int:
        return len(self._targets)

    @property
    def classes(self) -> tuple[str, ...]:
        return tuple(self.meta["classes"])

    @property
    def targets(self) -> np.ndarray:
        return self._targets

    @staticmethod
    def pack_missing(fmt: str, root, pack_root: Path, splits, marker: str, **options) -> None:
        """The engine's `prepare` with auto_pack: pack each split of ROOT whose pack under
        pack_root lacks `marker` (the file a pack writes last), with `python -m fastload.pack
        <fmt>`'s options."""
        from fastload.pack import pack_split

        for split in dict.fromkeys(splits):
            if (pack_root / split / marker).is_file():
                continue
            t0 = time.perf_counter()
            pack_split(fmt, Path(root) / split, pack_root / split, **options)
            log.info(
                "packed %s/%s into %s in %.1f s",
                root,
                split,
                pack_root / split,
                time.perf_counter() - t0,
            )


def dir_files(root: str | os.PathLike) -> list[str]:
    """Every regular file under root (for eviction)."""
    out = []
    for dirpath, _, names in os.walk(root):
        out.extend(os.path.join(dirpath, n) for n in names)
    return out


def du_bytes(root: str | os.PathLike) -> tuple[int, int]:
    """(apparent bytes, allocated bytes) of everything under root."""
    apparent = allocated = 0
    for p in dir_files(root) if Path(root).is_dir() else [str(root)]:
        st = os.stat(p)
        apparent += st.st_size
        allocated += st.st_blocks * 512
    return apparent, allocated
