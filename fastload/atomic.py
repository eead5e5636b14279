"""Build a folder under a temporary name beside its final place, then rename it into place.

Packs, tmpfs staging and the synthetic dataset are all made this way, so a killed or failed
build never leaves something that looks complete: readers only ever see the final name,
which appears in one `rename`.

The temporary folder is `.<name>.tmp-<host>~<pid namespace>-<pid>` next to the final one
(same file system, so the rename is atomic). Before building, temporary folders of the same
name left by dead processes are removed, but only those whose pid means something here (this
host, this PID namespace: `host.process_space`): on a shared file system another node's pid,
or another container's, names no process of ours, and a node auto-packing beside us must not
lose its folder. Other folders are removed only once they have not changed for
`stale_after_s` (a day).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from fastload.host import pid_alive, process_space, size_text

DAY_S = 86400.0
OLD_SUFFIX = "-old"  # the replaced folder, moved aside while the new one is renamed in


class AlreadyBuilt(FileExistsError):
    """Another process put a complete folder at the final name while we were building."""


def temp_prefix(final: Path) -> str:
    return f".{final.name}.tmp-"


def temp_path(final: Path, host: str | None = None, pid: int | None = None) -> Path:
    host = process_space() if host is None else host
    pid = os.getpid() if pid is None else pid
    return final.parent / f"{temp_prefix(final)}{host}-{pid}"


def is_stale(entry: Path, final: Path, stale_after_s: float = DAY_S) -> bool:
    """A temporary folder of `final` whose builder is gone (see the module doc)."""
    tag = entry.name[len(temp_prefix(final)) :].removesuffix(OLD_SUFFIX)
    host, _, pid = tag.rpartition("-")
    if host == process_space() and pid.isdigit():
        return not pid_alive(int(pid))
    try:
        return time.time() - entry.stat().st_mtime > stale_after_s
    except OSError:
        return False


def remove_stale(final: Path, stale_after_s: float = DAY_S) -> list[Path]:
    """Remove the stale temporary folders (or files: checkpoints are written the same way)
    of `final`; returns what was removed."""
    removed = []
    try:
        entries = list(final.parent.glob(f"{temp_prefix(final)}*"))
    except OSError:
        return removed
    for entry in entries:
        if not is_stale(entry, final, stale_after_s):
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def folder_id(path: str | os.PathLike) -> tuple[int, int]:
    """Which folder is at `path` now: another one renamed into its place has another id."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


@contextlib.contextmanager
def building(final: str | os.PathLike, replacing: tuple[int, int] | None = None) -> Iterator[Path]:
    """`with building(final) as tmp:` fill `tmp`; on a clean exit it is renamed to `final`
    (an empty folder at `final` is replaced). `replacing`: the `folder_id` of the outdated
    folder at `final` this build replaces: it is moved aside, the new one renamed in, the
    old one deleted. On any error, or when another process completed `final` first
    (`AlreadyBuilt`: a folder where there was none, or another than `replacing`, as when
    two nodes re-pack one shared outdated pack and the other finished first, its ranks
    already reading it), `tmp` is removed and `final` is untouched."""
    final = Path(final).absolute()
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(final)
    tmp = temp_path(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        _publish(tmp, final, replacing)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, final: Path, replacing: tuple[int, int] | None) -> None:
    old = None
    if replacing is not None and final.exists():
        if folder_id(final) != replacing:
            raise AlreadyBuilt(f"{final} was rebuilt by another process while this one built it")
        old = Path(f"{temp_path(final)}{OLD_SUFFIX}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except OSError as exc:
        if old is not None:
            os.rename(old, final)  # put the previous one back
        if final.exists():
            raise AlreadyBuilt(f"{final} appeared while it was being built") from exc
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


NO_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


def is_no_space(exc: BaseException) -> bool:
    """An OSError of a full file system or quota (ENOSPC, EDQUOT)."""
    return isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS


def is_disk_full(exc: BaseException) -> bool:
    """`is_no_space`, or torch's zip writer failing mid-file on a full disk (it reports
    "unexpected pos" / "file write failed" instead of the errno)."""
    if is_no_space(exc):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("unexpected pos" in text or "write failed" in text)


def no_space_message(what: str, path, need: int) -> str:
    """One line: what could not be written where, the space needed and available, the fix."""
    path = Path(path)
    where = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(where).free
    return (
        f"no space left to write {what} {path}: it needs about {size_text(need)}, "
        f"{size_text(free)} is free on that file system. Free some space there or write "
        f"elsewhere; nothing half-written was left behind."
    )
