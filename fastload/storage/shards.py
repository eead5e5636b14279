"""storage=shards: a few large contiguous binary files plus an index, memory-mapped by readers.

Layout of one split (`python -m fastload.pack shards SRC DST` writes DST/<split>/):

    meta.json          format, version, count, classes, pack params, schema (the records'
                       named fields and codecs, fastload/data/records.py), and per shard:
                       file name, size in bytes, crc32 of the whole file
    index.npy          one structured row per record: the shard holding its fields, and
                       per field stored as bytes `<name>.offset`, `<name>.length`,
                       `<name>.check` (xxh3_64 of those bytes); per int field a column
                       `<name>` (int64) (memory-mapped, shared by workers), its xxh3_64
                       in meta.json's `column_checks`
    paths.txt          the source path of each record, one per line (read for errors only)
    shard-00000.bin    each record's fields back to back, in schema order: encoded images,
    shard-00001.bin    raw pixel records (kind=raw, fastload/data/rawimage.py), .npy arrays,
                       JSON, as their codecs write them

Readers open nothing until the first read in their own process (fork and spawn safe): no
per-file open/close, no locks, one page cache shared by every worker and rank on the node.

Integrity: at open every shard's size is checked against meta.json (a truncated shard is
named with the first record it cuts) and every int column (the labels) against its
checksum (a few milliseconds for a million records); at each read the field's checksum is
checked, so a flipped byte is reported with its file and record instead of being decoded
as garbage (or trained under another label).
The checksum is xxh3_64: ~6 us for a 196 KB raw record on one core where zlib's crc32
takes ~35 us, a quarter of the whole raw-sample cost. `python -m fastload.pack verify DST`
checks whole-file crc32s and every field's checksum too (`verify_split`: reading
everything, too slow for every start on 100 GB). Packs of earlier versions (one image and
one target per record) are refused with the re-pack command; storage.auto_pack re-packs.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import time
import zlib
from pathlib import Path

import numpy as np
import xxhash

from fastload.data.records import Schema
from fastload.errors import ConfigError, StorageError
from fastload.storage.base import PackedReader
from fastload.storage.packing import KINDS, PackedStorage, check_pack_numbers, unchecked_note

log = logging.getLogger("fastload")

FORMAT = "fastload-shards"
VERSION = 3
READABLE_VERSIONS = (3,)
CHECK_NAME = "xxh3_64"


def record_check(data) -> int:
    """The per-field checksum."""
    return xxhash.xxh3_64_intdigest(data)


def index_dtype(schema: Schema) -> np.dtype:
    cols = [("shard", "<u4")]
    for f in schema.blobs:
        cols += [
            (f"{f.name}.offset", "<u8"),
            (f"{f.name}.length", "<u8"),
            (f"{f.name}.check", "<u8"),
        ]
    return np.dtype(cols + [(f.name, "<i8") for f in schema.columns])


def column_check(values) -> int:
    """The checksum of an int column: xxh3_64 of its int64 little-endian bytes."""
    return record_check(np.ascontiguousarray(values, "<i8").tobytes())


def column_problems(index, schema: Schema, meta: dict, where: Path) -> tuple[list[str], list]:
    """(problems, unchecked): each int column of `index` whose checksum differs from
    meta.json's `column_checks`, and the columns it has none for (packs written before
    columns had one)."""
    checks = meta.get("column_checks") or {}
    problems, unchecked = [], []
    for f in schema.columns:
        if f.name not in checks:
            unchecked.append(f.name)
        elif column_check(index[f.name]) != int(checks[f.name]):
            problems.append(
                f"{where}: its {f.name} column fails its {CHECK_NAME} check: its values are not "
                f"the ones packed"
            )
    return problems, unchecked


def blob_columns(name: str) -> tuple[str, str, str]:
    return f"{name}.offset", f"{name}.length", f"{name}.check"


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.bin"


class ShardWriter:
    """Append records to shards of about `shard_bytes` each; `close()` writes the index and
    the metadata (last: a folder without meta.json is not a pack)."""

    def __init__(self, out_dir, schema: Schema, shard_bytes: int = 1 << 30):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.schema = schema
        self.shard_bytes = int(shard_bytes)
        self.rows: list[tuple] = []
        self.paths: list[str] = []
        self.shards: list[dict] = []
        self._f = None
        self._crc = 0
        self._size = 0

    def _roll(self) -> None:
        self._finish_shard()
        self._f = open(self.dir / shard_name(len(self.shards)), "wb")  # noqa: SIM115
        self._crc, self._size = 0, 0

    def _finish_shard(self) -> None:
        if self._f is not None:
            self._f.close()
            self.shards.append(
                {"file": self._f.name.rsplit("/", 1)[-1], "bytes": self._size, "crc32": self._crc}
            )
            self._f = None

    def add(self, values: dict, *, path: str = "") -> None:
        """One record: {field name: value}, every field of the schema; the fields stored as
        bytes go back to back into one shard."""
        blobs = [f.coder.encode(values[f.name]) for f in self.schema.blobs]
        need = sum(len(b) for b in blobs)
        if self._f is None or (self._size and self._size + need > self.shard_bytes):
            self._roll()
        row = [len(self.shards)]
        for data in blobs:
            row += [self._size, len(data), record_check(data)]
            self._write(data)
        row += [int(values[f.name]) for f in self.schema.columns]
        self.rows.append(tuple(row))
        self.paths.append(path)

    def _write(self, data: bytes) -> None:
        self._f.write(data)
        self._crc = zlib.crc32(data, self._crc)
        self._size += len(data)

    def close(self, *, classes, params: dict, source: str = "") -> dict:
        self._finish_shard()
        index = np.array(self.rows, dtype=index_dtype(self.schema))
        np.save(self.dir / "index.npy", index)
        # a file name that is not UTF-8 is kept as its bytes (surrogateescape), as Python reads it
        (self.dir / "paths.txt").write_text(
            "\n".join(self.paths) + "\n", encoding="utf-8", errors="surrogateescape"
        )
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "record_checksum": CHECK_NAME,
            "schema": self.schema.to_json(),
            "count": len(index),
            "classes": list(classes),
            "params": params,
            "source": source,
            "shards": self.shards,
            "total_bytes": sum(s["bytes"] for s in self.shards),
            "column_checks": {f.name: column_check(index[f.name]) for f in self.schema.columns},
        }
        tmp = self.dir / "meta.json.tmp"
        tmp.write_text(json.dumps(meta, indent=1), encoding="utf-8")
        os.replace(tmp, self.dir / "meta.json")
        return meta


class ShardReader(PackedReader):
    """The fields of one split's shard pack; never decodes an image."""

    _unpicklable = ("_maps", "_index")

    def __init__(self, split_dir, verify: bool = True, cold_cache: bool = False):
        self.dir = Path(split_dir)
        self.verify = bool(verify)
        self.cold_cache = bool(cold_cache)
        self._bind_pack()
        meta, problems = read_split_meta(self.dir)
        if meta is None:
            raise StorageError(
                f"{problems[0]} Delete it and re-pack (python -m fastload.pack shards)."
            )
        self.meta = meta
        self.schema = Schema.from_json(meta["schema"])
        self._check_sizes()
        index = load_table(self.dir / "index.npy", index_dtype(self.schema).names)
        if len(index) != self.meta["count"]:
            raise StorageError(
                f"{self.dir / 'index.npy'} has {len(index)} records, meta.json says "
                f"{self.meta['count']}: the pack is incomplete; delete {self.dir} and re-pack."
            )
        self._columns = {f.name: np.array(index[f.name], np.int64) for f in self.schema.columns}
        if self.verify:
            damaged, _ = column_problems(self._columns, self.schema, meta, self.dir / "index.npy")
            if damaged:
                raise StorageError(
                    f"{damaged[0]}. The pack is damaged: run `python -m fastload.pack verify "
                    f"{self.dir}`, delete it and re-pack."
                )
        self._blob = {f.name: (f, *blob_columns(f.name)) for f in self.schema.blobs}
        self._index = None
        self._maps = None
        self._init_stats()

    def _check_sizes(self) -> None:
        """A truncated (or grown) shard is reported at open, not read as garbage."""
        index = None
        for k, s in enumerate(self.meta["shards"]):
            f = self.dir / s["file"]
            try:
                have = f.stat().st_size
            except FileNotFoundError:
                raise StorageError(
                    f"shard {f} is missing ({s['bytes']} bytes expected); the pack at "
                    f"{self.dir} is incomplete: delete it and re-pack."
                ) from None
            if have != s["bytes"]:
                if index is None:
                    index = load_table(self.dir / "index.npy", ("shard",))
                cut = np.zeros(len(index), bool)
                for f_ in self.schema.blobs:
                    off, n, _ = blob_columns(f_.name)
                    cut |= (index["shard"] == k) & (index[off] + index[n] > have)
                rows = np.nonzero(cut)[0]
                first = f"; first damaged record: {int(rows[0])}" if len(rows) else ""
                raise StorageError(
                    f"shard {f} is {'truncated' if have < s['bytes'] else 'longer than packed'}: "
                    f"{have} bytes on disk, {s['bytes']} expected{first}. Delete "
                    f"{self.dir} and re-pack (python -m fastload.pack shards ...)."
                )

    # -- the storage contract ---------------------------------------------------------------

    def _row(self, i: int):
        if self._index is None:
            self._check_same_pack()
            self._index = load_table(self.dir / "index.npy")
        return self._index[i]

    def describe(self, i: int, name: str | None = None) -> str:
        row = self._row(i)
        src = ""
        try:
            with open(self.dir / "paths.txt", encoding="utf-8", errors="surrogateescape") as f:
                for k, line in enumerate(f):
                    if k == i:
                        src = f", packed from {line.strip()}"
                        break
        except OSError:
            pass
        name = name if name in self._blob else self.schema.blobs[0].name
        off, n = (int(row[c]) for c in blob_columns(name)[:2])
        what = "" if name == self.schema.blobs[0].name else f"field {name} of "
        return (
            f"{what}{self.dir / shard_name(int(row['shard']))} record {i} (offset {off}, "
            f"{n} bytes){src}"
        )

    def _map(self, k: int):
        if self._maps is None:
            self._maps = {}
        mm = self._maps.get(k)
        if mm is None:
            self._check_same_pack()
            with open(self.dir / self.meta["shards"][k]["file"], "rb") as f:
                # a shard of zero-byte records only (empty files, skipped as undecodable at
                # read) is an empty file, which mmap refuses
                empty = os.fstat(f.fileno()).st_size == 0
                mm = b"" if empty else mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[k] = mm
        return mm

    def nonempty(self, name: str) -> np.ndarray | None:
        """From the index's lengths, reading one record: a field stored as .npy bytes is a
        header, which grows (in steps of 16 or 64 bytes) with the digits of the shape, then
        the elements. So, within one pack, the empty arrays are its shortest values, all of
        one length, and every array with an element is longer: the shortest value says
        which the records of that length are."""
        field = self.field(name)
        if field.coder.name != "array" or name not in self._blob:
            return None
        lengths = np.asarray(self._row(slice(None))[self._blob[name][2]], np.int64)
        if not len(lengths):
            return np.zeros(0, bool)
        shortest = int(np.argmin(lengths))
        if np.size(self.get(shortest, name)):
            return np.ones(len(lengths), bool)
        return lengths > lengths[shortest]

    def get(self, i: int, name: str):
        """Field `name` of record i: raw pixels as a read-only memoryview of the shard (the
        resize reads it once, no ~200 KB copy), other bytes copied for their codec."""
        if name in self._columns:
            return int(self._columns[name][i])
        t0 = time.perf_counter()
        field, off_col, len_col, check_col = self._blob.get(name) or (self.field(name),)
        row = self._row(i)
        off, n = int(row[off_col]), int(row[len_col])
        mm = self._map(int(row["shard"]))
        data = memoryview(mm)[off : off + n] if field.coder.zero_copy else mm[off : off + n]
        if self.verify and record_check(data) != int(row[check_col]):
            raise StorageError(
                f"corrupt record: {self.describe(i, name)} fails its {CHECK_NAME} check. The "
                f"shard file is damaged; run `python -m fastload.pack verify {self.dir}` and "
                f"re-pack."
            )
        # Accounted after the checksum: for a raw view that pass is what pages the record in
        # (with verify=false a raw read is only a view and its "read time" is ~0).
        self._account(n, t0)
        return self.decode_field(field, data, i, name)

    # -- cold cache and the engine's hooks --------------------------------------------------

    def store_root(self) -> str:
        return str(self.dir)

    def store_files(self) -> list[str]:
        return [str(self.dir / s["file"]) for s in self.meta["shards"]] + [
            str(self.dir / "index.npy")
        ]


