"""Atomic, self-checking checkpoints and the state needed to resume exactly.

A checkpoint is a plain `torch.save` of a dict (`torch.load(path, weights_only=True)` reads
it anywhere), which carries:

* `checksum`: xxh3-128 over every value of the payload (tensors by dtype, shape and bytes;
  everything else by repr), verified before use: a flipped byte in the weights is refused,
  naming the file, instead of training on from damaged weights;
* `run_config`: the resolved config minus the keys that do not shape the result (workers,
  logging, paths, the loader strategy: see `NOT_SHAPING`); resuming compares it with this
  run's and refuses with the keys that differ.

It is written to a temporary name in the same folder, fsynced and renamed: a crash or a full
disk at any point leaves the previous checkpoint intact and never a half-written one.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path

import numpy as np
import torch
import xxhash

from fastload.atomic import is_disk_full, no_space_message, remove_stale, temp_path
from fastload.errors import CheckpointError

log = logging.getLogger("fastload")

FORMAT = 2  # 2: checksum + run_config; 1 (the first format): neither, read with a warning
READABLE = (1, 2)
LAST = "last.pt"
# The weights at the best evaluation of the task's metric (and of the EMA's), to use, not to
# resume: {"kind": "weights", "model": state_dict, "epoch", "metric", "value", ...}.
BEST = "best.pt"
BEST_EMA = "best_ema.pt"
PENDING = ".pending"  # best.pt.pending: a new best that no checkpoint holds yet
WEIGHTS = "weights"

# Config keys that change how fast a run goes or where it writes, not what it computes.
NOT_SHAPING = (
    "name",
    "resume",
    "evaluate",
    "output_root",
    "logger",
    "hydra",
    "doctor",
    "trainer.progress",
    "trainer.checkpoint_every",
    "trainer.checkpoint_every_steps",
    "trainer.keep_best",
    # the global batch (batch_size x world size x grad_accum_steps) may change on a resume:
    # the state follows it (TrainState.change_global_batch), as for another world size
    "trainer.grad_accum_steps",
    "trainer.eval_every",
    "trainer.device",
    "trainer.dist_backend",
    "trainer.ddp",
    "trainer.compile",
    "loader",  # every strategy yields the same batches; the two that change numbers follow
    "storage._target_",  # disk, tmpfs, lmdb and shards of the source bytes read the same bytes
    "storage.path",
    "storage.auto_pack",
    "storage.verify",
    "storage.cold_cache",
    "storage.threads",
    "storage.reserve_gb",
    "storage.cleanup",
    "storage.progress",
    "storage.target_dir",
    "storage.shard_mb",
)
SHAPING_EXCEPTIONS = ("loader.normalize_on", "loader.input_dtype", "loader.drop_last")


def flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def run_config(cfg) -> dict:
    """The keys of a resolved config that shape the result, flattened ('optim.base_lr')."""
    from omegaconf import OmegaConf

    flat = flatten(OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False))
    resolved = {}
    for key in flat:
        skip = any(key == p or key.startswith(p + ".") for p in NOT_SHAPING)
        if skip and key not in SHAPING_EXCEPTIONS:
            continue
        resolved[key] = OmegaConf.select(cfg, key, throw_on_missing=False)
    return {
        k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
        for k, v in resolved.items()
    }


# A feature's switch and the prefix of its settings: while the switch is null (off) in both
# configs, its settings shape nothing, so they are no difference (nor is their absence from a
# checkpoint written before the feature existed).
SETTINGS_OF = {"trainer.ema.decay": "trainer.ema."}


def config_differences(saved: dict, current: dict) -> list[str]:
    """'key: saved -> current' for each key that differs. A key the saved config lacks whose
    value here is null is an option added since, off by default: not a difference; nor are
    the settings of a feature off in both (`SETTINGS_OF`)."""
    keys = sorted(set(saved) | set(current))
    inert = tuple(
        prefix for switch, prefix in SETTINGS_OF.items()
        if saved.get(switch) is None and current.get(switch) is None
    )  # fmt: skip
    missing = "(unset)"
    return [
        f"{k}: {saved.get(k, missing)!r} -> {current.get(k, missing)!r}"
        for k in keys
        if saved.get(k, missing) != current.get(k, missing)
        and not (k not in saved and current[k] is None)
        and not k.startswith(inert)
    ]


def _feed(h, obj) -> None:
    """Hash a checkpoint payload the same way whether it was just built or loaded."""
    if torch.is_tensor(obj):
        t = obj.detach().to("cpu").contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}".encode())
        for k, v in obj.items():
            h.update(repr(k).encode())
            _feed(h, v)
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}".encode())
        for v in obj:
            _feed(h, v)
    else:
        h.update(repr(obj).encode())


def checksum(payload: dict) -> str:
    h = xxhash.xxh3_128()
    _feed(h, {k: v for k, v in payload.items() if k != "checksum"})
    return h.hexdigest()


def tensor_bytes(obj) -> int:
    """The bytes of the tensors in a (nested) state dict, as torch.save writes them."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 64


