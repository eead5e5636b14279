"""Atomic checkpoints and the state needed to resume exactly."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from fastload.errors import CheckpointError

FORMAT = 1
LAST = "last.pt"


def save_atomic(state: dict, path: Path) -> None:
    """Write to a temporary name in the same folder, fsync, rename: a crash or a full disk
    at any point leaves the previous checkpoint intact and never a half-written one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def rng_state() -> dict:
    # numpy's state array is stored as a tensor so that the checkpoint loads with
    # torch.load(weights_only=True): no pickle of arbitrary objects.
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def load(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; check the resume= path.")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"cannot read checkpoint {path} ({type(exc).__name__}: {exc}); it is not a fastload "
            f"checkpoint or is damaged. Use another file or resume=null."
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a fastload checkpoint (format {FORMAT}); use resume=null."
        )
    return state


def find_latest(output_root: Path, name: str) -> Path | None:
    """resume=auto: the newest last.pt among the runs called `name`."""
    candidates = list((Path(output_root) / name).glob(f"*/checkpoints/{LAST}"))
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None
