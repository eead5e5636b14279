"""The node-local shard cache of storage=webdataset, and fetching a shard with retries.

One folder per node and user, <cache_dir>/<uid> (0700, in a storage.cache_dir made 1777 when
created here, as /dev/shm is: fastload/storage/user_dir.py), shared by every rank and
DataLoader worker of that user on the node; another user of the node has a folder of their
own, and a cache_dir another user made that this one may not write to is one error naming
it and the fix. Shards this user cached at <cache_dir>/<key> (before each user had a folder)
are moved into it. A shard is fetched by whichever process needs it first; the others wait
on its lock and then read the same file (<dir>: this user's folder):

    <dir>/<key>             a complete, verified shard (key: a hash of its URL and of the
                            manifest's checksum when there is one, + its name, ending in .tar)
    <dir>/<key>.lock        flock(2) held while one process fetches it
    <dir>/.<key>.tmp-<host>~<pid namespace>-<pid>
                            the download in progress (fastload/atomic.py's temporary name),
                            renamed to <key> once its size and checksum match the manifest
                            (never read under its final name half-written)
    <dir>/<key>.bad         why a shard is corrupt (the other processes read the verdict
                            instead of fetching it again, for a few minutes)
    <dir>/verified/<state>  a local shard (read in place, not cached) whose xxh3_64 a
                            process of this node checked against the manifest: "ok" once
                            it matched; <state> hashes its real path, device, inode, size,
                            mtime, ctime and the manifest's checksum, so a shard written
                            since (or replaced) is hashed again (`verify_once`); a few
                            bytes each, not evicted (the default /dev/shm empties at boot)

Before each fill, downloads left by processes that are gone (killed mid-fetch: up to a
whole shard each, which cache_gb does not count) are removed, as atomic.is_stale judges
them: a dead pid of this host and PID namespace at once, one of another host or container
after a day unchanged; so are `.bad` verdicts twice as old as BAD_VERDICT_S, which no
process takes any more. Lock files stay: they are empty (an inode each), and removing one
that another process has open would let two processes fetch the same shard at once.

A shard re-packed and uploaded to the same URL has a new checksum in its manifest, so a new
key: it is fetched again and the old copy ages out of the cache like any unused shard.
Shards without a manifest (a pattern over another tool's shards) have no checksum: their
key is the URL alone, and a changed shard behind an old URL is not noticed (clear the cache
folder after replacing such shards).

Size limit: before a fill, the least recently used complete shards (by mtime, touched at
each process's first use) are removed until the new one fits both in storage.cache_gb (each
user's folder on its own) and in
the folder's file system (its free space: a 64 MB /dev/shm holds less than the default
16 GB). A shard that does not fit even then, or a download that still finds the disk full,
is one error naming storage.cache_dir, not a network failure retried. Only files named as
the cache names its shards (<12 hex digits>-<name>.tar) are counted and removed: a cache_dir shared
with other files (storage.cache_dir=/scratch) loses nothing else. A process that still maps
a removed shard keeps reading it (an unlinked file lives until unmapped); one that needs it
later fetches it again. Readers map only a few shards at a time, so the RAM of removed
shards on tmpfs comes back.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import stat
import time
from pathlib import Path

import xxhash

from fastload.atomic import is_no_space, is_stale, temp_path
from fastload.errors import StorageError
from fastload.host import size_text
from fastload.storage.user_dir import make_user_folder, user_folder

log = logging.getLogger("fastload")

REMOTE = ("http://", "https://", "s3://")
ENTRY = re.compile(r"[0-9a-f]{12}-[^/]*\.tar")  # a cached shard's name (ShardCache.key)


class CorruptShard(StorageError):
    """A shard whose size, checksum or tar structure is wrong (dataset.skip_corrupt may skip
    its samples); a shard that cannot be fetched at all is a plain StorageError."""


def is_remote(url: str) -> bool:
    return str(url).startswith(REMOTE)


def file_xxh3(path) -> str:
    """xxh3_64 (hex) of a whole file, read in 16 MB chunks: the manifest's shard checksum."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def shard_state(path, check: str) -> tuple[str, tuple]:
    """(marker name, the stat fields it covers) of a local shard as it is now and the
    checksum its manifest expects (`ShardCache.verify_once`)."""
    st = os.stat(path)
    fields = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    what = "\0".join(map(str, (os.path.realpath(path), *fields, check)))
    return xxhash.xxh3_128_hexdigest(what.encode()), fields


