"""The storage stage's contract: where the bytes of a sample come from. Storage never decodes.

Two objects per storage option (one module + one yaml each):

* a `Storage`, built by conf/storage/<name>.yaml with its settings, held by the engine:
    `prepare(root, splits)`  once per node (local rank 0) before training; the other ranks
                             wait at a barrier (stage to tmpfs, pack a missing split, ...);
    `open(root, split)`      -> the split's `Reader`;
    `finish(root, splits)`   once per node at the end (e.g. remove a tmpfs staging);
* a `Reader`, one per split, handed to the dataset and pickled into every DataLoader worker:
    `len()`, `schema` (the record's named fields, fastload/data/records.py),
    `get(i, name)` (one field of record i), `column(name)` (an int field of every record),
    `describe(i, name)` (where record i or its field lives, for errors), `classes`, and for
    cold-cache runs `store_files()` / `store_root()`. A reader knows codecs, not tasks: the
    dataset asks for the fields it needs by name.

Read accounting (`Reader`): each process (main = slot 0, worker k = slot k + 1) adds its own
bytes and seconds to its own row of a small shared-memory tensor, so no lock is needed and
the main process sums the rows after an epoch. The tensor crosses fork and spawn like any
shared torch tensor; file handles and mmaps never cross (each reader's `_unpicklable`).
"""

from __future__ import annotations

import abc
import json
import logging
import os
import time
from pathlib import Path

import numpy as np

from fastload.atomic import folder_id
from fastload.data.records import Schema
from fastload.errors import StorageError
from fastload.host import Need, fs_type

log = logging.getLogger("fastload")

_SLOTS = 256
DATASET_FS = "dataset file system"  # the pre-flight check a storage's `needs` go under
_warned_tmpfs: set[str] = set()


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


class Reader(abc.ABC):
    """One split of a store: the named fields of each record, plus read accounting and
    cold-cache eviction for the engine (`before_epoch()` / `epoch_stats()`).

    A subclass sets `schema`, calls `_init_stats()` in its constructor, sets `cold_cache`,
    and wraps its reads in `self._account(nbytes, t0)`.

    Reads are counted per epoch: a dataset sets `epoch` to the epoch of the samples it
    reads (the loader's keys carry it), so that the next epoch's first batches, which the
    workers read while this epoch ends and evaluates (loader.cross_epoch), count in the next
    epoch's row (`epoch_stats(epoch)`), not in this one's."""

    cold_cache: bool = False
    epoch: int = 0  # the epoch of the samples being read (set by the dataset)
    schema: Schema
    _unpicklable: tuple[str, ...] = ()

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def get(self, i: int, name: str):
        """Field `name` of record i, decoded by its codec (an image field: bytes, or a
        read-only memoryview for raw pixels)."""

    @abc.abstractmethod
    def column(self, name: str) -> np.ndarray:
        """The int64 values of int field `name` for every record (no record is read)."""

    def nonempty(self, name: str) -> np.ndarray | None:
        """Whether array field `name` of each record holds any element (bool per record),
        where the store knows it without reading every record (a source's arrays, a pack's
        index or manifest); None where it does not: the caller reads the records (`get`)."""
        self.field(name)
        return None

    @abc.abstractmethod
    def describe(self, i: int, name: str | None = None) -> str:
        """Where record i (its field `name`) lives (file, record), for error messages."""

    @property
    @abc.abstractmethod
    def classes(self) -> tuple[str, ...]: ...

    @abc.abstractmethod
    def store_files(self) -> list[str]:
        """Every file of this split (what cold_cache evicts)."""

    @abc.abstractmethod
    def store_root(self) -> str:
        """The folder the split lives in (tmpfs detection)."""

    def identity(self) -> tuple[str, list]:
        """What names this split's records, in order, as far as the reader knows without
        reading any (no file is opened or stat'ed): (what kind of names they are, the names:
        strings or numpy arrays). `fastload.agreement.split_fingerprint` hashes them with
        the length, classes, schema and int columns. The kind keeps apart what cannot be
        compared: a folder's file names and a pack's checksums."""
        return type(self).__name__, []

    def has(self, name: str) -> bool:
        """Whether the records hold field `name`."""
        return name in self.schema

    def field(self, name: str):
        """The schema's field `name`; StorageError naming the store and its fields."""
        if name not in self.schema:
            raise StorageError(
                f"{self.store_root()} holds no field {name!r} (its records have "
                f"{', '.join(self.schema.names)}): it was written for another kind of data, "
                f"or packed from a source without it; re-pack it from this dataset."
            )
        return self.schema[name]

    def decode_field(self, field, data, i: int, name: str):
        """Field `name` of record i from its stored bytes; StorageError naming the record."""
        try:
            return field.coder.decode(data)
        except ValueError as exc:
            raise StorageError(f"unreadable {self.describe(i, name)}: {exc}; re-pack.") from None

    # -- accounting ----------------------------------------------------------------------

    def _init_stats(self) -> None:
        import torch  # here, not at the top: packing's pool workers import this module

        # [reading process, epoch parity, (bytes, seconds)]: two epochs in flight at most
        self._stats = torch.zeros(_SLOTS, 2, 2, dtype=torch.float64).share_memory_()
        self._stats_np = None

    def _account(self, nbytes: int, t0: float) -> None:
        if self._stats_np is None:
            import torch.utils.data

            info = torch.utils.data.get_worker_info()
            slot = 0 if info is None else (info.id + 1) % _SLOTS
            self._stats_np = self._stats.numpy()[slot]
        row = self._stats_np[self.epoch & 1]
        row[0] += nbytes
        row[1] += time.perf_counter() - t0

    def before_epoch(self, reset: bool = True, evict: bool = True) -> None:
        """Reset the read counters (reset=False: keep them; the reads of an epoch the
        workers began early stay its own); with cold_cache, evict the split's files first
        (evict=False: another rank of this node does)."""
        if self.cold_cache and evict:
            self._evict()
        if reset:
            self.reset_stats()

    def reset_stats(self) -> None:
        """Clear the read counters of every epoch (a pass measured on its own)."""
        self._stats.zero_()

    def _evict(self) -> None:
        root = self.store_root()
        kind = fs_type(root)
        if kind in ("tmpfs", "ramfs"):
            if root not in _warned_tmpfs:
                _warned_tmpfs.add(root)
                log.warning(
                    "storage.cold_cache=true: %s is on %s, where the data IS the page cache; "
                    "nothing can be evicted, so this epoch reads from RAM.",
                    root,
                    kind,
                )
            return
        t0 = time.perf_counter()
        n = evict_page_cache(self.store_files())
        log.info(
            "cold cache: evicted %.1f MB of %s from the page cache in %.2f s",
            n / 1e6,
            root,
            time.perf_counter() - t0,
        )

    def epoch_stats(self, epoch: int | None = None) -> dict:
        """Bytes read since `before_epoch()` and the time spent inside reads (summed over
        workers): read_mb_per_s is the bandwidth one reader saw. `epoch`: that epoch's reads
        only, whose counters are then cleared for the epoch after next."""
        if epoch is None:
            nbytes, seconds = self._stats.sum((0, 1)).tolist()
        else:
            nbytes, seconds = self._stats[:, epoch & 1].sum(0).tolist()
            self._stats[:, epoch & 1].zero_()
        return {
            "read_mb": nbytes / 1e6,
            "read_s": seconds,
            "read_mb_per_s": nbytes / 1e6 / seconds if seconds > 0 else None,
            "cold_cache": bool(self.cold_cache),
        }

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_stats_np"] = None
        for key in self._unpicklable:
            state[key] = None
        return state


