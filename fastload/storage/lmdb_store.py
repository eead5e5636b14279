"""storage=lmdb: one LMDB environment per split, key = index, value = target + image bytes.

Written by `python -m fastload.pack lmdb SRC DST` into DST/<split>/ (data.mdb):

    b"%010d" % i   -> header (<q target, <I crc32 of the image bytes) + the image bytes
                      (encoded, or a raw pixel record: kind=raw, fastload/data/rawimage.py)
    b"%010d.boxes" -> (sources with boxes: COCO) <I crc32 of the rest | <I n | n x 4 float32
                      boxes x, y, w, h (pixels of the stored image) | n int64 category ids
    b"%010d.pair"  -> (paired sources: DIV2K LR) <I crc32 | the paired image's bytes
    b"__meta__"    -> JSON: format, version, count, classes, params, checksum (crc32 of all
                      image bytes in index order), source
    (compression lz4, storage.compression: the image and pair bytes are an lz4 block each,
    the crc32s are those of the decompressed bytes; meta says "compression")
    b"__targets__" -> the int64 targets, raw little-endian (so opening needs no full scan)
    b"__paths__"   -> the source path of each record, newline-separated (errors only)

`python -m fastload.pack verify DST` checks every record's crc32 and the overall checksum
(`verify_split`). No pickle anywhere. The writer grows the map size by doubling whenever LMDB reports it full,
so nobody guesses a map size up front. Readers open the environment lazily in their own
process (readonly, lock=False, readahead=False) and drop it when pickled: an LMDB handle
must never cross a fork (vision#689, pytorch#11929).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
import zlib
from pathlib import Path

import numpy as np

from fastload.errors import StorageError
from fastload.storage.base import PackedReader
from fastload.storage.packing import KINDS, PackedStorage

log = logging.getLogger("fastload")

FORMAT = "fastload-lmdb"
VERSION = 1
HEADER = struct.Struct("<qI")
META_KEY, TARGETS_KEY, PATHS_KEY = b"__meta__", b"__targets__", b"__paths__"


def _lmdb():
    try:
        import lmdb
    except ImportError:
        raise StorageError(
            "storage=lmdb needs the lmdb package: pip install lmdb (or pip install -e .)"
        ) from None
    return lmdb


# One read-only environment per pack folder and process: LMDB forbids opening the same files
# twice in a process. An entry inherited through fork belongs to the parent: the child
# closes its copy (its own fds and mapping, the parent's stay open) and opens its own.
_ENVS: dict[str, tuple[int, object]] = {}


def reader_env(path: str):
    pid = os.getpid()
    hit = _ENVS.get(path)
    if hit is not None and hit[0] == pid:
        return hit[1]
    if hit is not None:
        try:
            hit[1].close()
        except Exception:  # noqa: BLE001  (best effort on an inherited handle)
            pass
    lmdb = _lmdb()
    try:
        env = lmdb.open(
            path,
            readonly=True,
            lock=False,
            readahead=False,
            meminit=False,
            subdir=True,
            max_readers=1024,
        )
    except lmdb.Error as exc:  # a damaged meta page: MDB_INVALID, a version mismatch, ...
        raise StorageError(
            f"the LMDB pack {path} cannot be opened ({type(exc).__name__}: {exc}): it is "
            f"damaged or not an LMDB. {REPACK.format(path=path)}"
        ) from None
    check_not_truncated(env, path)
    _ENVS[path] = (pid, env)
    return env


REPACK = (
    "Delete {path} and run again (storage.auto_pack re-packs it), or re-pack it with "
    "python -m fastload.pack lmdb SRC DST."
)


def check_not_truncated(env, path: str) -> None:
    """data.mdb must hold every page its header counts: LMDB maps the file and trusts its
    header, so a record on a page past the end of a truncated file kills the process with
    SIGBUS (no message, no traceback) on first touch."""
    need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    data = os.path.join(path, "data.mdb")
    have = os.path.getsize(data)
    if have < need:
        env.close()
        raise StorageError(
            f"the LMDB pack file {data} is truncated: {have:,} bytes, its header counts "
            f"{need:,} (a copy or download cut short, or a full disk). {REPACK.format(path=path)}"
        )


def key(i: int) -> bytes:
    return b"%010d" % i


COMPRESSIONS = (None, "lz4")


def compress(data: bytes, compression: str | None) -> bytes:
    """A value's stored bytes: lz4 block (its size in front) or the bytes as they are."""
    if compression is None:
        return data
    import lz4.block

    return lz4.block.compress(data, store_size=True)


