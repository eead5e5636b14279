"""storage=webdataset: WebDataset tar shards from a local folder, http(s):// or s3:// (fsspec),
through a node-local shard cache, in a deterministic shard-aware order with exact resume.

Shards (`python -m fastload.pack webdataset SRC DST` writes DST/<split>/):

    shard-000000.tar   tar members keyed by basename, the WebDataset convention: one
    shard-000001.tar     member per field of each record, <key>.<ext> as the field's codec
                         names it (fastload/data/records.py): an ImageFolder record is
                         00000000.jpg (or .png: the source file's bytes, or re-encoded with
                         --max-side) and 00000000.cls (the class index, ASCII); COCO adds
                         00000000.boxes.npy and 00000000.labels.npy (written for every
                         image, even with zero boxes), DIV2K with --lr 00000000.lr.png
    manifest.json      format, version, schema (the fields and their codecs), count,
                       classes, pack params (COCO: category ids), and per shard: file,
                       count, bytes, xxh3_64 of the whole file, the values of every int
                       field (`columns`) and the element count of every array field of each
                       sample (`sizes`: COCO's box counts; manifests written before have
                       none). Written last: a folder without it is not a pack.
                       Training knows the epoch length, every label and which images have
                       boxes from it, without listing the bucket or reading a shard.

`storage.url` names where the shards are:
  * null: the local pack beside dataset.root (packed on first use, storage.auto_pack);
  * a pack folder (local path, http(s)://host/path, s3://bucket/prefix): the split's
    manifest is <url>/<split>/manifest.json and names the shards;
  * a brace pattern of shards, `{split}` replaced by the split name, e.g.
    s3://bucket/imagenet/{split}-{000000..000146}.tar: the manifest.json beside the shards
    is used when it names them; otherwise (shards written by other tools) local rank 0
    reads every shard once (into the cache) and keeps the derived manifest in the cache
    folder, its fields those of the dataset's layout (an ImageFolder's: .jpg and .cls),
    classes named by their index;
  * a mapping split -> folder or pattern (train and val with different shard counts).

Reading: the reader is map-style like every other storage (`get(i, name)`: one field of
record i): sample i lies in shard k at member offset o. The shard is fetched whole into the node cache
(fastload/storage/wds_cache.py: one fetch per node, atomic rename, LRU size limit, retries;
a cached shard is found by its URL and the manifest's checksum, so a shard re-packed to the
same URL is fetched again, but one without a manifest by its URL alone)
or, for a local folder, read where it is; its tar index comes from the tar headers, read
once per process while the file is unchanged (kept when its memory map is closed: 8 bytes a
sample per non-int field, up to KEEP_INDEX_BYTES); the member's bytes are sliced from a
memory map. The order that makes this
stream shard by shard is the sampler's (fastload/data/sampling.py: ShardStreamSampler): the
shards permuted per (seed, epoch), the stream cut into equal parts per rank, each part
shuffled block-wise within `shuffle_buffer` samples, so a worker needs only the few shards
one window overlaps and resume skips batches of a deterministic order like the others.

Integrity: a fetched shard's size and xxh3_64 are checked against the manifest before it is
renamed into the cache; a local shard's when it is first read (verify), once per node
while the file is unchanged (a marker in the cache folder, `ShardCache.verify_once`: every
DataLoader worker opens nearly every shard).
A shard that fails (or whose tar headers are cut or damaged) is named in the error; with
dataset.skip_corrupt=true its samples are skipped and counted instead (the reader hands the
decoder empty bytes for an image field, None for any other, which the dataset's skip path
counts under the shard's name).
"""

from __future__ import annotations

import collections
import io
import json
import logging
import mmap
import os
import re
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

from fastload.data.layouts import as_layout
from fastload.data.records import Schema
from fastload.errors import ConfigError, StorageError
from fastload.storage.base import Reader
from fastload.storage.packing import KINDS, PackedStorage, check_pack_numbers
from fastload.storage.wds_cache import (
    CorruptShard,
    ShardCache,
    fetch,
    file_xxh3,
    filesystem,
    is_remote,
    locked,
    with_retries,
)
from fastload.telemetry.sinks import write_json_atomic

log = logging.getLogger("fastload")

FORMAT = "fastload-webdataset"
VERSION = 2
MANIFEST = "manifest.json"


def shard_name(k: int) -> str:
    return f"shard-{k:06d}.tar"


# -- brace patterns and URLs ------------------------------------------------------------------

_BRACE = re.compile(r"\{([^{}]*)\}")


def expand_braces(pattern: str) -> list[str]:
    """WebDataset / bash brace expansion: {000..146} (zero padding kept) and {a,b}."""
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    body, head, tail = m.group(1), pattern[: m.start()], pattern[m.end() :]
    if ".." in body:
        lo, hi = body.split("..", 1)
        if not (lo.isdigit() and hi.isdigit()):
            raise ConfigError(f"storage.url {pattern}: {{{body}}} is not a range like {{000..099}}")
        width = len(lo) if lo.startswith("0") else 0
        items = [str(v).zfill(width) for v in range(int(lo), int(hi) + 1)]
    elif "," in body:
        items = body.split(",")
    else:
        raise ConfigError(
            f"storage.url {pattern}: {{{body}}} is neither a range {{000..099}}, a list {{a,b}} "
            f"nor {{split}}"
        )
    return [x for item in items for x in expand_braces(head + item + tail)]


def join(base: str, name: str) -> str:
    return f"{str(base).rstrip('/')}/{name}"