class ShardStorage(PackedStorage):
    """storage=shards: large memory-mapped shard files per split (python -m fastload.pack
    shards), holding the source JPEGs, re-encoded smaller JPEGs, or decoded pixels."""

    format, marker, name = "shards", "meta.json", "shards"

    def __init__(
        self,
        path=None,
        kind: str = "jpeg",
        max_side: int | None = None,
        quality: int = 90,
        size: int | None = 256,
        shard_mb: int = 1024,
        verify: bool = True,
        auto_pack: bool = True,
        cold_cache: bool = False,
    ):
        if kind not in KINDS:
            raise StorageError(f"storage.kind={kind!r}: use one of {', '.join(KINDS)}.")
        check_pack_numbers(max_side, quality, size)
        if not (isinstance(shard_mb, int) and not isinstance(shard_mb, bool) and shard_mb >= 1):
            raise ConfigError(f"storage.shard_mb={shard_mb!r}: use a whole number of MB >= 1.")
        super().__init__(path=path, verify=verify, auto_pack=auto_pack, cold_cache=cold_cache)
        self.kind, self.max_side, self.quality = kind, max_side, int(quality)
        # size null: raw records at full resolution (super-resolution pairs)
        self.size, self.shard_mb = (None if size is None else int(size)), int(shard_mb)

    def default_path(self, root) -> str:
        if self.kind == "raw":
            tag = f"raw-{self.size}px" if self.size else "raw-full"
        elif self.max_side:
            tag = f"jpeg-{self.max_side}px-q{self.quality}"
        else:
            tag = "jpeg-orig"
        return f"{os.fspath(root).rstrip('/')}.packs/shards-{tag}"

    def writer(self, folder: Path, schema: Schema) -> ShardWriter:
        return ShardWriter(folder, schema, shard_bytes=self.shard_mb << 20)

    def reader(self, split_dir: Path) -> ShardReader:
        return ShardReader(split_dir, verify=self.verify, cold_cache=self.cold_cache)

    def pack_options(self) -> dict:
        return {
            "kind": self.kind,
            "max_side": self.max_side if self.kind == "jpeg" else None,
            "quality": self.quality,
            "size": self.size,
        }

    def cli_options(self) -> list[str]:
        opts = ["--kind", self.kind]
        if self.kind == "raw":
            return opts + ["--size", str(self.size or "full")]
        if self.max_side:
            opts += ["--max-side", str(self.max_side), "--quality", str(self.quality)]
        return opts