def save_atomic(state: dict, path: Path) -> None:
    """Checksum, write to a temporary name in the same folder, fsync, rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {**state, "format": FORMAT}
    state["checksum"] = checksum(state)
    # .last.pt.tmp-<host>~<pid ns>-<pid>: a killed writer's is found by its pid
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:
        if is_disk_full(exc):
            raise CheckpointError(
                no_space_message("the checkpoint", path, tensor_bytes(state))
                + " (set output_root=<a folder with room>)"
            ) from None
        raise
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


# What to pass instead of an unusable file, by the option that named it.
INSTEAD = {
    "resume": "a checkpoints/last.pt written by train.py, or resume=null to start fresh",
    "evaluate": "a checkpoints/best.pt, best_ema.pt or last.pt written by train.py, or a "
    "state dict saved with torch.save(model.state_dict(), path)",
}


def load(path: str | os.PathLike, option: str = "resume") -> dict:
    """A checkpoint (or best-weights file), verified; CheckpointError naming the file when it
    is missing, not a fastload checkpoint, or damaged. `option`: the option that named it."""
    path = Path(path)
    return verified(read(path, option), path, option)


def in_run_folder(path: Path) -> Path:
    """resume=<a run folder> (or its checkpoints/): its checkpoints/last.pt; a file: itself."""
    if path.is_dir():
        for candidate in (path / "checkpoints" / LAST, path / LAST):
            if candidate.is_file():
                return candidate
    return path


def read(path: Path, option: str):
    """The file's contents, read without pickle (weights_only)."""
    if path.is_dir():
        names = (BEST, BEST_EMA, LAST) if option == "evaluate" else (LAST,)
        held = [str(d / n) for d in (path / "checkpoints", path) for n in names
                if (d / n).is_file()]  # fmt: skip
        if held:  # evaluate= takes a file: which weights is the user's choice
            raise CheckpointError(f"{option}={path} is a folder: pass one of its files, "
                                  f"{', '.join(held)}.")  # fmt: skip
        raise CheckpointError(
            f"{option}={path} is a folder without a checkpoint to take from it: pass a "
            f"checkpoint file ({' or '.join(f'<run>/checkpoints/{n}' for n in names)})"
            + (", or resume=auto (the newest of this run's name)." if option == "resume" else ".")
        )
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; check the {option}= path.")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch's own advice (weights_only=False, file an issue) misleads
        if path.suffix == ".safetensors":  # torch reads them only with the package installed
            raise CheckpointError(
                f"{path} is a safetensors file, which torch reads only with the safetensors "
                f"package: pip install safetensors (or save it as a .pth: torch.save("
                f"safetensors.torch.load_file(path), 'weights.pth'))."
            ) from None
        raise CheckpointError(
            f"{path} is not a fastload checkpoint, or it is damaged (torch cannot read it: "
            f"{type(exc).__name__}). Pass {INSTEAD[option]}."
        ) from None