def decompress(value, compression: str | None):
    """The record bytes of a stored value (a pack's meta["compression"]); a damaged lz4
    block raises StorageError from the caller's describe()."""
    if compression is None:
        return value
    import lz4.block

    return lz4.block.decompress(value)


CRC, COUNT = struct.Struct("<I"), struct.Struct("<I")


def encode_boxes(boxes, labels) -> bytes:
    boxes = np.asarray(boxes, "<f4").reshape(-1, 4)
    labels = np.zeros(len(boxes), "<i8") if labels is None else np.asarray(labels, "<i8")
    if labels.shape != (len(boxes),):
        raise ValueError(f"{len(boxes)} boxes but labels of shape {labels.shape}")
    body = COUNT.pack(len(boxes)) + boxes.tobytes() + labels.tobytes()
    return CRC.pack(zlib.crc32(body)) + body


def decode_boxes(value: bytes) -> tuple[np.ndarray, np.ndarray, bool]:
    """(boxes (n, 4) float32, labels (n,) int64, crc ok)."""
    (crc,) = CRC.unpack_from(value)
    body = memoryview(value)[CRC.size :]
    (n,) = COUNT.unpack_from(body)
    boxes = np.frombuffer(body, "<f4", 4 * n, COUNT.size).reshape(n, 4).astype(np.float32)
    labels = np.frombuffer(body, "<i8", n, COUNT.size + 16 * n).astype(np.int64)
    ok = zlib.crc32(body) == crc and len(body) == COUNT.size + 24 * n
    return boxes, labels, ok


class LmdbWriter:
    """Writes records in transactions of `batch` records; on MapFullError the transaction is
    aborted, the map doubled, and the same records written again."""

    def __init__(
        self, out_dir, initial_map_size: int = 64 << 20, batch: int = 256, compression=None
    ):
        lmdb = _lmdb()
        # lz4: each value compressed (the crc32s stay those of the record bytes, so reads
        # and `verify` check what the decoder gets); the SR recipe's LMDB of pixel arrays.
        self.compression = compression
        self.record_bytes = self.stored_bytes = 0
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.map_size = int(initial_map_size)
        self.env = lmdb.open(
            str(self.dir),
            map_size=self.map_size,
            subdir=True,
            lock=True,
            readahead=False,
            meminit=False,
            map_async=True,
        )
        self.batch = int(batch)
        self.pending: list[tuple[bytes, bytes]] = []
        self.targets: list[int] = []
        self.paths: list[str] = []
        self.crc = 0
        self.growths = 0
        self.has_boxes = self.has_pairs = False

    def add(
        self,
        data: bytes,
        target: int,
        *,
        height: int = 0,
        width: int = 0,
        path: str = "",
        boxes=None,
        labels=None,
        pair: bytes | None = None,
        pair_hw=(0, 0),
    ) -> None:
        """One record (sizes are not stored: LMDB values are decoded like files)."""
        i = len(self.targets)
        stored = compress(data, self.compression)
        self.pending.append((key(i), HEADER.pack(int(target), zlib.crc32(data)) + stored))
        self.record_bytes += len(data) + (len(pair) if pair is not None else 0)
        self.stored_bytes += len(stored)
        if boxes is not None:
            self.has_boxes = True
            self.pending.append((key(i) + b".boxes", encode_boxes(boxes, labels)))
        if pair is not None:
            self.has_pairs = True
            stored_pair = compress(pair, self.compression)
            self.stored_bytes += len(stored_pair)
            self.pending.append((key(i) + b".pair", CRC.pack(zlib.crc32(pair)) + stored_pair))
        self.targets.append(int(target))
        self.paths.append(path)
        self.crc = zlib.crc32(data, self.crc)
        if len(self.pending) >= self.batch:
            self.flush()

    def _put_all(self, items) -> None:
        lmdb = _lmdb()
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    for k, v in items:
                        txn.put(k, v)
                return
            except lmdb.MapFullError:
                self.map_size *= 2
                self.growths += 1
                self.env.set_mapsize(self.map_size)
                log.debug("LMDB map full: grew to %d MB", self.map_size >> 20)

    def flush(self) -> None:
        if self.pending:
            self._put_all(self.pending)
            self.pending = []

    def close(self, *, classes, params: dict, source: str = "") -> dict:
        self.flush()
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "count": len(self.targets),
            "classes": list(classes),
            "params": params,
            "checksum": f"crc32:{self.crc:08x}",
            "source": source,
            "map_size": self.map_size,
            "map_growths": self.growths,
            "boxes": self.has_boxes,
            "pairs": self.has_pairs,
            "compression": self.compression,
            "record_bytes": self.record_bytes,  # before compression (images and pairs)
            "stored_bytes": self.stored_bytes,  # as stored
        }
        # Metadata last: an environment without it is not a complete pack.
        self._put_all(
            [
                (TARGETS_KEY, np.asarray(self.targets, "<i8").tobytes()),
                (PATHS_KEY, "\n".join(self.paths).encode()),
                (META_KEY, json.dumps(meta).encode()),
            ]
        )
        self.env.sync(True)
        self.env.close()
        return meta