def file_crc32(path) -> tuple[int, int]:
    """(crc32, size) of a whole file, read in 16 MB chunks."""
    crc, size = 0, 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return crc, size


def shard_problem(split_dir: Path, s: dict) -> str | None:
    """A shard of meta.json["shards"] that is missing, or whose size or whole-file crc32
    differs from the packed one; None when it matches."""
    f = split_dir / s["file"]
    if not f.is_file():
        return f"{f} is missing ({s['bytes']} bytes packed)"
    crc, size = file_crc32(f)
    if size != s["bytes"] or crc != s["crc32"]:
        return (
            f"{f}: {size} bytes crc32 {crc:08x}, packed {s['bytes']} bytes crc32 {s['crc32']:08x}"
        )
    return None


def failing_records(path: Path, table, k: int, name: str) -> list[int]:
    """Rows of the index stored in shard k whose field `name` is cut off or fails its
    checksum."""
    off_col, len_col, check_col = blob_columns(name)
    rows = np.nonzero(table["shard"] == k)[0]
    if not len(rows) or not path.is_file():
        return [int(i) for i in rows]
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    bad = []
    try:
        for i in rows:
            off, n = int(table[off_col][i]), int(table[len_col][i])
            if off + n > size or record_check(mm[off : off + n]) != int(table[check_col][i]):
                bad.append(int(i))
    finally:
        if size:
            mm.close()
    return bad


