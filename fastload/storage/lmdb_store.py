"""storage=lmdb: one LMDB environment per split, one value per field of each record.

Written by `python -m fastload.pack lmdb SRC DST` into DST/<split>/ (data.mdb):

    b"%010d.<field>"    -> <I crc32 of the field's bytes | the bytes, as the field's codec
                           writes them (fastload/data/records.py: an encoded image, a raw
                           pixel record, .npy array, JSON), for every field stored as bytes
    b"__column__.<f>"   -> int field f of every record, int64 little-endian (so opening
                           needs no full scan; checked at open against its crc32)
    b"__meta__"         -> JSON: format, version, schema (the fields and their codecs),
                           count, classes, params, checksum (crc32 of all field bytes in
                           record order), column_checks (crc32 of each __column__ value),
                           source
    (compression lz4, storage.compression: each field's bytes are an lz4 block, the crc32s
    are those of the decompressed bytes; meta says "compression")
    b"__paths__"        -> the source path of each record, newline-separated (errors only)

`python -m fastload.pack verify DST` checks every field's crc32, every column's and the
overall checksum (`verify_split`). Packs of the earlier version (one image and one target per record) are
refused with the re-pack command; storage.auto_pack re-packs them. No pickle anywhere. The writer grows the map size by doubling whenever LMDB reports it full,
so nobody guesses a map size up front. Readers open the environment lazily in their own
process (readonly, lock=False, readahead=False) and drop it when pickled: an LMDB handle
must never cross a fork (vision#689, pytorch#11929).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import struct
import time
import zlib
from pathlib import Path

import numpy as np

from fastload.atomic import folder_id
from fastload.data.records import Schema
from fastload.errors import StorageError
from fastload.storage.base import PackedReader
from fastload.storage.packing import KINDS, PackedStorage, check_pack_numbers, unchecked_note

log = logging.getLogger("fastload")

FORMAT = "fastload-lmdb"
VERSION = 2
CRC = struct.Struct("<I")
META_KEY, PATHS_KEY = b"__meta__", b"__paths__"


def column_key(name: str) -> bytes:
    return b"__column__." + name.encode()


def column_crc(value: bytes) -> str:
    """meta["column_checks"]'s entry for a __column__ value."""
    return f"crc32:{zlib.crc32(value):08x}"


def column_problems(txn, schema: Schema, meta: dict, where: Path) -> tuple[list[str], list]:
    """(problems, unchecked): each int column whose count or crc32 differs from the pack's
    meta, and the columns it has no crc32 of (packs written before columns had one)."""
    checks = meta.get("column_checks") or {}
    problems, unchecked = [], []
    for f in schema.columns:
        raw = txn.get(column_key(f.name))
        have = "none" if raw is None else len(raw) // 8
        if have != meta["count"]:
            problems.append(f"{where}: {have} values of {f.name} for {meta['count']} records")
        elif f.name not in checks:
            unchecked.append(f.name)
        elif column_crc(raw) != checks[f.name]:
            problems.append(
                f"{where}: its {f.name} column fails its crc32 check: its values are not "
                f"the ones packed"
            )
    return problems, unchecked


def field_key(i: int, name: str) -> bytes:
    return b"%010d." % i + name.encode()


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
# A pack replaced in place (re-packed into a new folder renamed over it) is another entry:
# the old environment stays open for the readers that still read it.
_ENVS: dict[str, tuple[int, tuple[int, int], object]] = {}


def reader_env(path: str):
    try:
        pid, folder = os.getpid(), folder_id(path)
    except OSError:  # not there: lmdb.open below names it
        pid, folder = os.getpid(), None
    hit = _ENVS.get(path)
    if hit is not None and hit[:2] == (pid, folder):
        return hit[2]
    if hit is not None and hit[0] != pid:
        try:
            hit[2].close()
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
    _ENVS[path] = (pid, folder, env)
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


COMPRESSIONS = (None, "lz4")


def lz4_block():
    """lz4.block, or the StorageError that names the package to install."""
    try:
        import lz4.block
    except ImportError as exc:
        raise StorageError(
            f"storage.compression=lz4 needs the lz4 package, which does not import here ({exc}). "
            "Install it (pip install lz4; `pip install -e .` installs it with fastload), or "
            "set storage.compression=null."
        ) from None
    return lz4.block


def compress(data: bytes, compression: str | None) -> bytes:
    """A value's stored bytes: lz4 block (its size in front) or the bytes as they are."""
    if compression is None:
        return data
    return lz4_block().compress(data, store_size=True)


def decompress(value, compression: str | None):
    """The record bytes of a stored value (a pack's meta["compression"]); a damaged lz4
    block raises StorageError from the caller's describe()."""
    if compression is None:
        return value
    return lz4_block().decompress(value)