def load_weights(path: str | os.PathLike) -> dict:
    """evaluate=: a fastload file (verified as `load` does), or weights published or saved
    elsewhere: a state dict (torchvision's and timm's .pth files), or one under "state_dict"
    or "model" ("module." prefixes of DDP-saved ones dropped) -> {"model": state dict, ...}."""
    path = Path(path)
    state = read(path, "evaluate")
    if isinstance(state, dict) and "format" not in state:
        weights = state_dict_in(state)
        if weights is not None:
            return {"kind": "state_dict", "of": "model", "model": weights}
    return verified(state, path, "evaluate")


def state_dict_in(saved) -> dict | None:
    """The state dict of what torch.load read: tensors by name, alone or under "state_dict"
    (timm) or "model" (torchvision's references, train.py), the "module." and "_orig_mod."
    prefixes of a DDP-wrapped or torch.compile'd model dropped; None when there is none."""
    if not isinstance(saved, dict):
        return None
    for candidate in (saved, saved.get("state_dict"), saved.get("model")):
        if not isinstance(candidate, dict) or not candidate:
            continue
        if all(isinstance(k, str) and torch.is_tensor(v) for k, v in candidate.items()):
            return {unwrapped_key(k): v for k, v in candidate.items()}
    return None


WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def unwrapped_key(key: str) -> str:
    """A parameter's name without the wrappers' prefixes (DDP's module., torch.compile's
    _orig_mod., in any order and number)."""
    while key.startswith(WRAPPER_PREFIXES):
        key = key.split(".", 1)[1]
    return key


def verified(state, path: Path, option: str) -> dict:
    """A fastload file's contents, its format and checksum checked."""
    if not isinstance(state, dict) or state.get("format") not in READABLE:
        raise CheckpointError(
            f"{path} is not a fastload checkpoint (no format {FORMAT} record); pass "
            f"{INSTEAD[option]}."
        )
    if state["format"] == 1:
        log.warning("%s predates checkpoint checksums: it cannot be verified", path)
    elif state.get("checksum") != checksum(state):
        raise CheckpointError(
            f"checkpoint {path} is damaged: its contents do not match the checksum written "
            f"with it (a disk or copy error). Use an intact copy"
            + (" or resume=null." if option == "resume" else ".")
        )
    return state


def weights_payload(model, of: str, epoch: int, metric: str, value: float, run: dict) -> dict:
    """A best-weights file's contents: `of` is "model" or "ema"; `run` the model_config and
    run_config of the run, for the reader."""
    return {"format": FORMAT, "kind": WEIGHTS, "of": of, "model": model.state_dict(),
            "epoch": epoch, "metric": metric, "value": value, **run}  # fmt: skip


def refuse_weights(path: Path, payload: dict) -> None:
    """resume= names a best-weights file: it has no optimizer, schedule or RNG state."""
    if payload.get("kind") == WEIGHTS:
        raise CheckpointError(
            f"{path} holds a run's best weights (load them into a model with "
            f"torch.load(path, weights_only=True)['model']), not a training state to resume: "
            f"pass resume={Path(path).parent / LAST} (or resume=auto)."
        )


def candidates(output_root: Path, name: str) -> list[Path]:
    """resume=auto: the last.pt of every run called `name`, newest first."""
    found = (Path(output_root) / name).glob(f"*/checkpoints/{LAST}")
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def remove_dead_temps(output_root: Path, name: str) -> list[Path]:
    """The temporary checkpoint and best-weights files that writers killed mid-write
    (SIGKILL, a lost node) left in the runs called `name` (each as large as the model or a
    checkpoint): removed when their writer is dead on this host (or, for another host's,
    untouched for a day)."""
    removed = []
    for folder in (Path(output_root) / name).glob("*/checkpoints"):
        for final in (LAST, BEST, BEST_EMA, BEST + PENDING, BEST_EMA + PENDING):
            removed += remove_stale(folder / final)
    if removed:
        log.info("removed %d checkpoint file(s) left half-written by dead runs: %s",
                 len(removed), ", ".join(str(p) for p in removed))  # fmt: skip
    return removed


def find_latest(output_root: Path, name: str) -> Path | None:
    found = candidates(output_root, name)
    return found[0] if found else None
