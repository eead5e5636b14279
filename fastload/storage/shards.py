"""storage=shards: a few large contiguous binary files plus an index, memory-mapped by readers.

Layout of one split (`python -m fastload.pack shards SRC DST` writes DST/<split>/):

    meta.json          format, version, kind (jpeg | raw), count, classes, pack params, and
                       per shard: file name, size in bytes, crc32 of the whole file
    index.npy          one structured row per record: shard, offset, length, target, check
                       (xxh3_64 of the record), height, width, box_start, box_count
                       (memory-mapped, shared by workers)
    boxes.npy          variable-length targets (COCO detection boxes x, y, w, h, float32, in
                       pixels of the stored image), rows box_start .. box_start + box_count
                       of each record (written when the source has boxes, even zero of them)
    labels.npy         the category id (int64) of each row of boxes.npy
    pairs.npy          paired records (DIV2K LR images), one row per record, the index's
                       first columns (shard, offset, length, check, height, width); the pair's
                       bytes follow its record in the same shard (optional)
    paths.txt          the source path of each record, one per line (read for errors only)
    shard-00000.bin    records back to back: encoded JPEG bytes (kind=jpeg) or a fastload raw
    shard-00001.bin    pixel record (kind=raw, see fastload/data/rawimage.py)

Readers open nothing until the first read in their own process (fork and spawn safe): no
per-file open/close, no locks, one page cache shared by every worker and rank on the node.

Integrity: at open every shard's size is checked against meta.json (a truncated shard is
named with the first record it cuts); at each read the record's checksum is checked, so a
flipped byte is reported with its file and record instead of being decoded as garbage.
Version 2 packs use xxh3_64 per record: ~6 us for a 196 KB raw record on one core where
zlib's crc32 takes ~35 us, a quarter of the whole raw-sample cost; version 1 packs (crc32)
are still read. `python -m fastload.pack verify DST` checks whole-file crc32s and every
record's checksum too (`verify_split`: reading everything, too slow for every start on 100 GB).
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

from fastload.errors import StorageError
from fastload.storage.base import PackedReader
from fastload.storage.packing import KINDS, PackedStorage

log = logging.getLogger("fastload")

FORMAT = "fastload-shards"
VERSION = 2
READABLE_VERSIONS = (1, 2)

INDEX_DTYPE = np.dtype(
    [
        ("shard", "<u4"),
        ("offset", "<u8"),
        ("length", "<u8"),
        ("target", "<i8"),
        ("check", "<u8"),
        ("height", "<u4"),
        ("width", "<u4"),
        ("box_start", "<u8"),
        ("box_count", "<u4"),
    ]
)
PAIR_DTYPE = np.dtype(
    [(n, INDEX_DTYPE[n]) for n in ("shard", "offset", "length", "check")]
    + [("height", "<u4"), ("width", "<u4")]
)


def record_check(data) -> int:
    """The per-record checksum of version-2 packs."""
    return xxhash.xxh3_64_intdigest(data)


# Per pack version: the index column holding the record checksum, its function and name.
CHECKS = {1: ("crc", zlib.crc32, "crc32"), 2: ("check", record_check, "xxh3_64")}


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.bin"


class ShardWriter:
    """Append records to shards of about `shard_bytes` each; `close()` writes the index and
    the metadata (last: a folder without meta.json is not a pack)."""

    def __init__(self, out_dir, kind: str, shard_bytes: int = 1 << 30):
        if kind not in KINDS:
            raise ValueError(kind)
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.kind = kind
        self.shard_bytes = int(shard_bytes)
        self.rows: list[tuple] = []
        self.boxes: list[np.ndarray] = []
        self.labels: list[np.ndarray] = []
        self.has_boxes = False
        self.pairs: list[tuple] = []
        self.n_boxes = 0
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

    def add(
        self,
        record: bytes,
        target: int,
        *,
        height=0,
        width=0,
        boxes=None,
        labels=None,
        pair: bytes | None = None,
        pair_hw=(0, 0),
        path="",
    ) -> None:
        """One record; `boxes` (n, 4) float32 with `labels` (n,) int64 for detection sources,
        `pair` the bytes of a paired image (written right after the record, same shard)."""
        need = len(record) + (len(pair) if pair is not None else 0)
        if self._f is None or (self._size and self._size + need > self.shard_bytes):
            self._roll()
        check = record_check(record)
        nb = 0 if boxes is None else len(boxes)
        if boxes is not None:
            self.has_boxes = True
        self.rows.append(
            (
                len(self.shards),
                self._size,
                len(record),
                int(target),
                check,
                height,
                width,
                self.n_boxes,
                nb,
            )
        )
        if nb:
            self.boxes.append(np.asarray(boxes, np.float32).reshape(nb, 4))
            lab = np.zeros(nb, np.int64) if labels is None else np.asarray(labels, np.int64)
            if lab.shape != (nb,):
                raise ValueError(f"{path}: {nb} boxes but labels of shape {lab.shape}")
            self.labels.append(lab)
            self.n_boxes += nb
        self._write(record)
        if pair is not None:
            self.pairs.append(
                (len(self.shards), self._size, len(pair), record_check(pair), *pair_hw)
            )
            self._write(pair)
        elif self.pairs:
            raise ValueError(f"{path}: a paired pack needs a pair for every record")
        self.paths.append(path)

    def _write(self, data: bytes) -> None:
        self._f.write(data)
        self._crc = zlib.crc32(data, self._crc)
        self._size += len(data)

    def close(self, *, classes, params: dict, source: str = "") -> dict:
        self._finish_shard()
        index = np.array(self.rows, dtype=INDEX_DTYPE)
        np.save(self.dir / "index.npy", index)
        if self.has_boxes:
            cat = np.concatenate if self.boxes else None
            np.save(
                self.dir / "boxes.npy", cat(self.boxes) if cat else np.zeros((0, 4), np.float32)
            )
            np.save(self.dir / "labels.npy", cat(self.labels) if cat else np.zeros(0, np.int64))
        if self.pairs:
            if len(self.pairs) != len(self.rows):
                raise ValueError("a paired pack needs a pair for every record")
            np.save(self.dir / "pairs.npy", np.array(self.pairs, dtype=PAIR_DTYPE))
        (self.dir / "paths.txt").write_text("\n".join(self.paths) + "\n", encoding="utf-8")
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "record_checksum": CHECKS[VERSION][2],
            "kind": self.kind,
            "count": len(index),
            "classes": list(classes),
            "params": params,
            "source": source,
            "shards": self.shards,
            "total_bytes": sum(s["bytes"] for s in self.shards),
        }
        tmp = self.dir / "meta.json.tmp"
        tmp.write_text(json.dumps(meta, indent=1), encoding="utf-8")
        os.replace(tmp, self.dir / "meta.json")
        return meta


class ShardReader(PackedReader):
    """Reads `(bytes, target)` from one split's shard pack; never decodes."""

    _unpicklable = ("_maps", "_index", "_boxes", "_labels", "_pairs")

    def __init__(self, split_dir, verify: bool = True, cold_cache: bool = False):
        self.dir = Path(split_dir)
        self.verify = bool(verify)
        self.cold_cache = bool(cold_cache)
        meta, problems = read_split_meta(self.dir)
        if meta is None:
            raise StorageError(
                f"{problems[0]} Delete it and re-pack (python -m fastload.pack shards)."
            )
        self.meta = meta
        self._check_col, self._check_fn, self.check_name = CHECKS[self.meta["version"]]
        if self.meta["version"] < VERSION:
            log.info(
                "%s is a v%d shard pack (crc32 record checks, ~6x slower than v%d's xxh3 on "
                "raw records); delete it and re-pack to upgrade.",
                self.dir,
                self.meta["version"],
                VERSION,
            )
        self.kind = self.meta["kind"]
        self._check_sizes()
        index = load_table(self.dir / "index.npy", INDEX_FIELDS)
        if len(index) != self.meta["count"]:
            raise StorageError(
                f"{self.dir / 'index.npy'} has {len(index)} records, meta.json says "
                f"{self.meta['count']}: the pack is incomplete; delete {self.dir} and re-pack."
            )
        self._targets = np.array(index["target"], dtype=np.int64)
        self._index = None
        self._maps = None
        self._boxes = self._labels = self._pairs = None
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
                    index = load_table(self.dir / "index.npy", INDEX_FIELDS)
                rows = np.nonzero(
                    (index["shard"] == k) & (index["offset"] + index["length"] > have)
                )[0]
                if not len(rows) and (self.dir / "pairs.npy").is_file():  # a cut LR pair
                    pairs = load_table(self.dir / "pairs.npy", PAIR_FIELDS)
                    rows = np.nonzero(
                        (pairs["shard"] == k) & (pairs["offset"] + pairs["length"] > have)
                    )[0]
                first = f"; first damaged record: {int(rows[0])}" if len(rows) else ""
                raise StorageError(
                    f"shard {f} is {'truncated' if have < s['bytes'] else 'longer than packed'}: "
                    f"{have} bytes on disk, {s['bytes']} expected{first}. Delete "
                    f"{self.dir} and re-pack (python -m fastload.pack shards ...)."
                )

    # -- the storage contract ---------------------------------------------------------------

    def _row(self, i: int):
        if self._index is None:
            self._index = load_table(self.dir / "index.npy", INDEX_FIELDS)
        return self._index[i]

    def describe(self, i: int) -> str:
        row = self._row(i)
        src = ""
        try:
            with open(self.dir / "paths.txt", encoding="utf-8") as f:
                for k, line in enumerate(f):
                    if k == i:
                        src = f", packed from {line.strip()}"
                        break
        except OSError:
            pass
        return (
            f"{self.dir / shard_name(int(row['shard']))} record {i} (offset {int(row['offset'])}, "
            f"{int(row['length'])} bytes){src}"
        )

    def _map(self, k: int):
        if self._maps is None:
            self._maps = {}
        mm = self._maps.get(k)
        if mm is None:
            with open(self.dir / self.meta["shards"][k]["file"], "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[k] = mm
        return mm

    def read(self, i: int) -> tuple[bytes, int]:
        """(record, target): bytes, or for kind=raw a read-only memoryview of the shard."""
        t0 = time.perf_counter()
        row = self._row(i)
        off, n = int(row["offset"]), int(row["length"])
        mm = self._map(int(row["shard"]))
        # Raw pixels: a read-only view of the map, not a ~200 KB copy (the resize reads it
        # once); encoded records stay bytes for the decoders.
        data = memoryview(mm)[off : off + n] if self.kind == "raw" else mm[off : off + n]
        if self.verify and self._check_fn(data) != int(row[self._check_col]):
            raise StorageError(
                f"corrupt record: {self.describe(i)} fails its {self.check_name} check. The shard file is "
                f"damaged; run `python -m fastload.pack verify {self.dir}` and re-pack."
            )
        # Accounted after the checksum: for a raw view that pass is what pages the record in
        # (with verify=false a raw read is only a view and its "read time" is ~0).
        self._account(n, t0)
        return data, int(self._targets[i])

    def boxes(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """The variable-length target of record i: boxes (n, 4) float32 x, y, w, h in pixels
        of the stored image, and their category ids (n,) int64; n = 0 when it has none (or
        the pack has no boxes at all)."""
        row = self._row(i)
        if self._boxes is None:
            path = self.dir / "boxes.npy"
            if not path.exists():
                return np.zeros((0, 4), np.float32), np.zeros(0, np.int64)
            self._boxes = load_table(path)
            self._labels = load_table(self.dir / "labels.npy")
        s, n = int(row["box_start"]), int(row["box_count"])
        return np.array(self._boxes[s : s + n]), np.array(self._labels[s : s + n])

    @property
    def has_pairs(self) -> bool:
        return (self.dir / "pairs.npy").is_file()

    def read_pair(self, i: int) -> bytes:
        """The paired record of record i (DIV2K: the LR image), crc-checked like `read`."""
        if self._pairs is None:
            path = self.dir / "pairs.npy"
            if not path.is_file():
                raise StorageError(
                    f"{self.dir} has no paired records (pairs.npy); pack the source with "
                    f"pairs (python -m fastload.pack shards DST --source div2k --hr .. --lr ..)."
                )
            self._pairs = load_table(path, PAIR_FIELDS)
        row = self._pairs[i]
        off, n = int(row["offset"]), int(row["length"])
        data = self._map(int(row["shard"]))[off : off + n]
        if self.verify and self._check_fn(data) != int(row[self._check_col]):
            raise StorageError(
                f"corrupt paired record of {self.describe(i)} fails its {self.check_name} check; run "
                f"`python -m fastload.pack verify {self.dir}` and re-pack."
            )
        return data

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

    def writer(self, folder: Path) -> ShardWriter:
        return ShardWriter(folder, self.kind, shard_bytes=self.shard_mb << 20)

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


def failing_records(path: Path, table, k: int, check) -> list[int]:
    """Rows of `table` (the index, or pairs.npy) stored in shard k whose bytes are cut off or
    fail their checksum; `check` = (index column, function) of the pack's version."""
    col, fn = check
    rows = np.nonzero(table["shard"] == k)[0]
    if not len(rows) or not path.is_file():
        return [int(i) for i in rows]
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    bad = []
    try:
        for i in rows:
            off, n = int(table["offset"][i]), int(table["length"][i])
            if off + n > size or fn(mm[off : off + n]) != int(table[col][i]):
                bad.append(int(i))
    finally:
        if size:
            mm.close()
    return bad


INDEX_FIELDS = ("shard", "offset", "length", "target")
PAIR_FIELDS = ("shard", "offset", "length")


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
    missing = [f for f in fields if f not in (table.dtype.names or ())]
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


def verify_split(split_dir) -> tuple[int, list[str]]:
    """`python -m fastload.pack verify` for one split of a shard pack: meta.json and the
    index agree, every shard's size and whole-file crc32 match meta.json, and every record
    (and paired record) passes its checksum; a failing shard is reported with the records it
    damages. Returns (records checked, problems)."""
    split_dir = Path(split_dir)
    meta, problems = read_split_meta(split_dir)
    if meta is None:
        return 0, problems
    try:
        index = load_table(split_dir / "index.npy", INDEX_FIELDS)
        pairs_path = split_dir / "pairs.npy"
        pairs = load_table(pairs_path, PAIR_FIELDS) if pairs_path.is_file() else None
    except StorageError as exc:
        return 0, [exc.user_message]
    if len(index) != meta["count"]:
        problems.append(
            f"{split_dir / 'index.npy'} has {len(index)} records, meta.json says "
            f"{meta['count']}: the pack is incomplete; delete {split_dir} and re-pack."
        )
    check, name = CHECKS[meta["version"]][:2], CHECKS[meta["version"]][2]
    try:
        paths = (split_dir / "paths.txt").read_text(encoding="utf-8").split("\n")
    except OSError:
        paths = []
    for k, s in enumerate(meta["shards"]):
        f = split_dir / s["file"]
        bad = [
            f"record {i}" + (f" ({paths[i]})" if i < len(paths) and paths[i] else "")
            for i in failing_records(f, index, k, check)
        ]
        if pairs is not None:
            bad += [f"pair of record {i}" for i in failing_records(f, pairs, k, check)]
        whole = shard_problem(split_dir, s)
        if bad or whole:
            more = f", ... ({len(bad)} in all)" if len(bad) > 5 else ""
            fails = f"; failing their {name} check: {', '.join(bad[:5])}{more}" if bad else ""
            problems.append(f"{whole or f'{f}: whole-file crc32 ok'}{fails}")
    return len(index), problems