class LmdbWriter:
    """Writes records in transactions of `batch` values; on MapFullError the transaction is
    aborted, the map doubled, and the same values written again."""

    def __init__(
        self, out_dir, schema: Schema, initial_map_size: int = 64 << 20, batch: int = 256,
        compression=None,
    ):  # fmt: skip
        lmdb = _lmdb()
        self.schema = schema
        # lz4: each value compressed (the crc32s stay those of the field bytes, so reads
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
        self.columns: dict[str, list[int]] = {f.name: [] for f in schema.columns}
        self.paths: list[str] = []
        self.crc = 0
        self.growths = 0

    def add(self, values: dict, *, path: str = "") -> None:
        """One record: {field name: value}, every field of the schema."""
        i = len(self.paths)
        for f in self.schema.blobs:
            data = f.coder.encode(values[f.name])
            stored = compress(data, self.compression)
            self.pending.append((field_key(i, f.name), CRC.pack(zlib.crc32(data)) + stored))
            self.record_bytes += len(data)
            self.stored_bytes += len(stored)
            self.crc = zlib.crc32(data, self.crc)
        for f in self.schema.columns:
            self.columns[f.name].append(int(values[f.name]))
        self.paths.append(path)
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
            except lmdb.Error as exc:
                # A full disk reaches LMDB's commit as its own error (an I/O error): said as
                # one, so the pack reports it as every store does (no_space_message).
                if shutil.disk_usage(self.dir).free >= 1 << 20 and "No space" not in str(exc):
                    raise
                raise OSError(
                    errno.ENOSPC, f"No space left on device ({exc})", str(self.dir)
                ) from exc

    def flush(self) -> None:
        if self.pending:
            self._put_all(self.pending)
            self.pending = []

    def close(self, *, classes, params: dict, source: str = "") -> dict:
        self.flush()
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "schema": self.schema.to_json(),
            "count": len(self.paths),
            "classes": list(classes),
            "params": params,
            "checksum": f"crc32:{self.crc:08x}",
            "source": source,
            "map_size": self.map_size,
            "map_growths": self.growths,
            "compression": self.compression,
            "record_bytes": self.record_bytes,  # before compression
            "stored_bytes": self.stored_bytes,  # as stored
        }
        # Metadata last: an environment without it is not a complete pack.
        columns = {n: np.asarray(v, "<i8").tobytes() for n, v in self.columns.items()}
        meta["column_checks"] = {n: column_crc(v) for n, v in columns.items()}
        self._put_all(
            [
                *((column_key(n), v) for n, v in columns.items()),
                (PATHS_KEY, "\n".join(self.paths).encode("utf-8", "surrogateescape")),
                (META_KEY, json.dumps(meta).encode()),
            ]
        )
        self.env.sync(True)
        self.env.close()
        return meta