def parent(url: str) -> str:
    return str(url).rsplit("/", 1)[0] if "/" in str(url) else "."


def split_key(member: str) -> tuple[str, str]:
    """The WebDataset sample key and extension of a tar member: dir/00001.cls -> (dir/00001,
    cls): the basename's text up to its first dot is the key."""
    folder, _, base = member.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


# -- writing ----------------------------------------------------------------------------------


class WdsWriter:
    """Append records as tar members to shards of about `shard_bytes` (and at most
    `shard_samples`); `close()` writes the manifest, last (the pack's marker)."""

    def __init__(
        self,
        out_dir,
        schema: Schema,
        shard_bytes: int = 256 << 20,
        shard_samples: int | None = None,
    ):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.schema = schema
        self.shard_bytes = int(shard_bytes)
        self.shard_samples = int(shard_samples) if shard_samples else None
        self.shards: list[dict] = []
        self.count = 0
        self._tar = None
        self._cur: dict | None = None

    def _roll(self) -> None:
        self._finish()
        name = shard_name(len(self.shards))
        # USTAR: fixed 512-byte headers, readable by every tar reader (WebDataset, DALI).
        self._tar = tarfile.open(self.dir / name, "w", format=tarfile.USTAR_FORMAT)
        columns = {f.name: [] for f in self.schema.columns}
        sizes = {f.name: [] for f in self.schema if f.coder.name == "array"}
        self._cur = {"file": name, "count": 0, "bytes": 0, "columns": columns}
        if sizes:
            self._cur["sizes"] = sizes

    def _finish(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        path = self.dir / self._cur["file"]
        self._cur["bytes"] = path.stat().st_size
        self._cur["xxh3_64"] = file_xxh3(path)
        self.shards.append(self._cur)
        self._tar, self._cur = None, None

    def _member(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mtime = 0  # reproducible shards: the same source gives the same bytes
        info.mode = 0o444
        self._tar.addfile(info, io.BytesIO(data))
        self._cur["bytes"] += 512 + -(-len(data) // 512) * 512

    def add(self, values: dict, *, path: str = "") -> None:
        """One record: {field name: value}, every field of the schema, as one member each
        in the same shard."""
        members = [(f, f.coder.encode(values[f.name])) for f in self.schema]
        need = sum(len(data) + 512 for _, data in members)
        full = self._cur is not None and (
            (self._cur["count"] and self._cur["bytes"] + need + 2048 > self.shard_bytes)
            or (self.shard_samples and self._cur["count"] >= self.shard_samples)
        )
        if self._tar is None or full:
            self._roll()
        key = f"{self.count:08d}"
        for f, data in members:
            self._member(f"{key}.{f.member_ext(data)}", data)
        for f in self.schema.columns:
            self._cur["columns"][f.name].append(int(values[f.name]))
        for name, sizes in self._cur.get("sizes", {}).items():
            sizes.append(int(np.size(values[name])))
        self._cur["count"] += 1
        self.count += 1

    def close(self, *, classes, params: dict, source: str = "") -> dict:
        self._finish()
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "schema": self.schema.to_json(),
            "count": self.count,
            "classes": list(classes),
            "params": params,
            "source": source,
            "shards": self.shards,
            "total_bytes": sum(s["bytes"] for s in self.shards),
        }
        tmp = self.dir / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(meta), encoding="utf-8")
        os.replace(tmp, self.dir / MANIFEST)
        return meta


# -- reading one shard ------------------------------------------------------------------------


# A reader keeps the index of this many bytes of shards it closed (8 bytes a sample for each
# field but the int ones: ImageNet's 1.28M samples, 10 MB); beyond it, of the last used.
KEEP_INDEX_BYTES = 64 << 20


def tar_index(path, name: str = "") -> tuple[list[str], dict]:
    """(sample keys in the order they first appear, {ext: {key: (offset, length)}}) of a tar
    shard, from its headers only. Damaged or cut headers and members cut by the end of the
    file raise StorageError naming the shard."""
    with open(path, "rb") as fh:
        return file_index(fh, name or str(path))


def file_index(fh, name: str) -> tuple[list[str], dict]:
    """tar_index of an open shard file: its headers walked directly (`fast_index`), or read
    by tarfile where they are not plain (`tarfile_index`)."""
    size = os.fstat(fh.fileno()).st_size
    if size:
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            try:
                return fast_index(mm, size)
            except UnusualTar:
                pass
    return tarfile_index(fh, name, size)


def tarfile_index(fh, name: str, size: int) -> tuple[list[str], dict]:
    """tar_index by Python's tarfile (~25-50 us a member): every tar it reads, and the
    errors of damaged ones."""
    keys, members = {}, {}
    fh.seek(0)
    try:
        with tarfile.open(fileobj=fh, mode="r:") as tf:
            for m in tf:
                if not m.isfile():
                    continue
                if m.offset_data + m.size > size:
                    raise CorruptShard(
                        f"corrupt shard {name}: truncated, member {m.name} ends at byte "
                        f"{m.offset_data + m.size}, the file has {size}."
                    )
                key, ext = split_key(m.name)
                keys.setdefault(key, None)
                members.setdefault(ext, {})[key] = (m.offset_data, m.size)
    except tarfile.TarError as exc:
        raise CorruptShard(
            f"corrupt shard {name}: not a readable tar file ({exc}), damaged or cut. Re-write "
            f"it, or set dataset.skip_corrupt=true to skip and count its samples."
        ) from None
    return list(keys), members


BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
REGULAR = frozenset(b"0\x007")  # tarfile's regular types but sparse: data blocks follow
NO_DATA = frozenset(b"123456")  # links, devices, directories, fifos: no data blocks
NUMBERS = ((100, 108), (108, 116), (116, 124), (124, 136), (136, 148), (329, 337), (337, 345))
HEADERS_AT_ONCE = 8192  # headers checked per numpy pass (4 MB)
CHKSUM_DIGITS = 8 ** np.arange(5, -1, -1, dtype=np.int64)


class UnusualTar(Exception):
    """What fast_index leaves to tarfile."""


def fast_index(data, size: int) -> tuple[list[str], dict]:
    """tar_index of `data` (`size` bytes: a memory map) when its headers are plain ustar,
    GNU or v7 ones (what fastload's packer and most tools write): the 512-byte headers
    walked in Python, their checksums and number fields checked in bulk, ~15x faster than
    tarfile and exactly what it reads. UnusualTar for what it leaves to tarfile: GNU long
    names, pax headers, sparse or unknown members, a bad checksum or number, a header or
    member cut by the end of the file, an empty file."""
    enc = tarfile.ENCODING
    keys, members, heads = {}, {}, []
    pos = 0
    while True:
        if pos + BLOCK > size:
            if pos == size and pos:  # the end, without end-of-archive blocks
                break
            raise UnusualTar
        h = data[pos : pos + BLOCK]
        kind = h[156]
        if kind in REGULAR:
            if not kind and h == ZERO_BLOCK:  # the end-of-archive block
                break
            heads.append(h)
            if len(heads) == HEADERS_AT_ONCE:
                check_headers(heads)
                heads = []
            if h[135] == 0:  # "%011o\0", as tar tools write it
                try:
                    length = int(h[124:135], 8)
                except ValueError:
                    length = size_field(h)
            else:
                length = size_field(h)
            cut = h.find(0, 0, 100)
            member = h[: cut if cut >= 0 else 100].decode(enc, "surrogateescape")
            if not kind and member.endswith("/"):  # v7: a directory
                pos += BLOCK
                continue
            if h[345]:  # ustar: the name's leading folders
                cut = h.find(0, 345, 500)
                member = h[345 : cut if cut >= 0 else 500].decode(enc, "surrogateescape") + (
                    "/" + member
                )
            pos += BLOCK
            if length < 0 or pos + length > size:  # cut by the end of the file
                raise UnusualTar
            if "/" in member:
                key, ext = split_key(member)
            else:  # split_key's result without its calls
                key, _, ext = member.partition(".")
                ext = ext.lower()
            keys[key] = None  # a key seen before keeps its place
            by_key = members.get(ext)
            if by_key is None:
                members[ext] = by_key = {}
            by_key[key] = (pos, length)
            pos += -(-length // BLOCK) * BLOCK
        elif kind in NO_DATA:
            heads.append(h)
            pos += BLOCK
        elif h == ZERO_BLOCK:
            break
        else:  # GNU long names, pax headers, sparse files, unknown types
            raise UnusualTar
    check_headers(heads)
    return list(keys), members


def size_field(h: bytes) -> int:
    """A member's size as tarfile reads it (base-256 for a large one); UnusualTar for what
    it does not read."""
    try:
        return tarfile.nti(h[124:136])
    except tarfile.HeaderError:
        raise UnusualTar from None


def check_headers(heads: list[bytes]) -> None:
    """UnusualTar unless each header's checksum matches and its number fields read (what
    tarfile requires of a header before it reads on)."""
    if not heads:
        return
    h = np.frombuffer(b"".join(heads), np.uint8).reshape(-1, BLOCK)
    field = h[:, 148:156]
    total = h.sum(1, dtype=np.uint32).astype(np.int64) - field.sum(1, dtype=np.int64) + 256
    digits = field[:, :6] - np.uint8(48)
    plain = (digits <= 7).all(1) & (field[:, 6] == 0)  # "%06o\0 ", as tar tools write it
    stored = np.where(plain, (digits.astype(np.int64) * CHKSUM_DIGITS).sum(1), -1)
    for i in np.flatnonzero(~plain).tolist():
        try:
            stored[i] = tarfile.nti(heads[i][148:156])
        except tarfile.HeaderError:
            raise UnusualTar from None
    for i in np.flatnonzero(stored != total).tolist():  # the sum of signed bytes, by tarfile
        if stored[i] not in tarfile.calc_chksums(heads[i]):
            raise UnusualTar
    # mode, uid, gid, size, mtime, devmajor, devminor: octal digits up to a NUL read as a
    # number (tarfile's nts, int(.., 8)); any other byte, by tarfile
    numbers = np.concatenate([h[:, 100:148], h[:, 329:345]], axis=1)
    clean = ((numbers - np.uint8(48) <= 7) | (numbers == 0)).all(1)
    for i in np.flatnonzero(~clean).tolist():
        for lo, hi in NUMBERS:
            try:
                tarfile.nti(heads[i][lo:hi])
            except tarfile.HeaderError:
                raise UnusualTar from None


def field_members(field, members: dict) -> dict:
    """{key: (offset, length)} of the members holding `field` (any extension it reads)."""
    return {k: v for ext, by_key in members.items() if field.reads(ext) for k, v in by_key.items()}


def check_shard_file(path, url: str) -> None:
    """CorruptShard unless `path` is a tar shard with at least one member: what a server
    sent instead (an HTML error or login page with status 200, an empty body) is named."""
    size = os.path.getsize(path)
    try:
        if tar_index(path, url)[0]:
            return
        problem = "a tar file with no members"
    except CorruptShard as exc:
        problem = exc.user_message
    with open(path, "rb") as f:
        head = f.read(256)
    if head.lstrip()[:1] == b"<":
        problem = f"an HTML/XML page ({size} bytes, starting {head.lstrip()[:48]!r})"
    elif not size:
        problem = "an empty body"
    raise CorruptShard(
        f"{url} did not return a tar shard but {problem}: the server answered with an error "
        f"or login page, or the file is damaged. Nothing was cached under its name; check "
        f"storage.url and the server, then run again."
    )


def parse_column(field, raw: bytes, shard: str, key: str) -> int:
    """A sample's member of int field `field` (.cls: a whole number >= 0 as decimal text);
    StorageError naming the shard and the sample otherwise."""
    try:
        return field.coder.decode(raw)
    except ValueError as exc:
        ext = field.member_ext(raw)
        raise StorageError(
            f"shard {shard}: sample {key} has .{ext} {exc}. Fix the shard's .{ext} member, or "
            f"re-pack the data (python -m fastload.pack webdataset SRC DST)."
        ) from None


def scan_shard(path, name: str, schema: Schema) -> dict:
    """A manifest entry for a shard written by another tool: its samples (the keys that
    have the schema's first field) and the values of its int fields."""
    keys, members = tar_index(path, name)
    keys = [k for k in keys if k in field_members(schema[0], members)]
    columns = {}
    with open(path, "rb") as f:
        for field in schema.columns:
            found, values = field_members(field, members), []
            for key in keys:
                if key not in found:
                    ext = field.member_ext(b"")
                    raise StorageError(
                        f"shard {name}: sample {key} has no .{ext} member ({field.name})."
                    )
                f.seek(found[key][0])
                values.append(parse_column(field, f.read(found[key][1]), name, key))
            columns[field.name] = values
    return {"file": name, "count": len(keys), "bytes": os.path.getsize(path), "columns": columns}


class WdsReader(Reader):
    """The fields of one split's shards; a shard is fetched (or opened) on first use in each
    process, a few memory maps are kept open at a time."""

    _unpicklable = ("_maps", "_verified", "_bad", "_kept")

    def __init__(
        self,
        base: str,
        manifest: dict,
        *,
        cache: ShardCache | None,
        verify: bool = True,
        skip_corrupt: bool = False,
        retries: int = 3,
        retry_backoff_s: float = 1.0,
        storage_options: dict | None = None,
        shuffle_buffer: int = 1,
        remainder: str = "pad",
        cold_cache: bool = False,
    ):
        self.base = str(base)
        self.meta = {k: v for k, v in manifest.items() if k != "shards"}
        shards = manifest["shards"]
        self.urls = [s.get("url") or join(self.base, s["file"]) for s in shards]
        self.shard_sizes = np.asarray([s["count"] for s in shards], np.int64)
        self.shard_bytes = [s.get("bytes") for s in shards]
        self.shard_checks = [s.get("xxh3_64") for s in shards]
        self._starts = np.concatenate([[0], np.cumsum(self.shard_sizes)])
        self.schema = Schema.from_json(manifest["schema"])
        self._columns = {
            f.name: np.asarray(
                [v for s in shards for v in s["columns"][f.name]] or np.zeros(0), np.int64
            )
            for f in self.schema.columns
        }
        # array fields' element counts, where every shard's entry has them (`WdsWriter`)
        self._sizes = {
            f.name: np.asarray(
                [v for s in shards for v in s["sizes"][f.name]] or np.zeros(0), np.int64
            )
            for f in self.schema
            if f.coder.name == "array" and all(f.name in s.get("sizes", ()) for s in shards)
        }
        for name, values in {**self._columns, **self._sizes}.items():
            if len(values) != int(self._starts[-1]):
                raise StorageError(
                    f"{self.base}: the manifest's {name} values and counts disagree."
                )
        self.cache = cache
        self.verify, self.skip_corrupt = bool(verify), bool(skip_corrupt)
        self.retries, self.retry_backoff_s = int(retries), float(retry_backoff_s)
        self.storage_options = storage_options or {}
        self.shuffle_buffer, self.remainder = int(shuffle_buffer), remainder
        self.cold_cache = bool(cold_cache)
        avg = max(1.0, float(self.shard_sizes.mean())) if len(shards) else 1.0
        self.max_maps = max(4, int(self.shuffle_buffer / avg) + 3)
        self._maps = self._verified = self._bad = self._kept = None
        self._kept_bytes = 0
        self._init_stats()

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def classes(self) -> tuple[str, ...]:
        return tuple(self.meta.get("classes") or ())

    def identity(self) -> tuple[str, list]:
        """The manifest's shards (samples, checksums) and how they were packed, not their
        URLs (a node's own copy of a pack is the same pack)."""
        params = {k: v for k, v in (self.meta.get("params") or {}).items() if k != "derived_from"}
        what = {"classes": self.meta.get("classes"), "schema": self.meta.get("schema"),
                "params": params, "checks": self.shard_checks}  # fmt: skip
        return "webdataset", [json.dumps(what, sort_keys=True, default=str), self.shard_sizes]

    def column(self, name: str) -> np.ndarray:
        if name not in self._columns:
            self.field(name)  # names the fields there are
            raise StorageError(f"field {name!r} of {self.base} is not an int column.")
        return self._columns[name]

    def nonempty(self, name: str) -> np.ndarray | None:
        """From the manifest's `sizes` (no shard is read); None for a manifest without them."""
        self.field(name)
        sizes = self._sizes.get(name)
        return None if sizes is None else sizes > 0

    def locate(self, i: int) -> tuple[int, int]:
        """(shard, sample within it) of sample i."""
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        return k, i - int(self._starts[k])

    def describe(self, i: int, name: str | None = None) -> str:
        k, j = self.locate(i)
        why = f" (corrupt shard: {self._bad[k]})" if self._bad and k in self._bad else ""
        what = "" if name in (None, self.schema[0].name) else f"the {name} member of "
        return f"{what}{self.urls[k]} sample {j} of {int(self.shard_sizes[k])}{why}"

    # -- shards -----------------------------------------------------------------------------

    def _fetch(self, url: str, dst: Path) -> None:
        if is_remote(url):
            fetch(url, dst, self.storage_options, self.retries, self.retry_backoff_s)
        else:
            raise StorageError(f"{url}: a local shard is read in place, not fetched")

    def local_path(self, k: int) -> Path:
        """Shard k on this node: its cached copy (fetched now when missing) or the file."""
        url = self.urls[k]
        if self.cache is not None and is_remote(url):
            return self.cache.get(url, self.shard_bytes[k], self.shard_checks[k], self._fetch,
                                  lambda tmp: check_shard_file(tmp, url))  # fmt: skip
        path = Path(url.removeprefix("file://"))
        if not path.is_file():
            raise StorageError(
                f"shard {path} is missing (named by {self.base}); check storage.url or re-pack."
            )
        if self.verify and k not in self._verified:
            want, have = self.shard_bytes[k], path.stat().st_size
            if want is not None and have != want:
                cut = "truncated" if have < want else "longer than packed"
                raise CorruptShard(
                    f"corrupt shard {path} ({cut}: {have} bytes, the manifest says {want}); "
                    f"re-pack it or set dataset.skip_corrupt=true."
                )
            check = self.shard_checks[k]

            def verify_hash() -> None:
                if file_xxh3(path) != check:
                    raise CorruptShard(
                        f"corrupt shard {path} (its xxh3_64 differs from the manifest's); "
                        f"re-pack it (python -m fastload.pack verify {path.parent}) or set "
                        f"dataset.skip_corrupt=true."
                    )

            if check and self.cache is not None:  # once per node while the file is unchanged
                self.cache.verify_once(path, check, verify_hash)
            elif check:
                verify_hash()
            self._verified.add(k)
        return path

    def _open(self, k: int):
        """(memory map, {field: (offsets, lengths)}) of shard k, opened once per process;
        -1 where a sample has no member of that field. Int fields (.cls) have none: their
        values are the manifest's, checked against the members at the first opening of each
        version of the file (`_check_columns`). What an opening computed is kept when the
        map is closed (`_kept`), so opening the same file again only maps it."""
        if self._maps is None:
            self._maps, self._verified, self._bad = collections.OrderedDict(), set(), {}
            self._kept, self._kept_bytes = collections.OrderedDict(), 0
        got = self._maps.get(k)
        if got is not None:
            self._maps.move_to_end(k)
            return got
        for attempt in (0, 1):
            try:
                path = self.local_path(k)
                fh = open(path, "rb")  # noqa: SIM115
                break
            except FileNotFoundError:  # evicted by another process between fill and open
                if attempt:
                    raise
        with fh:
            version = self._version(k, path, os.fstat(fh.fileno()))
            kept = self._kept.pop(k, None)
            if kept is not None:
                self._kept_bytes -= kept[2]
                if kept[0] != version:  # the file was written since
                    kept = None
            fields = kept[1] if kept is not None else self._index(k, fh)
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        if version is not None:
            if kept is None:
                kept = (version, fields, sum(a.nbytes for col in fields.values() for a in col))
            self._kept[k] = kept
            self._kept_bytes += kept[2]
            while self._kept_bytes > KEEP_INDEX_BYTES and len(self._kept) > 1:
                self._kept_bytes -= self._kept.popitem(last=False)[1][2]
        self._maps[k] = got = (mm, fields)
        while len(self._maps) > self.max_maps:  # unmapped: RAM of evicted tmpfs shards returns
            self._maps.popitem(last=False)[1][0].close()
        return got

    def _version(self, k: int, path: Path, st: os.stat_result) -> tuple | None:
        """What identifies the bytes of shard k's file, for keeping its index (None: not
        kept). A local shard: its path and stat (inode, size, mtime, ctime). A shard in the
        node cache: its path (from the URL and the manifest's checksum), inode and size: the
        cache renames into that name only bytes with that checksum, and touches the mtime
        at each use (its LRU). One cached without a checksum (no manifest) is indexed again
        at each opening: a new fetch may hold other bytes."""
        if self.cache is not None and is_remote(self.urls[k]):
            if self.shard_checks[k] is None:
                return None
            return str(path), st.st_dev, st.st_ino, st.st_size
        return str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def _index(self, k: int, fh) -> dict:
        """{field: (offsets, lengths)} of shard k's samples from its tar headers, int32 where
        they fit; the int fields' members checked against the manifest and left out."""
        keys, members = file_index(fh, self.urls[k])
        first = field_members(self.schema[0], members)
        keys = [key for key in keys if key in first]
        if len(keys) != int(self.shard_sizes[k]):
            raise CorruptShard(
                f"corrupt shard {self.urls[k]}: {len(keys)} samples with a "
                f"{self.schema[0].name} member, the manifest says {int(self.shard_sizes[k])}."
            )
        small = os.fstat(fh.fileno()).st_size < 2**31  # every offset and length fits int32
        fields = {}
        for field in self.schema:
            found = field_members(field, members)
            at = [found.get(key, (-1, -1)) for key in keys]
            fields[field.name] = tuple(
                np.asarray([a[i] for a in at], np.int32 if small else np.int64) for i in (0, 1)
            )
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            self._check_columns(k, mm, fields, keys)
        return {name: v for name, v in fields.items() if name not in self._columns}

    def _check_columns(self, k: int, data, fields: dict, keys: list[str]) -> None:
        """The shard's int members (.cls) against the manifest's values, at the first opening
        of each version of its file in a process (a few microseconds a sample): a manifest
        written for other shards would train every sample under a wrong label."""
        start = int(self._starts[k])
        for field in self.schema.columns:
            offs, lens = fields[field.name]
            wants = self._columns[field.name][start : start + len(keys)].tolist()
            for j, (off, n) in enumerate(zip(offs.tolist(), lens.tolist(), strict=True)):
                if off < 0:
                    continue
                key = keys[j]
                value = parse_column(field, data[off : off + n], self.urls[k], key)
                want = wants[j]
                if value != want:
                    ext = field.member_ext(b"")
                    raise StorageError(
                        f"shard {self.urls[k]}: sample {key} has .{ext} {value}, but the manifest "
                        f"({self.base}) says {want}: the manifest was not written for these "
                        f"shards. Re-pack the data (python -m fastload.pack webdataset SRC "
                        f"DST), or remove the manifest to read the values from the shards' "
                        f".{ext} members."
                    )

    def _shard(self, k: int):
        """`_open(k)`, or None for a corrupt shard skipped under skip_corrupt."""
        if self._bad and k in self._bad:
            return None
        try:
            return self._open(k)
        except CorruptShard as exc:
            if not self.skip_corrupt:
                raise
            log.warning("skipping the samples of %s (dataset.skip_corrupt): %s", self.urls[k], exc)
            self._bad[k] = str(exc)
            return None

    def get(self, i: int, name: str):
        """Field `name` of sample i; for a sample of a corrupt shard skipped under
        skip_corrupt, b"" for an image field (undecodable: counted under describe(i)) and
        None for any other."""
        if name in self._columns:
            return int(self._columns[name][i])
        field = self.field(name)
        t0 = time.perf_counter()
        k, j = self.locate(i)
        got = self._shard(k)
        if got is None:
            return b"" if field.coder.image else None
        mm, fields = got
        offs, lens = fields[name]
        off, n = int(offs[j]), int(lens[j])
        if off < 0:
            raise StorageError(
                f"{self.describe(i)} has no .{field.member_ext(b'')} member ({name}); re-pack."
            )
        data = mm[off : off + n]
        self._account(n, t0)
        value = self.decode_field(field, data, i, name)
        sizes = self._sizes.get(name)
        if sizes is not None and np.size(value) != sizes[i]:  # what nonempty() told training
            raise StorageError(
                f"{self.describe(i, name)} holds {np.size(value)} values, but the manifest "
                f"({self.base}) says {int(sizes[i])}: the manifest was not written for these "
                f"shards. Re-pack the data (python -m fastload.pack webdataset SRC DST)."
            )
        return value

    def _evict(self) -> None:
        """cold_cache: a streamed split's shards leave the node cache (the epoch fetches them
        again: it measures the network); local shards leave the page cache."""
        if self.cache is None or not is_remote(self.base):
            return super()._evict()
        files = self.store_files()
        for f in files:
            Path(f).unlink(missing_ok=True)
        log.info(
            "cold cache: removed %d shard(s) of %s from %s", len(files), self.base, self.cache.dir
        )

    def store_root(self) -> str:
        if self.cache is not None and is_remote(self.base):
            return str(self.cache.dir)
        return self.base.removeprefix("file://")

    def store_files(self) -> list[str]:
        if self.cache is not None and is_remote(self.base):
            paths = [
                self.cache.path(u, c) for u, c in zip(self.urls, self.shard_checks, strict=True)
            ]
            return [str(p) for p in paths if p.is_file()]
        return [u.removeprefix("file://") for u in self.urls]


# -- the storage ------------------------------------------------------------------------------


def read_manifest(url: str, storage_options=None, retries=3, backoff_s=1.0) -> dict | None:
    """A manifest by URL or path (None when there is none), checked for format."""
    if is_remote(url):

        def once():
            fs = filesystem(url, storage_options)
            try:
                return fs.cat_file(url)
            except FileNotFoundError:
                return None

        raw = with_retries("read manifest", url, once, retries, backoff_s)
    else:
        path = Path(url.removeprefix("file://"))
        raw = path.read_bytes() if path.is_file() else None
    if raw is None:
        return None
    try:
        meta = json.loads(raw)
    except ValueError as exc:
        raise StorageError(f"{url} is not a readable manifest ({exc}); re-pack.") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise StorageError(
            f"{url} is not a {FORMAT} v{VERSION} manifest (it says {meta.get('format')} "
            f"v{meta.get('version')}); write the shards with python -m fastload.pack webdataset."
        )
    return meta


def default_cache_dir() -> str:
    return (
        "/dev/shm/fastload-wds"
        if os.path.isdir("/dev/shm")
        else join(tempfile.gettempdir(), "fastload-wds")
    )


class WebDatasetStorage(PackedStorage):
    """storage=webdataset (conf/storage/webdataset.yaml)."""

    format, marker, name = "webdataset", MANIFEST, "webdataset"

    def __init__(
        self,
        url=None,
        path=None,
        cache_dir=None,
        cache_gb: float = 16.0,
        shuffle_buffer: int = 2000,
        remainder: str = "pad",
        retries: int = 3,
        retry_backoff_s: float = 1.0,
        storage_options=None,
        shard_mb: float = 256,
        shard_samples: int | None = None,
        kind: str = "jpeg",
        max_side: int | None = None,
        quality: int = 90,
        verify: bool = True,
        skip_corrupt: bool = False,
        auto_pack: bool = True,
        cold_cache: bool = False,
    ):
        super().__init__(path=path, verify=verify, auto_pack=auto_pack, cold_cache=cold_cache)
        if kind != "jpeg":
            raise ConfigError(
                f"storage.kind={kind!r}: webdataset shards hold encoded images (jpeg); for "
                f"raw pixels use storage=shards storage.kind=raw."
            )
        check_pack_numbers(max_side, quality, shard_mb=shard_mb, shard_samples=shard_samples)
        if remainder not in ("pad", "drop"):
            raise ConfigError(f"storage.remainder={remainder!r}: use pad or drop.")
        if int(shuffle_buffer) < 1:
            raise ConfigError(
                f"storage.shuffle_buffer={shuffle_buffer}: use 1 (no shuffle) or more."
            )
        self.url = url
        self.cache_dir = cache_dir or default_cache_dir()
        self.cache_bytes = int(float(cache_gb) * 1e9)
        self.shuffle_buffer, self.remainder = int(shuffle_buffer), remainder
        self.retries, self.retry_backoff_s = int(retries), float(retry_backoff_s)
        self.storage_options = dict(storage_options or {})
        self.shard_mb, self.shard_samples = float(shard_mb), shard_samples
        self.kind, self.max_side, self.quality = kind, max_side, int(quality)
        self.skip_corrupt = bool(skip_corrupt)

    # -- PackedStorage: the local pack (url null) and the pack command -------------------------

    def default_path(self, root) -> str:
        tag = f"{self.max_side}px-q{self.quality}" if self.max_side else "orig"
        return f"{os.fspath(root).rstrip('/')}.packs/webdataset-{tag}"

    def writer(self, folder: Path, schema: Schema) -> WdsWriter:
        return WdsWriter(folder, schema, int(self.shard_mb * (1 << 20)), self.shard_samples)

    def reader(self, split_dir: Path) -> WdsReader:
        manifest = read_manifest(str(split_dir / MANIFEST))
        return self._reader(str(split_dir), manifest)

    def pack_options(self) -> dict:
        # shuffled: the stream's order mixes classes only within a window of consecutive
        # samples, so records written class by class would train on few classes per batch
        return {"kind": "jpeg", "max_side": self.max_side, "quality": self.quality,
                "order": "shuffled"}  # fmt: skip

    def cli_options(self) -> list[str]:
        opts = ["--shard-mb", f"{self.shard_mb:g}"]
        if self.shard_samples:
            opts += ["--shard-samples", str(self.shard_samples)]
        if self.max_side:
            opts += ["--max-side", str(self.max_side), "--quality", str(self.quality)]
        return opts

    # -- streaming ------------------------------------------------------------------------

    def _reader(self, base: str, manifest: dict) -> WdsReader:
        return WdsReader(
            base,
            manifest,
            cache=ShardCache(self.cache_dir, self.cache_bytes),
            verify=self.verify,
            skip_corrupt=self.skip_corrupt,
            retries=self.retries,
            retry_backoff_s=self.retry_backoff_s,
            storage_options=self.storage_options,
            shuffle_buffer=self.shuffle_buffer,
            remainder=self.remainder,
            cold_cache=self.cold_cache,
        )

    def split_url(self, split: str) -> str:
        url = self.url
        if hasattr(url, "keys"):
            if split not in url:
                raise ConfigError(
                    f"storage.url names the splits {sorted(url)}, not {split!r}: add "
                    f"storage.url.{split}=<folder or shard pattern>."
                )
            return str(url[split])
        return (
            join(str(url), split)
            if not _is_pattern(str(url))
            else str(url).replace("{split}", split)
        )

    def prepare(self, root, splits, skip_corrupt: bool = False) -> None:
        if self.url is None:
            return super().prepare(root, splits, skip_corrupt=skip_corrupt)
        for split in dict.fromkeys(splits):  # derive the manifests of foreign shards once
            self.open(root, split)

    def open(self, root, split: str) -> Reader:
        if self.url is None:
            return super().open(root, split)
        where = self.split_url(split)
        opts = (self.storage_options, self.retries, self.retry_backoff_s)
        if not _is_pattern(where):
            manifest = read_manifest(join(where, MANIFEST), *opts)
            if manifest is None:
                raise StorageError(
                    f"no {MANIFEST} at {join(where, MANIFEST)} (storage.url={self.url}, split "
                    f"{split}): write the shards with `python -m fastload.pack webdataset SRC "
                    f"DST` and upload DST, or give storage.url a shard pattern such as "
                    f"{join(where, 'shard-{000000..000009}.tar')}."
                )
            return self._reader(where, manifest)
        schema = as_layout(root).schema
        return self._reader(parent(where), self._pattern_manifest(where, opts, schema))

    def _pattern_manifest(self, pattern: str, opts, schema: Schema) -> dict:
        urls = expand_braces(pattern)
        folder = parent(urls[0])
        beside = read_manifest(join(folder, MANIFEST), *opts)
        if beside is not None:
            by_name = {s["file"]: s for s in beside["shards"]}
            names = [u.rsplit("/", 1)[-1] for u in urls]
            if all(parent(u) == folder for u in urls) and all(n in by_name for n in names):
                return {**beside, "count": None, "shards": [by_name[n] for n in names]}
        # Foreign shards: read each once (into the cache when remote) and keep the result.
        cache = ShardCache(self.cache_dir, self.cache_bytes)
        derived = (
            cache.ready() / f"{xxhash.xxh3_64_hexdigest(f'v{VERSION} {pattern}'.encode())}.json"
        )
        with locked(derived.with_suffix(".lock")):
            if derived.is_file():
                return json.loads(derived.read_text(encoding="utf-8"))
            t0 = time.perf_counter()
            probe = WdsReader(
                folder,
                {
                    "schema": schema.to_json(),
                    "shards": [
                        {"url": u, "count": 0, "columns": {f.name: [] for f in schema.columns}}
                        for u in urls
                    ],
                },
                cache=cache,
                verify=False,
                retries=self.retries,
                retry_backoff_s=self.retry_backoff_s,
                storage_options=self.storage_options,
            )
            shards = [
                {**scan_shard(probe.local_path(k), u, schema), "url": u} for k, u in enumerate(urls)
            ]
            top = max(
                (check_label_range(shards, f) for f in schema.columns if f.classes), default=-1
            )
            manifest = {
                "format": FORMAT,
                "version": VERSION,
                "schema": schema.to_json(),
                "count": sum(s["count"] for s in shards),
                "classes": [str(c) for c in range(top + 1)],
                "params": {"derived_from": pattern},
                "shards": shards,
            }
            # whole or not at all: a cut one (a full disk) would be read back as broken JSON
            write_json_atomic(derived, manifest)
            log.info(
                "%s: no manifest beside the shards; read %d shards (%d samples) in %.1f s, "
                "kept as %s",
                pattern, len(urls), manifest["count"], time.perf_counter() - t0, derived,
            )  # fmt: skip
            return manifest


def check_label_range(shards: list[dict], field) -> int:
    """The largest value of class field `field` (.cls) in shards without a manifest (the
    classes are 0..that); a single label far beyond all others (999999 among 0..2) is a
    damaged .cls, named, not a million classes."""
    values = sorted({t for s in shards for t in s["columns"][field.name]})
    if len(values) >= 2 and values[-1] >= 1000 and values[-1] > 10 * (values[-2] + 1):
        shard = next(s for s in shards if values[-1] in s["columns"][field.name])
        raise StorageError(
            f"shard {shard['url']}: a .cls label {values[-1]} far beyond all others (up to "
            f"{values[-2]}): a damaged label? Class indices run 0..N-1. Fix that sample's .cls "
            f"member, or write the shards with a manifest (python -m fastload.pack webdataset "
            f"SRC DST) that names the classes."
        )
    return values[-1] if values else -1


def _is_pattern(url: str) -> bool:
    return url.endswith(".tar") or bool(_BRACE.search(url.replace("{split}", "")))


def verify_split(split_dir) -> tuple[int, list[str]]:
    """`python -m fastload.pack verify` for one webdataset split: every shard's size, xxh3_64
    and tar headers against the manifest, and its int members (.cls) against the manifest's
    values (`columns`: the labels training takes from the manifest, as the reader checks
    at open). Returns (samples checked, problems)."""
    split_dir = Path(split_dir)
    try:
        meta = read_manifest(str(split_dir / MANIFEST))
        schema = Schema.from_json(meta["schema"])
    except StorageError as exc:
        return 0, [str(exc)]
    problems = []
    for s in meta["shards"]:
        f = split_dir / s["file"]
        if not f.is_file():
            problems.append(f"{f} is missing")
            continue
        size = f.stat().st_size
        if size != s["bytes"] or file_xxh3(f) != s["xxh3_64"]:
            problems.append(f"{f}: {size} bytes, packed {s['bytes']}; its xxh3_64 differs")
            continue
        try:
            keys, members = tar_index(f)
        except StorageError as exc:
            problems.append(str(exc))
            continue
        if len(keys) != s["count"]:  # a pack's every member belongs to one of its records
            problems.append(f"{f}: {len(keys)} samples, the manifest says {s['count']}")
            continue
        problems += column_problems(f, schema, s, keys, members)
    return int(meta["count"]), problems


def column_problems(path: Path, schema: Schema, shard: dict, keys, members) -> list[str]:
    """The samples of a shard whose int member (.cls) is missing or differs from the
    manifest's value: one line per field, naming the shard and the first such sample."""
    problems = []
    with open(path, "rb") as fh:
        for field in schema.columns:
            found, want = field_members(field, members), shard["columns"].get(field.name, [])
            ext = field.member_ext(b"")
            wrong = []
            for key, value in zip(keys, want, strict=False):
                if key not in found:
                    wrong.append(f"sample {key} has no .{ext} member, the manifest says {value}")
                    continue
                fh.seek(found[key][0])
                try:
                    have = field.coder.decode(fh.read(found[key][1]))
                except ValueError as exc:
                    wrong.append(f"sample {key} has .{ext} {exc}")
                    continue
                if have != int(value):
                    wrong.append(f"sample {key} has .{ext} {have}, the manifest says {value}")
            if len(want) != len(keys):
                wrong.append(f"the manifest lists {len(want)} {field.name} values for "
                             f"{len(keys)} samples")  # fmt: skip
            if wrong:
                more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
                problems.append(f"{path}: {wrong[0]}{more}")
    return problems


__all__ = ["KINDS", "WebDatasetStorage", "WdsReader", "WdsWriter", "verify_split"]