def load_table(path: Path, fields: tuple[str, ...] = ()) -> np.ndarray:
    """A pack's .npy table, memory-mapped (never unpickled); StorageError naming the file when
    it is not one this pack writes (garbage, cut, other columns)."""
    try:
        table = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        # never numpy's own advice: it suggests allow_pickle=True, which runs the file's code
        objects = "pickle" in str(exc) or "Python objects" in str(exc)
        why = "it holds pickled objects" if objects else str(exc).split(". ")[0]
        raise StorageError(
            f"{path} is not a readable pack table ({why}): the pack is damaged; delete "
            f"{path.parent} and re-pack (python -m fastload.pack shards ...)."
        ) from None
    missing = [f for f in fields or () if f not in (table.dtype.names or ())]
    if missing:
        raise StorageError(
            f"{path} lacks the columns {', '.join(missing)}: it is not the table this pack "
            f"writes; delete {path.parent} and re-pack (python -m fastload.pack shards ...)."
        )
    return table


def read_split_meta(split_dir: Path) -> tuple[dict | None, list[str]]:
    """(meta.json of a shard pack, []) or (None, [why it is not one this fastload reads])."""
    path = split_dir / "meta.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return None, [f"{path} cannot be read ({exc}); delete {split_dir} and re-pack."]
    if (
        not isinstance(meta, dict)
        or meta.get("format") != FORMAT
        or meta.get("version") not in READABLE_VERSIONS
    ):
        says = f"{meta.get('format')} v{meta.get('version')}" if isinstance(meta, dict) else meta
        versions = ", ".join(f"v{v}" for v in READABLE_VERSIONS)
        return None, [f"{path} is not a {FORMAT} pack of a version this fastload reads "
                      f"({versions}; it says {says})."]  # fmt: skip
    return meta, []


