"""A folder of one's own in a node-local folder that every user of the node shares.

storage=tmpfs's target_dir (staged copies) and storage=webdataset's cache_dir (fetched
shards) are such folders: the first run on a node creates them, and any user's run may come
next. Each user's files go in <folder>/<uid> (0700): another user can neither plant a file
there that this user's runs would trust nor read what this user copied or fetched. The
shared folder itself is made 1777 when created here, as /dev/shm is. Every process of one
user (the node's ranks and their DataLoader workers) lands on the same <folder>/<uid>.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from fastload.errors import StorageError


def user_folder(base) -> Path:
    """<base>/<uid>: this user's folder in `base` (its effective uid)."""
    return Path(base) / str(os.geteuid())


def make_user_folder(base, option: str, use: str, what: str, own: str) -> Path:
    """Create `base` (mode 1777 when created here: every user makes a folder of their own
    in it) and this user's folder in it (0700); returns the latter. Refused (StorageError),
    naming `option` (e.g. "storage.target_dir") and the fix, when that cannot be done (a
    folder of another user's that others may not write to, a read-only file system) or
    when the folder at this user's name is not this user's own. `use` and `what` word the
    message ("stage there", "staged copies"); `own` is a folder of this user's to suggest."""
    base = Path(base)
    mine = user_folder(base)
    try:
        try:
            base.parent.mkdir(parents=True, exist_ok=True)
            base.mkdir()
            base.chmod(0o1777)
        except FileExistsError:
            pass
        with contextlib.suppress(FileExistsError):
            mine.mkdir(mode=0o700)
    except PermissionError as exc:
        raise StorageError(not_writable(base, exc, option, use, what, own)) from None
    except OSError as exc:
        raise StorageError(
            f"{option}={base}: cannot create it ({exc.strerror}); point it at a writable "
            f"local folder (a tmpfs: df -t tmpfs lists them)."
        ) from None
    st = os.lstat(mine)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "no folder"
        raise StorageError(
            f"{option}={base}: {mine}, where this user's (uid {os.geteuid()}) {what} go, is "
            f"{kind} of uid {st.st_uid}'s, not this user's own. Remove it (as its owner or "
            f"root), or point {option} at a folder of your own."
        )
    return mine


def not_writable(base: Path, exc: OSError, option: str, use: str, what: str, own: str) -> str:
    """The message for a `base` (or a folder above it) where this user may not write."""
    where = next((p for p in (base, *base.parents) if p.exists()), base)
    try:
        st = os.stat(where)
        owner = f"{where} belongs to uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}"
    except OSError:
        owner = f"{where} is not writable"
    return (
        f"{option}={base}: this user (uid {os.geteuid()}) cannot create its folder there "
        f"({exc.strerror}: {owner}). Its owner can let every user {use} with "
        f"`chmod 1777 {where}` (each user's {what} go in a folder of their own), or point "
        f"{option} at a folder of your own, e.g. {option}={own}."
    )