def describe_error(exc: BaseException, url: str = "") -> str:
    """The HTTP status or S3 error code of a failed fetch, when the exception carries one
    (fsspec turns HTTP 404 and S3 NoSuchKey into FileNotFoundError)."""
    if isinstance(exc, FileNotFoundError):
        return f"{'S3 NoSuchKey' if url.startswith('s3://') else 'HTTP 404'}: not found"
    status = getattr(exc, "status", None) or getattr(exc, "code", None)
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        err = response.get("Error", {})
        status = f"S3 {err.get('Code')}: {err.get('Message', '')}".strip()
    head = f"HTTP {status}" if isinstance(status, int) else (status or "")
    text = f"{type(exc).__name__}: {exc}"
    return f"{head} ({text})" if head else text


def _not_found(exc: BaseException) -> bool:
    return isinstance(exc, FileNotFoundError) or getattr(exc, "status", None) in (403, 404)


def filesystem(url: str, storage_options: dict | None = None):
    """The fsspec file system of a URL (fsspec caches instances per process and clears the
    cache after a fork, so workers get their own)."""
    try:
        import fsspec
    except ImportError:
        raise StorageError(
            "storage=webdataset needs fsspec: pip install fsspec (aiohttp for http(s) URLs)"
        ) from None
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    try:
        return fsspec.filesystem(protocol, **(storage_options or {}))
    except ImportError as exc:
        extra = {"s3": "pip install 'fastload[s3]' (s3fs)", "http": "pip install aiohttp"}
        need = extra.get(protocol, extra["http"] if protocol == "https" else f"({exc})")
        raise StorageError(f"storage.url {url}: {protocol}:// needs {need}.") from None


def with_retries(what: str, url: str, fn, retries: int, backoff_s: float):
    """fn() with up to `retries` more tries after a failure, sleeping backoff_s * 2**k;
    not-found (404 / NoSuchKey) fails at once, and a full local disk is raised as it is (no
    network error: the caller names the folder). The final error names the URL and the
    cause."""
    errors = []
    for attempt in range(retries + 1):
        try:
            return fn()
        except StorageError:
            raise
        except Exception as exc:  # network, HTTP, S3: all named below
            if is_no_space(exc):
                raise
            errors.append(describe_error(exc, url))
            if _not_found(exc):
                break
            if attempt < retries:
                delay = backoff_s * 2**attempt
                log.warning(
                    "%s %s failed (%s); retry %d/%d in %.1f s",
                    what, url, errors[-1], attempt + 1, retries, delay,
                )  # fmt: skip
                time.sleep(delay)
    raise StorageError(
        f"cannot {what} {url} after {len(errors)} attempt(s): {errors[-1]}. Check that the "
        f"server or bucket is reachable from this node and that storage.url is right "
        f"(storage.retries / storage.retry_backoff_s set how hard to try)."
    )


def fetch(url: str, dst: Path, storage_options=None, retries=3, backoff_s=1.0) -> None:
    """Download url to dst (streamed, not held in memory), with retries."""

    def once():
        fs = filesystem(url, storage_options)
        fs.get_file(url, str(dst))

    with_retries("fetch shard", url, once, retries, backoff_s)


FS_SLACK = 16 << 10  # room a file takes beyond its bytes (blocks, pages), kept free
BAD_VERDICT_S = 300.0  # how long a node's processes take a `.bad` verdict instead of fetching


def fresh(verdict: Path) -> bool:
    try:
        return time.time() - verdict.stat().st_mtime < BAD_VERDICT_S
    except OSError:
        return False


@contextlib.contextmanager
def locked(path: Path):
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