class Storage(abc.ABC):
    """What conf/storage/<name>.yaml builds: the store's settings and its once-per-node steps."""

    def needs(self, dataset_fs: str) -> list[Need]:
        """What this storage needs of the machine, for the pre-flight (fastload/preflight.py):
        its "dataset file system" lines given the dataset root's file system type
        (`fs_type`); none by default (a store that copies or packs the root reads it once)."""
        return []

    def prepare(
        self, root: str | os.PathLike, splits: list[str], skip_corrupt: bool = False
    ) -> None:
        """Once per node, before any `open`: make the splits readable (default: nothing).
        `skip_corrupt` (dataset.skip_corrupt): a store that decodes while preparing (a
        re-encoding pack) leaves undecodable files out instead of stopping."""
        return None

    @abc.abstractmethod
    def open(self, root: str | os.PathLike, split: str) -> Reader:
        """The reader of one split of the dataset at `root`."""

    def finish(self, root: str | os.PathLike, splits: list[str]) -> None:
        """Once per node after training (default: nothing)."""
        return None


class PackedReader(Reader):
    """A packed split (LMDB, shards): its schema, int columns in `_columns`, class names
    in the pack's metadata `meta["classes"]`."""

    meta: dict
    _columns: dict[str, np.ndarray]
    dir: Path
    _pack_id: tuple[int, int] | None = None

    def _bind_pack(self) -> None:
        """Remember which folder this reader indexed: a pack is replaced by renaming a new
        folder into its place (another run re-packing a changed source), and a process that
        opens its files later (a DataLoader worker) must not read that one's records with
        this one's index and labels."""
        try:
            self._pack_id = folder_id(self.dir)
        except OSError:  # not there: opening it says so, naming the pack
            self._pack_id = None

    def _check_same_pack(self) -> None:
        """Called where a process (re)opens the pack's files; raises when it was replaced."""
        try:
            same = self._pack_id is None or folder_id(self.dir) == self._pack_id
        except OSError:
            same = False
        if not same:
            raise StorageError(
                f"the pack {self.dir} was replaced (or removed) while this run reads it: "
                f"another run re-packed it after its source changed, so its records are no "
                f"longer the ones this run indexed. Restart this run (it then trains on the "
                f"new pack), or give concurrent runs their own storage.path."
            )

    def __len__(self) -> int:
        return int(self.meta["count"])

    @property
    def classes(self) -> tuple[str, ...]:
        return tuple(self.meta["classes"])

    def identity(self) -> tuple[str, list]:
        """The pack's record of its content (checksums, counts, how it was packed), not of
        where it lies or was packed from: two nodes' packs of the same data agree."""
        m = self.meta
        what = {k: m.get(k) for k in ("count", "classes", "params", "schema", "checksum",
                                      "column_checks")}  # fmt: skip
        what["shards"] = [(s.get("bytes"), s.get("crc32")) for s in m.get("shards") or []]
        return f"pack:{m.get('format')}", [json.dumps(what, sort_keys=True, default=str)]

    def column(self, name: str) -> np.ndarray:
        if name not in self._columns:
            self.field(name)  # names the fields there are
            raise StorageError(f"field {name!r} of {self.store_root()} is not an int column.")
        return self._columns[name]


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