class LmdbReader(PackedReader):
    """The fields of one split's LMDB; the environment opens on first read."""

    _unpicklable = ("_txn",)

    def __init__(self, split_dir, verify: bool = True, cold_cache: bool = False):
        self.dir = Path(split_dir)
        self.verify = bool(verify)
        self.cold_cache = bool(cold_cache)
        self._txn = None
        self._txn_pid = None
        self._bind_pack()
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
            says = f"{self.meta.get('format')} v{self.meta.get('version')}"
            raise StorageError(
                f"{self.dir} is not a {FORMAT} v{VERSION} pack (it says {says}). "
                f"{REPACK.format(path=self.dir)}"
            )
        self.schema = Schema.from_json(self.meta["schema"])
        self._columns = {}
        checks = self.meta.get("column_checks") or {}
        for f in self.schema.columns:
            raw = self._get(column_key(f.name)) or b""
            values = np.frombuffer(raw, "<i8").astype(np.int64)
            if len(values) != self.meta["count"]:
                raise StorageError(
                    f"{self.dir}: {len(values)} values of field {f.name} for "
                    f"{self.meta['count']} records: the pack is damaged. {REPACK.format(path=self.dir)}"
                )
            if self.verify and f.name in checks and column_crc(raw) != checks[f.name]:
                raise StorageError(
                    f"{self.dir}: its {f.name} column fails its crc32 check: the pack is "
                    f"damaged. {REPACK.format(path=self.dir)}"
                )
            self._columns[f.name] = values
        self._keys = {f.name: (f, b"." + f.name.encode()) for f in self.schema.blobs}
        self.compression = self.meta.get("compression")
        self._init_stats()

    def _begin(self):
        """This process's read transaction (opened on first use, reopened after a fork)."""
        if self._txn is None or self._txn_pid != os.getpid():
            self._check_same_pack()
            self._txn = reader_env(str(self.dir)).begin(buffers=False)
            self._txn_pid = os.getpid()
        return self._txn

    def describe(self, i: int, name: str | None = None) -> str:
        paths = (self._get(PATHS_KEY) or b"").decode("utf-8", "surrogateescape").split("\n")
        src = f", packed from {paths[i]}" if i < len(paths) and paths[i] else ""
        name = name if name in self._keys else self.schema.blobs[0].name
        return f"{self.dir} key {field_key(i, name).decode()}{src}"

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

    def get(self, i: int, name: str):
        if name in self._columns:
            return int(self._columns[name][i])
        t0 = time.perf_counter()
        field, suffix = self._keys.get(name) or (self.field(name),)
        value = self._get(b"%010d" % i + suffix)  # field_key without a per-read encode
        if value is None:
            raise StorageError(f"{self.describe(i, name)} is missing from the LMDB pack; re-pack.")
        self._account(len(value), t0)
        (crc,) = CRC.unpack_from(value)
        try:
            data = decompress(value[CRC.size :], self.compression)
        except Exception as exc:  # lz4's error on a damaged block
            raise StorageError(
                f"corrupt record: {self.describe(i, name)} is not a valid {self.compression} "
                f"block ({exc}); re-pack."
            ) from None
        if self.verify and zlib.crc32(data) != crc:
            raise StorageError(
                f"corrupt record: {self.describe(i, name)} fails its crc32 check; re-pack."
            )
        return self.decode_field(field, data, i, name)

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
        check_pack_numbers(max_side, quality, size)
        if compression == "lz4":
            lz4_block()  # missing: said before any packing starts
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

    def writer(self, folder: Path, schema: Schema) -> LmdbWriter:
        return LmdbWriter(
            folder, schema, initial_map_size=self.initial_map_size, compression=self.compression
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


def _check_field(txn, i: int, name: str, compression=None) -> tuple[bytes | None, str]:
    """Field `name` of record i (None when missing or undecompressable) and what is wrong
    with it ("" when nothing)."""
    value = txn.get(field_key(i, name))
    if value is None:
        return None, f"{name} missing"
    (crc,) = CRC.unpack_from(value)
    data = _unpacked(value[CRC.size :], compression)
    if data is None:
        return None, f"{name} not a valid {compression} block"
    return data, ("" if zlib.crc32(data) == crc else f"{name} crc32")


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


def verify_split(split_dir) -> tuple[int, list[str], list[str]]:
    """`python -m fastload.pack verify` for one split of an LMDB pack: every field's crc32,
    the int columns' lengths and crc32s, and the meta's overall checksum (crc32 of all field
    bytes in record order). Returns (records checked, problems, notes: what could not be
    checked)."""
    split_dir = Path(split_dir)
    try:
        env = reader_env(str(split_dir))
        return _verify_records(env, split_dir)
    except StorageError as exc:
        return 0, [exc.user_message], []
    except _lmdb().Error as exc:  # damaged B-tree pages: MDB_CORRUPTED, MDB_PAGE_NOTFOUND
        return (
            0,
            [f"{split_dir / 'data.mdb'} is damaged ({type(exc).__name__}: {exc}); re-pack."],
            [],
        )


def _verify_records(env, split_dir: Path) -> tuple[int, list[str], list[str]]:
    with env.begin(buffers=False) as txn:
        meta, problems = _read_meta(txn, split_dir)
        if meta is None:
            return 0, problems, []
        count, schema = int(meta["count"]), Schema.from_json(meta["schema"])
        damaged, unchecked = column_problems(txn, schema, meta, split_dir)
        problems += [f"{line}; re-pack." for line in damaged]
        paths = (txn.get(PATHS_KEY) or b"").decode("utf-8", "surrogateescape").split("\n")
        crc, bad = 0, []
        for i in range(count):
            wrong = []
            for f in schema.blobs:
                data, why = _check_field(txn, i, f.name, meta.get("compression"))
                if data is not None:
                    crc = zlib.crc32(data, crc)
                if why:
                    wrong.append(why)
            if wrong:
                src = f", {paths[i]}" if i < len(paths) and paths[i] else ""
                bad.append(f"record {i} ({'; '.join(wrong)}{src})")
    if bad:
        more = f", ... ({len(bad)} in all)" if len(bad) > 5 else ""
        problems.append(f"{split_dir / 'data.mdb'}: damaged records: {', '.join(bad[:5])}{more}")
    if f"crc32:{crc:08x}" != meta.get("checksum"):
        problems.append(
            f"{split_dir / 'data.mdb'}: the field bytes' crc32 is {crc:08x}, the pack's "
            f"checksum {str(meta.get('checksum')).removeprefix('crc32:')}; re-pack."
        )
    return count, problems, unchecked_note(unchecked)