class ShardCache:
    """A node-local folder of fetched shards with a size limit (see the module docstring)."""

    def __init__(self, directory, limit_bytes: int):
        self.base = Path(directory)  # storage.cache_dir, shared by the node's users
        self.dir = user_folder(directory)  # <cache_dir>/<uid>: this user's shards
        self.limit = int(limit_bytes)
        self.fetched = 0  # shards this process downloaded (the others it found filled)

    def ready(self) -> Path:
        """This user's folder of shards, created (fastload/storage/user_dir.py: cache_dir
        made 1777, each user's folder 0700 and their own, or a StorageError naming
        storage.cache_dir and the fix)."""
        mine = make_user_folder(
            self.base,
            "storage.cache_dir",
            "cache shards there",
            "cached shards",
            f"/dev/shm/fastload-wds-{os.geteuid()}",
        )
        self.adopt_earlier()
        return mine

    def adopt_earlier(self) -> None:
        """Move this user's own shards cached at <cache_dir>/<key> (where each user's shards
        went before they had a folder of their own) into this user's folder: used and
        evicted there, not left holding RAM on tmpfs that no cache counts."""
        with contextlib.suppress(OSError):
            for p in self.base.iterdir():
                if not ENTRY.fullmatch(p.name):
                    continue
                with contextlib.suppress(OSError):
                    st = p.lstat()
                    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                        if (self.dir / p.name).exists():
                            p.unlink()
                        else:
                            os.rename(p, self.dir / p.name)

    @staticmethod
    def key(url: str, check: str | None = None) -> str:
        """`<12 hex>-<name>.tar`: the hash covers the manifest's checksum when known, so a
        shard re-uploaded under the same URL is a new entry, not the old copy; the fixed
        suffix is what eviction recognises as the cache's own (ENTRY)."""
        name = url.rsplit("/", 1)[-1]
        what = url if check is None else f"{url} xxh3_64={check}"
        suffix = "" if name.endswith(".tar") else ".tar"
        return f"{xxhash.xxh3_64_hexdigest(what.encode())[:12]}-{name}{suffix}"

    def path(self, url: str, check: str | None = None) -> Path:
        return self.dir / self.key(url, check)

    def verify_once(self, path: Path, check: str, verify_fn) -> None:
        """`verify_fn()` (which raises CorruptShard) for the local shard `path` unless a
        process of this node verified it as it is now: a local split is read in place, and
        with the sampler's block shuffle every DataLoader worker of every rank opens nearly
        every shard, each hashing the whole split again (each epoch, without persistent
        workers). The first process hashes it under the marker's lock while the others wait
        and then find "ok"; a shard that fails leaves no "ok", so each process that opens it
        hashes it and says so. Where the cache folder cannot hold markers, each process
        verifies on its own as before."""
        try:
            folder = self.ready() / "verified"
            folder.mkdir(exist_ok=True)
            state, before = shard_state(path, check)
            marker = open(folder / state, "a+b")  # noqa: SIM115
        except (OSError, StorageError) as exc:
            log.debug("verifying %s in this process only (no node marker: %s)", path, exc)
            verify_fn()
            return
        with marker:
            try:
                fcntl.flock(marker.fileno(), fcntl.LOCK_EX)
            except OSError as exc:  # a file system without locks
                log.debug("verifying %s in this process only (no lock: %s)", path, exc)
                verify_fn()
                return
            marker.seek(0)
            if marker.read() == b"ok\n":
                return
            verify_fn()
            if shard_state(path, check)[1] == before:  # not rewritten while it was hashed
                marker.truncate(0)
                marker.write(b"ok\n")

    def get(self, url: str, expect_bytes, expect_check, fetch_fn, check_fn=None) -> Path:
        """The local path of url's shard: filled by `fetch_fn(url, tmp)` under the shard's
        lock when missing (size and checksum checked before the rename, and `check_fn(tmp)`,
        which raises CorruptShard for what is not a shard: nothing unverified is kept under
        the shard's name), touched for LRU. A corrupt shard raises StorageError and leaves a
        `.bad` verdict that the node's other processes take for BAD_VERDICT_S instead of
        fetching it again; after that it is fetched anew (the server may have been fixed)."""
        final = self.path(url, expect_check)
        bad = final.with_name(final.name + ".bad")
        if not final.is_file():
            self.ready()
            with locked(final.with_name(final.name + ".lock")):
                if fresh(bad):
                    raise CorruptShard(bad.read_text(encoding="utf-8"))
                bad.unlink(missing_ok=True)
                if not final.is_file():
                    self._fill(url, final, bad, expect_bytes, expect_check, fetch_fn, check_fn)
        with contextlib.suppress(OSError):
            os.utime(final)
        return final

    def _fill(self, url, final, bad, expect_bytes, expect_check, fetch_fn, check_fn) -> None:
        self.remove_leftovers()
        need = int(expect_bytes or 0)
        if need:
            self.room_for(url, need, final)
        tmp = temp_path(final)
        t0 = time.perf_counter()
        try:
            try:
                fetch_fn(url, tmp)
            except OSError as exc:
                if not is_no_space(exc):
                    raise
                # the other processes' downloads took the room counted on: evict, try once more
                need = max(need, tmp.stat().st_size if tmp.exists() else 0)
                tmp.unlink(missing_ok=True)
                self.room_for(url, need, final)
                try:
                    fetch_fn(url, tmp)
                except OSError as again:
                    if not is_no_space(again):
                        raise
                    free = shutil.disk_usage(self.dir).free
                    raise StorageError(self.no_room(url, need, free)) from None
            size = tmp.stat().st_size
            problem = None
            if expect_bytes is not None and size != expect_bytes:
                cut = "truncated" if size < expect_bytes else "longer than packed"
                problem = f"{cut}: {size} bytes, the manifest says {expect_bytes}"
            elif expect_check is not None and file_xxh3(tmp) != expect_check:
                problem = f"its xxh3_64 is {file_xxh3(tmp)}, the manifest says {expect_check}"
            if problem:
                message = (
                    f"corrupt shard {url} ({problem}). Re-upload it (python -m fastload.pack "
                    f"webdataset SRC DST writes it again), or set dataset.skip_corrupt=true to "
                    f"skip and count its samples."
                )
                bad.write_text(message, encoding="utf-8")
                raise CorruptShard(message)
            if check_fn is not None:
                try:
                    check_fn(tmp)
                except CorruptShard as exc:
                    bad.write_text(exc.user_message, encoding="utf-8")
                    raise
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        self.fetched += 1
        dt = time.perf_counter() - t0
        log.debug("cached %s (%.1f MB in %.2f s) as %s", url, size / 1e6, dt, final)

    def entries(self) -> list[tuple[Path, os.stat_result]]:
        """The complete shards in the folder: only names `key` makes (locks, verdicts,
        derived manifests, downloads in progress and anyone else's files are not shards)."""
        out = []
        for p in self.dir.iterdir() if self.dir.is_dir() else ():
            if not ENTRY.fullmatch(p.name):
                continue
            with contextlib.suppress(FileNotFoundError):
                out.append((p, p.stat()))
        return out

    def remove_leftovers(self) -> None:
        """Remove the downloads of processes that are gone and the expired `.bad` verdicts
        (the module docstring says which)."""
        for p in self.dir.iterdir() if self.dir.is_dir() else ():
            name = p.name
            if name.startswith(".") and ".tmp-" in name:
                final = self.dir / name[1:].rsplit(".tmp-", 1)[0]
                if ENTRY.fullmatch(final.name) and is_stale(p, final):
                    with contextlib.suppress(OSError):
                        size = p.stat().st_size
                        p.unlink()
                        log.info("shard cache %s: removed %s (%.1f MB), the download of a "
                                 "process that is gone", self.dir, name, size / 1e6)  # fmt: skip
            elif name.endswith(".bad") and ENTRY.fullmatch(name[:-4]):
                with contextlib.suppress(OSError):  # expired, and no reader is between
                    if time.time() - p.stat().st_mtime > 2 * BAD_VERDICT_S:  # fresh() and read
                        p.unlink()

    def room_for(self, url: str, need: int, keep: Path) -> None:
        """Make room for a `need`-byte shard, or say that there is none (StorageError)."""
        free = self.make_room(need, keep)
        if need + FS_SLACK > free:
            raise StorageError(self.no_room(url, need, free))

    def no_room(self, url: str, need: int, free: int) -> str:
        return (
            f"the shard cache storage.cache_dir={self.base} has no room for {url}: it needs "
            f"{size_text(need)} and {size_text(free)} is free on that file system with the "
            f"other cached shards removed (storage.cache_gb={self.limit / 1e9:g} is the "
            f"cache's own limit). Point storage.cache_dir at a local disk with room for "
            f"several shards and storage.cache_gb at most its free space, or give this one "
            f"more room (Docker: a larger --shm-size for /dev/shm), or pack smaller shards "
            f"(--shard-mb)."
        )

    def make_room(self, need: int, keep: Path) -> int:
        """Remove least recently used shards until `need` more bytes fit both in the limit
        (storage.cache_gb) and in the file system's free space. Returns the free space then
        (counting the removed shards' bytes free: one still mapped by a reader frees its
        RAM on tmpfs when unmapped)."""
        with locked(self.dir / ".evict.lock"):
            files = sorted(self.entries(), key=lambda e: e[1].st_mtime)
            used = sum(st.st_size for _, st in files)
            free = shutil.disk_usage(self.dir).free
            for p, st in files:
                if used + need <= self.limit and need + FS_SLACK <= free:
                    break
                if p == keep:
                    continue
                p.unlink(missing_ok=True)
                used -= st.st_size
                free += st.st_size
                log.debug(
                    "shard cache %s: evicted %s (%.1f MB)", self.dir, p.name, st.st_size / 1e6
                )
            if used + need > self.limit:
                log.warning(
                    "shard cache %s: a %.1f MB shard does not fit in storage.cache_gb=%.3g "
                    "beside the shards in use; raise storage.cache_gb",
                    self.dir, need / 1e6, self.limit / 1e9,
                )  # fmt: skip
            return free