def verify_split(split_dir) -> tuple[int, list[str], list[str]]:
    """`python -m fastload.pack verify` for one split of a shard pack: meta.json and the
    index agree, every shard's size and whole-file crc32 match meta.json, every field of
    every record passes its checksum and every int column its own; a failing shard is
    reported with the records it damages. Returns (records checked, problems, notes: what
    could not be checked)."""
    split_dir = Path(split_dir)
    meta, problems = read_split_meta(split_dir)
    if meta is None:
        return 0, problems, []
    schema = Schema.from_json(meta["schema"])
    try:
        index = load_table(split_dir / "index.npy", index_dtype(schema).names)
    except StorageError as exc:
        return 0, [exc.user_message], []
    if len(index) != meta["count"]:
        problems.append(
            f"{split_dir / 'index.npy'} has {len(index)} records, meta.json says "
            f"{meta['count']}: the pack is incomplete; delete {split_dir} and re-pack."
        )
    damaged, unchecked = column_problems(index, schema, meta, split_dir / "index.npy")
    problems += damaged
    try:
        paths = (split_dir / "paths.txt").read_text("utf-8", "surrogateescape").split("\n")
    except OSError:
        paths = []
    first = schema.blobs[0].name
    for k, s in enumerate(meta["shards"]):
        f = split_dir / s["file"]
        bad = []
        for field in schema.blobs:
            what = "" if field.name == first else f"field {field.name} of "
            bad += [
                f"{what}record {i}" + (f" ({paths[i]})" if i < len(paths) and paths[i] else "")
                for i in failing_records(f, index, k, field.name)
            ]
        whole = shard_problem(split_dir, s)
        if bad or whole:
            more = f", ... ({len(bad)} in all)" if len(bad) > 5 else ""
            fails = f"; failing their {CHECK_NAME} check: {', '.join(bad[:5])}{more}" if bad else ""
            problems.append(f"{whole or f'{f}: whole-file crc32 ok'}{fails}")
    return len(index), problems, unchecked_note(unchecked)