class LmdbReader(PackedReader):
    """`(bytes, target)` from one split's LMDB; the environment opens on first read."""

    _unpicklable = ("_txn",)

    def __init__(self, split_dir, verify: bool = True, cold_cache: bool = False):
        self.dir = Path(split_dir)
        self.verify = bool(verify)
        self.cold_cache = bool(cold_cache)
        self._txn = None
        self._txn_pid = None
        raw_meta = self._get(META_KEY)
        if raw_meta is None:
            raise StorageError(
                f"{self.dir} has no {META_KEY.decode()} record: the pack is incomplete "
                f"(interrupted?). Delete {self.dir} and re-pack."
            )
        try:
            self.meta = json.loads(raw_meta)
        except ValueError:
            self.meta = {}
        if self.meta.get("format") != FORMAT or self.meta.get("version") != VERSION:
            raise StorageError(f"{self.dir} is not a {FORMAT} v{VERSION} pack; re-pack it.")
        self._targets = np.frombuffer(self._get(TARGETS_KEY) or b"", "<i8").astype(np.int64)
        if len(self._targets) != self.meta.get("count", len(self._targets)):
            raise StorageError(
                f"{self.dir}: {len(self._targets)} targets for {self.meta.get('count')} records: "
                f"the pack is damaged. {REPACK.format(path=self.dir)}"
            )
        self.compression = self.meta.get("compression")
        self._init_stats()

    def _begin(self):
        """This process's read transaction (opened on first use, reopened after a fork)."""
        if self._txn is None or self._txn_pid != os.getpid():
            self._txn = reader_env(str(self.dir)).begin(buffers=False)
            self._txn_pid = os.getpid()
        return self._txn

    def describe(self, i: int) -> str:
        paths = (self._get(PATHS_KEY) or b"").decode("utf-8", "replace").split("\n")
        src = f", packed from {paths[i]}" if i < len(paths) and paths[i] else ""
        return f"{self.dir} key {key(i).decode()}{src}"

    def _get(self, k: bytes):
        """txn.get, with LMDB's errors on damaged pages (MDB_CORRUPTED, MDB_PAGE_NOTFOUND)
        named with the pack and the fix."""
        try:
            return self._begin().get(k)
        except _lmdb().Error as exc:
            raise StorageError(
                f"the LMDB pack {self.dir} is damaged ({type(exc).__name__}: {exc} reading key "
                f"{k.decode()}). {REPACK.format(path=self.dir)}"
            ) from None

    def read(self, i: int) -> tuple[bytes, int]:
        t0 = time.perf_counter()
        value = self._get(key(i))
        if value is None:
            raise StorageError(f"{self.describe(i)} is missing from the LMDB pack; re-pack it.")
        self._account(len(value), t0)
        target, crc = HEADER.unpack_from(value)
        data = self._unpack(value[HEADER.size :], i)
        if self.verify and zlib.crc32(data) != crc:
            raise StorageError(
                f"corrupt record: {self.describe(i)} fails its crc32 check; re-pack."
            )
        return data, target

    def _unpack(self, stored, i: int, what: str = "record"):
        try:
            return decompress(stored, self.compression)
        except Exception as exc:  # lz4's error on a damaged block
            raise StorageError(
                f"corrupt {what}: {self.describe(i)} is not a valid {self.compression} block "
                f"({exc}); re-pack."
            ) from None

    def boxes(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Record i's boxes (n, 4) float32 x, y, w, h and category ids (n,) int64; n = 0
        when it has none (or the pack has no boxes)."""
        value = self._get(key(i) + b".boxes")
        if value is None:
            return np.zeros((0, 4), np.float32), np.zeros(0, np.int64)
        boxes, labels, ok = decode_boxes(value)
        if self.verify and not ok:
            raise StorageError(f"corrupt boxes of {self.describe(i)} (crc32/length); re-pack.")
        return boxes, labels

    @property
    def has_pairs(self) -> bool:
        return bool(self.meta.get("pairs"))

    def read_pair(self, i: int) -> bytes:
        """The paired record of record i (DIV2K: the LR image), crc-checked like `read`."""
        value = self._get(key(i) + b".pair")
        if value is None:
            raise StorageError(
                f"{self.describe(i)} has no paired record; pack the source with pairs "
                f"(python -m fastload.pack lmdb DST --source div2k --hr .. --lr .. --scale S)."
            )
        (crc,) = CRC.unpack_from(value)
        data = self._unpack(value[CRC.size :], i, "paired record")
        if self.verify and zlib.crc32(data) != crc:
            raise StorageError(f"corrupt paired record of {self.describe(i)}; re-pack.")
        return data

    def store_root(self) -> str:
        return str(self.dir)

    def store_files(self) -> list[str]:
        return [str(self.dir / "data.mdb")]


class LmdbStorage(PackedStorage):
    """storage=lmdb: one LMDB environment per split (python -m fastload.pack lmdb)."""

    format, marker, name = "lmdb", "data.mdb", "lmdb"

    def __init__(
        self,
        path=None,
        max_side=None,
        quality=90,
        verify=True,
        auto_pack=True,
        cold_cache=False,
        initial_map_size: int = 64 << 20,
        kind: str = "jpeg",
        size: int | None = None,
        compression: str | None = None,
    ):
        super().__init__(path=path, verify=verify, auto_pack=auto_pack, cold_cache=cold_cache)
        if kind not in KINDS or compression not in COMPRESSIONS:
            raise StorageError(
                f"storage.kind={kind!r}, storage.compression={compression!r}: use kind "
                f"{' or '.join(KINDS)} and compression null or lz4."
            )
        self.max_side, self.quality = max_side, int(quality)
        self.kind, self.size, self.compression = kind, size, compression
        self.initial_map_size = int(initial_map_size)

    def default_path(self, root) -> str:
        if self.kind == "raw":
            tag = f"raw-{self.size}px" if self.size else "raw-full"
        else:
            tag = f"{self.max_side}px-q{self.quality}" if self.max_side else "orig"
        lz = f"-{self.compression}" if self.compression else ""
        return f"{str(root).rstrip('/')}.packs/lmdb-{tag}{lz}"

    def writer(self, folder: Path) -> LmdbWriter:
        return LmdbWriter(
            folder, initial_map_size=self.initial_map_size, compression=self.compression
        )

    def reader(self, split_dir: Path) -> LmdbReader:
        return LmdbReader(split_dir, verify=self.verify, cold_cache=self.cold_cache)

    def pack_options(self) -> dict:
        opts = {"kind": self.kind, "quality": self.quality, "compression": self.compression}
        if self.kind == "raw":
            return {**opts, "size": self.size}
        return {**opts, "max_side": self.max_side}

    def cli_options(self) -> list[str]:
        opts = ["--compression", self.compression] if self.compression else []
        if self.kind == "raw":
            return ["--kind", "raw", "--size", str(self.size or "full"), *opts]
        if self.max_side:
            opts += ["--max-side", str(self.max_side), "--quality", str(self.quality)]
        return opts


def _unpacked(stored, compression) -> bytes | None:
    """`decompress`, None for a block that does not decompress (verify reports it)."""
    try:
        return decompress(stored, compression)
    except Exception:  # lz4's error on a damaged block
        return None


def _check_record(txn, i: int, targets, compression=None) -> tuple[bytes | None, list[str]]:
    """Record i's image bytes (None when missing) and what is wrong with it, its boxes or its
    paired record (each with its own crc32, over the decompressed bytes)."""
    value = txn.get(key(i))
    if value is None:
        return None, ["missing"]
    bad = []
    target, crc = HEADER.unpack_from(value)
    data = _unpacked(value[HEADER.size :], compression)
    if data is None:
        bad.append(f"not a valid {compression} block")
    elif zlib.crc32(data) != crc:
        bad.append("crc32")
    if targets is not None and i < len(targets) and targets[i] != target:
        bad.append(f"target {target} vs {int(targets[i])} in {TARGETS_KEY.decode()}")
    boxes = txn.get(key(i) + b".boxes")
    if boxes is not None:
        try:
            ok = decode_boxes(boxes)[2]
        except (struct.error, ValueError):
            ok = False
        if not ok:
            bad.append("boxes crc32/length")
    return data, bad


def _check_pair(txn, i: int, compression=None) -> list[str]:
    value = txn.get(key(i) + b".pair")
    if value is None:
        return ["paired record missing"]
    (crc,) = CRC.unpack_from(value)
    data = _unpacked(value[CRC.size :], compression)
    return [] if data is not None and zlib.crc32(data) == crc else ["paired record crc32"]


def _read_meta(txn, split_dir: Path) -> tuple[dict | None, list[str]]:
    raw = txn.get(META_KEY)
    if raw is None:
        return None, [
            f"{split_dir} has no {META_KEY.decode()} record: the pack is incomplete "
            f"(interrupted?); delete {split_dir} and re-pack."
        ]
    try:
        meta = json.loads(raw)
    except ValueError as exc:
        return None, [f"{split_dir}: its {META_KEY.decode()} record is damaged ({exc}); re-pack."]
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        says = f"{meta.get('format')} v{meta.get('version')}"
        return None, [f"{split_dir} is not a {FORMAT} v{VERSION} pack (it says {says})."]
    return meta, []


def verify_split(split_dir) -> tuple[int, list[str]]:
    """`python -m fastload.pack verify` for one split of an LMDB pack: every record's crc32
    (its header), its boxes' and paired record's own crc32, the targets, and the meta's
    overall checksum (crc32 of all image bytes in index order). Returns (records checked,
    problems)."""
    split_dir = Path(split_dir)
    try:
        env = reader_env(str(split_dir))
        return _verify_records(env, split_dir)
    except StorageError as exc:
        return 0, [exc.user_message]
    except _lmdb().Error as exc:  # damaged B-tree pages: MDB_CORRUPTED, MDB_PAGE_NOTFOUND
        return 0, [f"{split_dir / 'data.mdb'} is damaged ({type(exc).__name__}: {exc}); re-pack."]


def _verify_records(env, split_dir: Path) -> tuple[int, list[str]]:
    with env.begin(buffers=False) as txn:
        meta, problems = _read_meta(txn, split_dir)
        if meta is None:
            return 0, problems
        count = int(meta["count"])
        raw_targets = txn.get(TARGETS_KEY)
        targets = None if raw_targets is None else np.frombuffer(raw_targets, "<i8")
        if targets is None or len(targets) != count:
            have = "none" if targets is None else len(targets)
            problems.append(f"{split_dir}: {have} targets for {count} records; re-pack.")
        paths = (txn.get(PATHS_KEY) or b"").decode().split("\n")
        crc, bad = 0, []
        for i in range(count):
            data, wrong = _check_record(txn, i, targets, meta.get("compression"))
            if data is not None:
                crc = zlib.crc32(data, crc)
            if meta.get("pairs"):
                wrong += _check_pair(txn, i, meta.get("compression"))
            if wrong:
                src = f", {paths[i]}" if i < len(paths) and paths[i] else ""
                bad.append(f"key {key(i).decode()} ({'; '.join(wrong)}{src})")
    if bad:
        more = f", ... ({len(bad)} in all)" if len(bad) > 5 else ""
        problems.append(f"{split_dir / 'data.mdb'}: damaged records: {', '.join(bad[:5])}{more}")
    if f"crc32:{crc:08x}" != meta.get("checksum"):
        problems.append(
            f"{split_dir / 'data.mdb'}: the image bytes' crc32 is {crc:08x}, the pack's "
            f"checksum {str(meta.get('checksum')).removeprefix('crc32:')}; re-pack."
        )
    return count, problems
