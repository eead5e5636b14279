"""storage=tmpfs: stage the dataset into a RAM-backed folder once per node, train from there.

    prepare (local rank 0, the other ranks wait at a barrier):
      1. list the source splits (folders, empty ones too, and files with sizes): the manifest;
      2. reuse <target_dir>/<uid>/<name> (in this user's own folder: `user_folder`) if it
         holds the requested splits as the source has them now (its manifest, under those
         splits' paths, matches: each file's size, modification and change times and
         inode; other splits it holds do not count) and its files match the manifest
         (sizes), else
      3. check room: free space and inodes of target_dir (a tmpfs's size and nr_inodes),
         available RAM (tmpfs pages are RAM and count against a container's memory limit:
         cgroup v2 memory.max / v1 limit_in_bytes), and
         refuse with the numbers and the fix when the dataset does not fit. A copy already
         there (outdated, damaged, or without a requested split) is replaced by one holding
         its splits too, built beside it when both fit, so that a run reading it keeps its
         files; else it is removed first, unless another run on this node uses it (see
         finish below: then the staging is refused, saying so);
      4. copy in parallel (threads: the copy is I/O and syscalls, the GIL is released) into
         a temporary sibling folder (fastload/atomic.py), with a progress bar;
      5. verify the copy against the manifest, write the manifest, rename into place (over
         the copy it replaces).
    An interrupted copy leaves only the temporary folder, which is never read and is removed
    by the next run on this host (when its process is gone). Of two runs on one node that
    stage one dataset at once, one copies and the other waits for it (`staging_lock`), then
    uses its copy if it holds the splits it needs (step 2), else replaces it by one holding
    the splits of both. Processes the lock does not reach (another host on a shared
    target_dir) may copy at once: the one that finishes second, or runs out of room, uses
    the other's copy if it holds the splits it needs, else stops saying so.

    finish (local rank 0, at the end of the run): storage.cleanup=true removes the copy
    unless another run on this node is still using it. Each run holds a shared lock on
    <target_dir>/<uid>/<name>.users from before staging to its end (flock: released by the kernel
    when a process dies); cleanup removes the copy only under the exclusive lock, so the last
    run to finish removes it and no run loses its files mid-epoch to another's cleanup.

The storage itself is storage=disk on the staged folder: identical bytes, order and targets.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import sys
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastload.atomic import (
    AlreadyBuilt,
    building,
    folder_id,
    is_disk_full,
    no_space_message,
    remove_stale,
    temp_path,
)
from fastload.data.folder import IMG_EXTENSIONS, walk_once, warn_skipped
from fastload.data.layouts import as_layout
from fastload.errors import ConfigError, StorageError
from fastload.host import available_ram, memory_limit_available, size_text
from fastload.storage import user_dir
from fastload.storage.base import Storage
from fastload.storage.disk import SourceReader
from fastload.storage.user_dir import user_folder

log = logging.getLogger("fastload")

MANIFEST = ".fastload-staged.json"
PAGE = 4096


def staged_name(root) -> str:
    """`<root basename>-<hash of the absolute root>`: two datasets never share a folder."""
    root = os.path.abspath(os.fspath(root)).rstrip("/")
    return f"{os.path.basename(root)}-{hashlib.sha1(root.encode()).hexdigest()[:8]}"


def staged_root(root, target_dir) -> Path:
    return user_folder(target_dir) / staged_name(root)


def earlier_root(root, target_dir) -> Path:
    """Where a copy was staged before copies went into a folder per user."""
    return Path(target_dir) / staged_name(root)


def check_apart(root, target_dir) -> None:
    """Refuse a folder of copies (<target_dir>/<uid>) inside dataset.root, where each copy
    would become part of the dataset (a class folder, staged again one level deeper by every
    run), or a dataset.root inside it (a staged copy for a source)."""
    src = Path(os.path.realpath(root))
    mine = Path(os.path.realpath(user_folder(target_dir)))
    if mine == src or src in mine.parents:
        raise ConfigError(
            f"storage.target_dir={target_dir} is inside dataset.root={root}: the staged copy "
            f"({mine}) would become part of the dataset it copies (a class folder, copied "
            f"again one level deeper by every run). Give storage.target_dir outside "
            f"dataset.root (a tmpfs, e.g. /dev/shm/fastload)."
        )
    if mine in src.parents:
        raise ConfigError(
            f"dataset.root={root} is inside storage.target_dir={target_dir}'s folder of staged "
            f"copies ({mine}): point dataset.root at the dataset itself, not at a staged copy."
        )


# How storage=tmpfs words user_dir's messages.
TARGET_DIR = "storage.target_dir", "stage there", "staged copies"


def make_user_folder(target_dir) -> Path:
    """<target_dir>/<uid>, this user's folder of copies, created (fastload/storage/user_dir.py:
    target_dir made 1777, each user's folder 0700 and their own, or a StorageError naming
    storage.target_dir and the fix)."""
    return user_dir.make_user_folder(target_dir, *TARGET_DIR, _own())


def _not_writable(target_dir: Path, exc: OSError) -> str:
    return user_dir.not_writable(target_dir, exc, *TARGET_DIR, _own())


def _own() -> str:
    return f"/dev/shm/fastload-{os.geteuid()}"


def users_lock(final: Path) -> Path:
    """The file whose flock says which runs on this node use the copy at `final`."""
    return final.with_name(final.name + ".users")


def stat_entry(rel: str, st: os.stat_result) -> list:
    """A file's manifest entry: [path, size, modification time, change time, inode]. Size
    and modification time alone miss a file replaced by other bytes of the same size with
    its time put back (`cp -p`, `rsync -a`, `touch -r`); the change time cannot be set by a
    user and the replacement is another inode, so such a file no longer matches (a chmod
    also changes the change time: the copy is staged again)."""
    return [rel, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def build_manifest(layout, splits) -> dict:
    """Every file the splits need (the layout's folders and files, relative to its root),
    with size, modification and change times and inode (`stat_entry`): a changed source
    never matches an old staging; and
    every folder, empty ones too: class indices come from the class folders, so the copy
    must have each one the source has (storage=disk and tmpfs give the same targets).
    A name that leads nowhere (a dangling symlink, a file removed since the listing) or a
    file this user cannot read is left out when it is no image, as storage=disk never reads
    it; an image is refused: the split's index would list it and the run fail on it. A file
    the layout names itself (COCO's annotations) is refused when it cannot be read."""
    root = Path(layout.root).absolute()
    files, dirs, skipped, broken, denied = [], [], [], [], []
    for rel in layout.stage_paths(splits):
        base = root / rel
        if base.is_file():
            if not _readable(base):
                raise StorageError(_cannot_read(base, "the dataset reads it"))
            files.append(stat_entry(rel, os.stat(base)))
            continue
        if not base.is_dir():
            raise StorageError(
                f"cannot stage {base}: no such folder or file. Point dataset.root at the "
                f"dataset (for dataset=imagenet: a folder holding '<split>/<class>/<image>')."
            )
        # Each path walked on its own, as each split is indexed on its own: a val class
        # folder that links to a train one is staged under val too. A link loop: once.
        for dirpath, _, names in walk_once(base, set(), skipped):
            # relative to the root once per folder, its files' names joined on (a relpath
            # per file was most of the time of listing ImageNet)
            rel_dir = os.path.relpath(dirpath, root)
            dirs.append(rel_dir)
            prefix = "" if rel_dir == os.curdir else rel_dir + os.sep
            if not dirpath.endswith(os.sep):
                dirpath += os.sep
            for n in sorted(names):
                p = dirpath + n
                try:
                    st = os.stat(p)
                except OSError as exc:
                    if exc.errno not in (errno.ENOENT, errno.ELOOP):
                        raise
                    if n.lower().endswith(IMG_EXTENSIONS):
                        raise StorageError(
                            f"cannot stage {p}: {_leads_nowhere(p)}, but storage=disk would "
                            f"list it as an image of its split. Restore the file or remove "
                            f"the name."
                        ) from None
                    broken.append(p)
                    continue
                if not _readable(p):
                    if n.lower().endswith(IMG_EXTENSIONS):
                        raise StorageError(
                            _cannot_read(p, "storage=disk would list it as an image of its split")
                        )
                    denied.append(p)
                    continue
                files.append(stat_entry(prefix + n, st))
    warn_skipped(root, skipped)
    for names, what in ((broken, "name(s) that lead to no file"),
                        (denied, "file(s) this user cannot read")):  # fmt: skip
        if names:
            log.info(
                "storage=tmpfs: left out %d %s (no image: storage=disk does not read them "
                "either): %s",
                len(names),
                what,
                ", ".join(names[:5]) + (" ..." if len(names) > 5 else ""),
            )
    # A folder not followed (a class folder linking to one already walked) is still a class
    # of its split, with no images of its own: staged empty, as storage=disk indexes it.
    dirs += [os.path.relpath(s, root) for s in skipped]
    splits = list(dict.fromkeys(splits))
    paths = list(dict.fromkeys(os.path.normpath(p) for p in layout.stage_paths(splits)))
    return {"source": str(root), "splits": splits, "paths": paths, "dirs": dirs, "files": files}


_EFFECTIVE_IDS = os.access in os.supports_effective_ids


def _readable(path) -> bool:
    """Whether this process may open `path` for reading (its permissions, ACLs)."""
    return os.access(path, os.R_OK, effective_ids=_EFFECTIVE_IDS)


def _cannot_read(path, why: str) -> str:
    return (
        f"cannot stage {path}: this user (uid {os.geteuid()}) may not read it, but {why}. "
        f"Make it readable (chmod a+r {path}) or move it out of the dataset."
    )


def _leads_nowhere(path) -> str:
    if os.path.islink(path):
        return f"a symlink to {os.readlink(path)}, which leads to no file"
    return "no such file (removed meanwhile?)"


def _read_manifest(folder: Path) -> dict | None:
    try:
        with open(folder / MANIFEST, "rb") as f:
            st = os.fstat(f.fileno())
            have = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(have, dict):
        return None
    _remember(st, have)
    return have


# The bytes of the files each manifest this process read or wrote lists, by the manifest
# file's identity: `finish` says how large the copy is without a walk of it (a stat per file
# at the end of each run).
_listed_bytes: dict[tuple, int] = {}


def _manifest_id(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _remember(st: os.stat_result, manifest: dict) -> None:
    with contextlib.suppress(KeyError, TypeError, IndexError):
        _listed_bytes[_manifest_id(st)] = sum(f[1] for f in manifest["files"])


def _held(folder) -> tuple[int, int, int]:
    """(files and folders, their bytes, those bytes in whole pages) under `folder`: a walk
    of what is there (os.scandir: no Path per file)."""
    count = nbytes = pages = 0
    stack = [os.fspath(folder)]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for e in entries:
                count += 1
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                elif e.is_file():
                    size = e.stat().st_size
                    nbytes += size
                    pages += -(-size // PAGE) * PAGE
    return count, nbytes, pages


def staged_bytes(final: Path) -> int:
    """The bytes of the files of the staged copy at `final` (its manifest too): as its
    manifest lists them (a complete copy has them: checked when it was staged and each time
    it is reused), remembered from when this process read or wrote it, else read now; a
    walk of the copy when it has no readable manifest."""
    with contextlib.suppress(OSError):
        st = os.stat(final / MANIFEST)
        listed = _listed_bytes.get(_manifest_id(st))
        if listed is None and _read_manifest(final) is not None:
            listed = _listed_bytes.get(_manifest_id(st))
        if listed is not None:
            return listed + st.st_size
    return _held(final)[1]


def _under(paths):
    """A test of whether a manifest path lies under one of `paths` (or is one), made once
    for a pass over every file."""
    paths = {os.path.normpath(p) for p in paths}
    if os.curdir in paths:
        return lambda rel: True
    prefixes = tuple(p + os.sep for p in paths)

    def under(rel: str) -> bool:
        rel = os.path.normpath(rel)
        return rel in paths or rel.startswith(prefixes)

    return under


def _entries(files, paths=None) -> set[tuple]:
    """The manifest's file entries (`stat_entry`) as a set, those under `paths` when given."""
    under = _under(paths) if paths is not None else lambda rel: True
    return {(os.path.normpath(f[0]), *f[1:]) for f in files if under(f[0])}


def _same_files(have, want, paths) -> bool:
    """Whether the manifest entries `have` list, under `paths`, the files of `want` (each
    with the same size, times and inode). One pass when they come in the same order (a copy
    of these splits, listed the same way: the usual reuse), without a set of either; else
    compared as sets (other splits first, or the source changed)."""
    under = _under(paths)
    it = iter(want)
    for h in have:
        if under(h[0]) and h != next(it, None):
            break
    else:
        if next(it, None) is None:
            return True
    return _entries(have, paths) == _entries(want)


def _matches(folder: Path, manifest: dict) -> bool:
    """Whether `folder` is a complete copy of what `manifest` lists: under the manifest's
    paths its own manifest has the same folders and files (size, modification and change
    times, inode) as the source has now, and they are there with those sizes. A manifest
    written with fewer fields per file (an earlier version) matches nothing: that copy is
    staged again, once. Other splits it holds besides do not count: a copy staged for
    [train, val] serves a val-only run (evaluate=<checkpoint>) as it is, while the training
    run that staged it goes on reading it."""
    have = _read_manifest(folder)
    if have is None or have.get("source") != manifest["source"]:
        return False
    paths = manifest["paths"]
    try:
        under = _under(paths)
        dirs = {os.path.normpath(d) for d in have["dirs"] if under(d)}
        if not _same_files(have["files"], manifest["files"], paths):
            return False
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        return False
    if dirs != {os.path.normpath(d) for d in manifest["dirs"]}:
        return False
    # str paths, not a Path per file: this stats every file of the copy on each reuse
    top = os.fspath(folder) + os.sep
    try:
        return all(os.path.isdir(top + rel) for rel in manifest["dirs"]) and all(
            os.stat(top + f[0]).st_size == f[1] for f in manifest["files"]
        )
    except OSError:
        return False


def room(target_dir: Path) -> dict:
    """What limits a copy into target_dir (each in bytes; None = no such limit)."""
    return {
        "free space": shutil.disk_usage(target_dir).free,
        "available RAM": available_ram(),
        "container memory limit headroom": memory_limit_available(),
    }


def mount_point(path) -> Path:
    """The mount point a path (or its nearest existing folder) is on: what `mount -o
    remount` takes, not a folder inside it."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def short_of(target_dir: Path, need: int) -> tuple[dict, dict]:
    """(every limit of `room`, those under `need` bytes)."""
    limits = room(target_dir)
    return limits, {k: v for k, v in limits.items() if v is not None and v < need}


def check_room(target_dir: Path, need: int, reserve: int, root) -> None:
    """Refuse (with the numbers and the fix) when `need` + `reserve` bytes do not fit."""
    limits, short = short_of(target_dir, need + reserve)
    if not short:
        return
    text = size_text
    if any(size_text(v) in (size_text(need), size_text(need + reserve)) for v in short.values()):
        text = "{:,} bytes".format  # close: rounded, "needs 1.0 MiB" would read as "1.0 MiB free"
    have = ", ".join(f"{k} {text(v)}" for k, v in limits.items() if v is not None)
    raise StorageError(
        f"storage=tmpfs: the dataset {root} needs {text(need)} (+{text(reserve)} "
        f"kept free: storage.reserve_gb) in {target_dir}, but {have}; short on: "
        f"{', '.join(short)}. Fixes: grow the tmpfs (`mount -o remount,size=<N>G "
        f"{mount_point(target_dir)}`, "
        f"or in Docker `--shm-size=<N>g`; scripts/stage_tmpfs.sh mounts one), point "
        f"storage.target_dir at a larger tmpfs, train on a subset, or use storage=disk / "
        f"storage=shards (kind=jpeg with max_side=256 stores several times less)."
    )


def inodes_free(target_dir: Path) -> int | None:
    """How many more files and folders the file system of target_dir takes (a tmpfs's
    nr_inodes); None: no such limit."""
    st = os.statvfs(target_dir)
    return st.f_favail if st.f_files else None


def inodes_fit(target_dir: Path, need: int) -> bool:
    free = inodes_free(target_dir)
    return free is None or free >= need


def check_inodes(target_dir: Path, need: int, root) -> None:
    """Refuse (with the numbers and the fix) when `need` files and folders do not fit: a
    tmpfs can run out of inodes (nr_inodes) with bytes to spare."""
    if inodes_fit(target_dir, need):
        return
    free = inodes_free(target_dir)
    point = mount_point(target_dir)
    total = os.statvfs(target_dir).f_files
    raise StorageError(
        f"storage=tmpfs: the dataset {root} needs {need:,} files and folders in {target_dir}, "
        f"but its file system ({point}, nr_inodes={total:,}) takes only {free:,} more. "
        f"Fixes: allow more (`mount -o remount,nr_inodes=<N> {point}`; 0: no limit), point "
        f"storage.target_dir at another tmpfs, or use storage=shards (a few large files)."
    )


# How many files are handed to the copying threads ahead of the one the progress bar waits
# for: a future per file of ImageNet held at once took gigabytes while the tmpfs filled RAM.
COPY_WINDOW = 4096


def copy_files(
    src_root: Path, dst_root: Path, files, threads: int, progress: bool, dirs=()
) -> None:
    """Copy `files` (manifest entries) from src_root into dst_root (its `dirs` made, empty
    ones too), `threads` at a time in order, then check that each copy has the size the
    manifest lists (a StorageError naming the first that does not). The first file that
    fails stops the copy with its error."""
    from tqdm import tqdm

    total = sum(f[1] for f in files)
    for d in sorted({*dirs, *(os.path.dirname(f[0]) for f in files)}):
        (dst_root / d).mkdir(parents=True, exist_ok=True)
    src_top, dst_top = os.fspath(src_root) + os.sep, os.fspath(dst_root) + os.sep

    def one(item):
        rel, size = item[0], item[1]
        src, dst = src_top + rel, dst_top + rel  # str: no Path per file
        try:
            shutil.copyfile(src, dst)  # copy_file_range/sendfile fast path
        except FileNotFoundError:
            if os.path.exists(src):
                raise
            raise StorageError(
                f"cannot stage {src_root / rel}: {_leads_nowhere(src)}; it was "
                f"there when the dataset was listed. Was the source modified during the "
                f"copy? Retry."
            ) from None
        except PermissionError as exc:
            if exc.filename is not None and Path(exc.filename) != src_root / rel:
                raise  # the copy's side: stage() says so
            raise StorageError(_cannot_read(src_root / rel, "it is part of the dataset")) from None
        return size, os.stat(dst).st_size == size

    differ = []
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=f"staging to {dst_root.parent}",
        file=sys.stderr,
        disable=not progress,
    ) as bar:
        with ThreadPoolExecutor(max(1, threads)) as pool:
            pending = collections.deque()

            def done() -> None:  # the oldest file handed out: copied, or its error raised
                size, same = pending[0][1].result()
                if not same:
                    differ.append(pending[0][0])
                pending.popleft()
                bar.update(size)

            try:
                for item in files:
                    if len(pending) >= COPY_WINDOW:
                        done()
                    pending.append((item[0], pool.submit(one, item)))
                while pending:
                    done()
            except BaseException:  # a failed file, Ctrl-C, SIGTERM: stop, do not copy the rest
                pool.shutdown(wait=True, cancel_futures=True)
                raise
    if differ:
        raise StorageError(
            f"staging {src_root} into {dst_root}: {len(differ)} file(s) differ from the source "
            f"after copying (first: {differ[0]}); was the source modified during the "
            f"copy? Retry."
        )


def stage(
    root,
    splits,
    target_dir="/dev/shm/fastload",
    threads=8,
    reserve_gb=1.0,
    progress=True,
    alone=None,
) -> Path:
    """Stage the splits of `root` (a layout, or an ImageFolder root) into target_dir
    (atomically) unless a complete copy is there; returns the copy's root. `alone()`: True
    when no other run on this node uses the copy there (TmpfsStorage's lock), asked before
    a copy without room for its replacement beside it is removed; None: not known."""
    layout = as_layout(root)
    root = Path(layout.root).absolute()
    target_dir = Path(target_dir)
    check_apart(root, target_dir)
    final = make_user_folder(target_dir) / staged_name(root)
    manifest = build_manifest(layout, splits)
    with staging_lock(final):
        _adopt(earlier_root(root, target_dir), final)
        return _stage(layout, final, manifest, threads, reserve_gb, progress, alone)


@contextlib.contextmanager
def staging_lock(final: Path):
    """`with staging_lock(final):` held by one process of this node at a time: of two runs
    that stage one dataset at once, one copies and the other waits, then reuses that copy
    (when it holds the splits it needs) instead of copying beside it, which there may be no
    room for. An flock on <name>.staging, released by the kernel when a process dies; the
    file is removed by its holder, and a waiter that then gets the lock on a removed file
    takes the one now at that path."""
    path = final.with_name(final.name + ".staging")
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info(
                    "storage=tmpfs: another process on this node is staging %s: waiting for it",
                    final,
                )
                fcntl.flock(fd, fcntl.LOCK_EX)
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def _stage(layout, final: Path, manifest: dict, threads, reserve_gb, progress, alone) -> Path:
    """`stage` under the staging lock."""
    root, wanted = Path(layout.root).absolute(), manifest
    if _matches(final, manifest):
        log.info("storage=tmpfs: reusing the complete staged copy %s", final)
        return final
    # A staging killed on this host (SIGKILL, OOM) left its partial copy in RAM: remove it
    # before measuring the room, or it alone could make the new copy "not fit".
    remove_stale(final.absolute())
    manifest, need, replacing = _make_room(final, layout, manifest, int(reserve_gb * 2**30), alone)
    t0 = time.perf_counter()
    try:
        with building(final, replacing) as tmp:
            copy_files(root, tmp, manifest["files"], threads, progress, manifest["dirs"])
            (tmp / MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
            _remember(os.stat(tmp / MANIFEST), manifest)  # the same file once renamed
    except AlreadyBuilt:
        # Another run on this node (a second job, or a restart racing the old run) staged it
        # first: as good as ours when it holds what this run needs.
        if _matches(final, wanted):
            log.info("storage=tmpfs: %s was staged by another process meanwhile: using it", final)
            return final
        have = (_read_manifest(final) or {}).get("splits")
        raise StorageError(
            f"storage=tmpfs: another process staged {final} while this one did, and its copy "
            f"does not hold what this run needs (the splits {', '.join(wanted['splits'])} of "
            f"{root} as they are now; it holds {have or 'no complete copy'}). Run again: the "
            f"copy is then replaced by one holding the splits of both runs; or give one of "
            f"them another storage.target_dir."
        ) from None
    except PermissionError as exc:  # this user's folder, made unwritable meanwhile
        raise StorageError(_not_writable(final.parent, exc)) from None
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        if _matches(final, wanted):  # another node's process, on a shared target_dir
            log.info("storage=tmpfs: %s was staged by another process meanwhile: using it", final)
            return final
        raise StorageError(
            no_space_message("the staged copy", final, need) + " (storage.target_dir)"
        ) from None
    dt = time.perf_counter() - t0
    log.info(
        "storage=tmpfs: staged %d files (%.1f MB) into %s in %.1f s (%.0f MB/s)",
        len(manifest["files"]),
        need / 1e6,
        final,
        dt,
        need / 1e6 / max(dt, 1e-9),
    )
    return final


def _adopt(old: Path, final: Path) -> None:
    """A copy of this user's staged where copies went before there was a folder per user
    (<target_dir>/<name>) is moved into this user's folder, when no run uses it (its .users
    lock is free) and nothing is there yet: reused (or brought up to date) there, not left
    in RAM beside a new one."""
    try:
        st = os.lstat(old)
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or os.path.lexists(final):
        return
    if not (old / MANIFEST).is_file():
        return
    try:
        fd = os.open(users_lock(old), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(old, final)
        users_lock(old).unlink(missing_ok=True)
        log.info("storage=tmpfs: moved the staged copy %s into this user's folder: %s", old, final)
    except OSError as exc:
        log.info(
            "storage=tmpfs: the staged copy %s stays where an earlier version put it (%s); "
            "once no run uses it, remove it with rm -rf %s to free its RAM",
            old,
            "a run uses it" if isinstance(exc, BlockingIOError) else exc.strerror,
            old,
        )
    finally:
        os.close(fd)


def _make_room(final: Path, layout, manifest: dict, reserve: int, alone=None):
    """(the manifest to stage, its bytes in pages, the folder_id of the copy at `final` it
    replaces or None) once the room is checked (refused with the numbers when it does not
    fit). A copy at `final` (outdated, damaged, or without a split this run needs) is
    replaced by one that holds its splits too, built beside it when both fit; else it is
    removed first, unless `alone()` says another run on this node uses it (refused)."""
    target_dir, root = final.parent, Path(layout.root).absolute()
    replacing = None
    if final.exists():
        replacing = folder_id(final)
        manifest = _with_splits_of(final, layout, manifest)
    need = sum(-(-f[1] // PAGE) * PAGE for f in manifest["files"])
    inodes = len(manifest["files"]) + len(manifest["dirs"]) + 2  # + the manifest, the folder
    if replacing is None:
        check_inodes(target_dir, inodes, root)
        check_room(target_dir, need, reserve, root)
    elif not short_of(target_dir, need + reserve)[1] and inodes_fit(target_dir, inodes):
        # Built beside the old copy, then renamed over it (fastload/atomic.py): a run
        # reading the old one finds its files at the same paths in the new one.
        log.warning(
            "storage=tmpfs: %s does not match %s (changed, incomplete, or without a split this "
            "run needs): re-staging %s beside it, then replacing it",
            final, root, ", ".join(manifest["splits"]),
        )  # fmt: skip
    else:
        held, _, pages = _held(final)
        check_inodes(target_dir, max(0, inodes - held - 1), root)
        check_room(target_dir, max(0, need - pages), reserve, root)
        if alone is not None and not alone():
            raise StorageError(
                f"storage=tmpfs: {final} does not match {root} (changed, incomplete, or "
                f"without a split this run needs: {', '.join(manifest['splits'])}), there is no "
                f"room for a new copy beside it ({size_text(need)}), and another run on this "
                f"node is reading it: removing it would end that run. Let that run finish, "
                f"free room in {target_dir}, or give this run another storage.target_dir."
            )
        log.warning(
            "storage=tmpfs: %s does not match %s (changed, incomplete, or without a split this "
            "run needs), and there is no room for a new copy beside it: removing it first (%s) "
            "and re-staging %s",
            final, root, "a run on this node reading it fails" if alone is None
            else "no other run on this node uses it", ", ".join(manifest["splits"]),
        )  # fmt: skip
        _remove(final, replacing)
        replacing = None
    return manifest, need, replacing


def _with_splits_of(old: Path, layout, manifest: dict) -> dict:
    """The manifest of the requested splits and those of the copy at `old`, which the new
    copy replaces: a run still reading the old copy (another split, on this node) keeps its
    files, and neither run's splits are re-staged by the next run of the other."""
    have = _read_manifest(old) or {}
    more = [s for s in have.get("splits", ()) if isinstance(s, str)]
    if have.get("source") != manifest["source"] or not set(more) - set(manifest["splits"]):
        return manifest
    try:
        return build_manifest(layout, [*manifest["splits"], *more])
    except StorageError:  # such a split is gone from the source: stage the requested ones
        return manifest


def _remove(final: Path, old_id: tuple[int, int]) -> None:
    """Remove the copy at `final` if it is still the one judged outdated (`old_id`): another
    process may have staged a new one there meanwhile. Renamed aside first, so that no
    reader sees it half removed; a process killed before the rmtree leaves a temporary
    folder that the next run removes (fastload/atomic.py)."""
    aside = temp_path(final.absolute())
    shutil.rmtree(aside, ignore_errors=True)
    try:
        if folder_id(final) != old_id:
            return
        os.rename(final, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


class TmpfsStorage(Storage):
    """storage=disk over a copy staged into a RAM-backed folder by `prepare`."""

    def __init__(
        self,
        target_dir: str = "/dev/shm/fastload",
        threads: int = 8,
        reserve_gb: float = 1.0,
        cleanup: bool = False,
        progress: bool = True,
        cold_cache: bool = False,
    ):
        self.target_dir = target_dir
        self.threads, self.reserve_gb = int(threads), float(reserve_gb)
        self.cleanup, self.progress, self.cold_cache = bool(cleanup), bool(progress), cold_cache

    def prepare(self, root, splits, skip_corrupt: bool = False) -> None:
        check_apart(as_layout(root).root, self.target_dir)  # before any folder is made
        final = staged_root(as_layout(root).root, self.target_dir)
        self._use(final)
        try:
            stage(
                root,
                splits,
                self.target_dir,
                threads=self.threads,
                reserve_gb=self.reserve_gb,
                progress=self.progress,
                alone=self._exclusive,
            )
        except BaseException:  # a failed or interrupted staging: this run uses no copy
            self._release(final)
            raise
        finally:
            self._shared()

    def open(self, root, split: str) -> SourceReader:
        layout = as_layout(root)
        final = staged_root(layout.root, self.target_dir)
        if not (final / MANIFEST).is_file():
            raise StorageError(
                f"storage=tmpfs: {final} holds no complete staged copy of {layout.root}. The "
                f"engine stages it before training (TmpfsStorage.prepare); from Python call "
                f"fastload.storage.tmpfs.stage({str(layout.root)!r}, splits, "
                f"{str(self.target_dir)!r})."
            )
        return SourceReader(layout.at(final).source(split), cold_cache=self.cold_cache)

    # this run's lock on <name>.users: a finalizer that closes its descriptor (and so lets
    # go of the lock) when called, or when the storage object is garbage-collected
    _users: weakref.finalize | None = None

    def __getstate__(self) -> dict:  # a copy in another process holds no lock of this one's
        return {k: v for k, v in self.__dict__.items() if k != "_users"}

    def _use(self, final: Path) -> None:
        """Hold the shared lock that says a run on this node uses the copy at `final`
        (waiting while another run's cleanup removes it); before staging, so that a copy
        this run is about to reuse cannot be removed in between."""
        if self._users is None:
            # an unwritable target_dir: `stage` says so
            with contextlib.suppress(OSError, StorageError):
                make_user_folder(final.parent.parent)
                self._lock(final, fcntl.LOCK_SH)

    def _lock(self, final: Path, how: int) -> bool:
        """Lock <name>.users (`how`: fcntl.LOCK_SH or LOCK_EX | LOCK_NB); False when the
        exclusive lock is taken. A file unlinked by the run that held it exclusively while
        this one waited is no lock any more: open the one now at that path."""
        path = users_lock(final)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, how)
                current = os.stat(path).st_ino == os.fstat(fd).st_ino
            except BlockingIOError:
                os.close(fd)
                return False
            except FileNotFoundError:
                current = False
            if current:
                self._users = weakref.finalize(self, os.close, fd)
                return True
            os.close(fd)

    def _exclusive(self) -> bool:
        """Trade this run's shared lock for the exclusive one if no other run holds it:
        True when none does (this run then holds it alone until `_shared`, so that no run
        starts reading the copy it is about to remove)."""
        if self._users is None:
            return True  # no lock file (an unwritable target_dir): nothing to go by
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            fcntl.flock(self._fd, fcntl.LOCK_SH)  # a refused conversion may have let go of it
            return False

    def _shared(self) -> None:
        if self._users is not None:
            fcntl.flock(self._fd, fcntl.LOCK_SH)

    @property
    def _fd(self) -> int:
        """The descriptor this run's lock is on (the one its finalizer closes)."""
        return self._users.peek()[2][0]

    def _release(self, final: Path, then=None) -> bool:
        """Let go of this run's lock. When no other run uses the copy: call `then()` (the
        cleanup) under the exclusive lock, so that a run starting meanwhile waits for it and
        then stages anew, remove the lock file, and return True; else False."""
        if self._users is not None:
            self._users()  # closes the descriptor once
            self._users = None
        try:
            alone = self._lock(final, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # the target_dir is gone or unwritable: no run can be using it
            alone = None
        if alone is False:
            return False
        try:
            if then is not None:
                then()
            users_lock(final).unlink(missing_ok=True)
        except OSError:
            pass
        finally:
            if alone:
                self._users()
                self._users = None
        return True

    def finish(self, root, splits) -> None:
        final = staged_root(as_layout(root).root, self.target_dir)
        if self.cleanup:
            if self._release(final, then=lambda: shutil.rmtree(final, ignore_errors=True)):
                log.info("storage.cleanup=true: removed the staged copy %s", final)
            else:
                log.info(
                    "storage.cleanup=true: the staged copy %s stays: another run on this node "
                    "is using it (the last one to finish removes it)",
                    final,
                )
            return
        self._release(final)
        if final.is_dir():
            log.info(
                "the staged copy %s stays in RAM for the next run (%.0f MB); remove it with "
                "rm -rf %s, or set storage.cleanup=true to remove it at the end of each run",
                final,
                staged_bytes(final) / 1e6,
                final,
            )
