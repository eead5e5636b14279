"""Every private torch internal fastload uses, in one place, each with a fallback.

torch does not promise these names; a release may rename or drop any of them. Each use goes
through a function here that degrades to a slower or less informative path (never a wrong
one) when its internal is missing, and `missing()` lists what this torch lacks:
tests/test_layout.py fails loudly on an upgrade that removed one, so the fallback is a
decision, not an accident.

    torch._C._storage_Use_Count        batch slots: is a slot still referenced? (no: the
                                       consumer gets a private copy and the slot frees at once)
    torch.UntypedStorage._new_shared   a shared-memory storage (else: allocate, share_memory_())
    _MultiProcessingDataLoaderIter._shutdown_workers
                                       stop workers now (else: drop the iterator, GC stops them)
    DataLoader._iterator               the persistent workers' iterator (else: none to stop)
    _MultiProcessingDataLoaderIter._workers, ._rcvd_idx, ._task_info
                                       the stall watchdog names the stuck worker (else: "no
                                       single worker could be named")
    GradScaler._scale                  the fp16 loss scale as a device tensor: steps skipped
                                       for overflowing gradients are counted without a host
                                       sync (else: not counted, reported as unknown)
    DistributedDataParallel.require_forward_param_sync
                                       evaluation's forwards make no collective (else: DDP
                                       broadcasts the buffers in the first one, and a rank
                                       with no validation batch leaves the others waiting)
"""

from __future__ import annotations

import contextlib
import os
import re

import torch

from fastload.errors import ConfigError
from fastload.host import MB, SHM, SHM_FIX, shm_bytes

_use_count = getattr(torch._C, "_storage_Use_Count", None)
_new_shared = getattr(torch.UntypedStorage, "_new_shared", None)


def missing() -> list[str]:
    """The internals this torch lacks (each has a fallback; the tests want none missing)."""
    from torch.utils.data.dataloader import DataLoader, _MultiProcessingDataLoaderIter

    checks = {
        "torch._C._storage_Use_Count": _use_count is not None,
        "torch.UntypedStorage._new_shared": _new_shared is not None,
        "_MultiProcessingDataLoaderIter._shutdown_workers": hasattr(
            _MultiProcessingDataLoaderIter, "_shutdown_workers"
        ),
        # Instance attributes: set in __init__, visible in its code object.
        "DataLoader._iterator": "_iterator" in DataLoader.__init__.__code__.co_names,
        **{
            f"_MultiProcessingDataLoaderIter.{name}": name
            in _MultiProcessingDataLoaderIter.__init__.__code__.co_names
            + _MultiProcessingDataLoaderIter._reset.__code__.co_names
            for name in ("_workers", "_rcvd_idx", "_task_info")
        },
        "GradScaler._scale": "_scale" in torch.amp.GradScaler.__init__.__code__.co_names,
        "DistributedDataParallel.require_forward_param_sync": "require_forward_param_sync"
        in torch.nn.parallel.DistributedDataParallel.__init__.__code__.co_names,
    }
    return [name for name, ok in checks.items() if not ok]


def skip_next_buffer_sync(ddp) -> bool:
    """Have native DDP skip the buffer broadcast its next forward would make (it makes one in
    the first forward after a training one, then clears this flag itself); False where this
    torch has no such flag (apex's DDP, or a rename)."""
    if not hasattr(ddp, "require_forward_param_sync"):
        return False
    ddp.require_forward_param_sync = False
    return True


def grad_scale(scaler) -> torch.Tensor | None:
    """An enabled GradScaler's current scale, on the device (None when unknown)."""
    scale = getattr(scaler, "_scale", None)
    return scale if torch.is_tensor(scale) else None


def has_use_count() -> bool:
    return _use_count is not None


def use_count(storage: torch.UntypedStorage) -> int | None:
    """How many tensors/views reference `storage` (None where torch cannot say)."""
    return None if _use_count is None else int(_use_count(storage._cdata))


def new_shared_storage(nbytes: int) -> torch.UntypedStorage:
    """An untyped storage of `nbytes` in shared memory (what DataLoader workers send);
    ConfigError with the fix when /dev/shm has no room for it."""
    try:
        if _new_shared is not None:
            return _new_shared(nbytes)
        return torch.UntypedStorage(nbytes).share_memory_()
    except RuntimeError as exc:
        # torch 2.10 to 2.12 word a failed posix_fallocate with a stale errno ("Success (0)",
        # pytorch#176069), not ENOSPC: that message means /dev/shm had no room either way.
        text = str(exc)
        if "No space left on device" not in text and "allocate shared memory(shm)" not in text:
            raise
        remove_unfilled_segment(str(exc))
        shm = shm_bytes()
        room = f" ({shm[1] / MB:,.0f} MiB free of {shm[0] / MB:,.0f} MiB)" if shm else ""
        raise ConfigError(
            f"{SHM} is full{room}: a batch of {nbytes / MB:,.1f} MiB for the loader's workers "
            f"does not fit. {SHM_FIX}"
        ) from None


def remove_unfilled_segment(message: str) -> None:
    """torch creates the segment (`/dev/shm/torch_<pid>_...`), fails to fill it, and leaves
    it behind: remove it when it is this process's (its name starts with our pid)."""
    found = re.search(r"</?(torch_(\d+)_[\w]+)>", message)
    if found and int(found.group(2)) == os.getpid():
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SHM, found.group(1)))


def shutdown_workers(it) -> None:
    """Stop a DataLoader iterator's workers now instead of whenever it is garbage collected
    (an early `break` or an exception would otherwise leave them running for a while)."""
    stop = getattr(it, "_shutdown_workers", None)  # torch's own, used by its __del__
    if stop is not None:
        stop()


def stop_persistent_workers(dataloader) -> None:
    """Stop the workers a DataLoader keeps between epochs (persistent_workers=True)."""
    it = getattr(dataloader, "_iterator", None)
    if it is not None:
        shutdown_workers(it)
        dataloader._iterator = None


def stuck_worker(it) -> tuple[list, int | None, int | None]:
    """(worker processes, index of the batch being waited for, id of the worker that owes
    it) of a multi-process DataLoader iterator; missing parts are [] / None."""
    workers = list(getattr(it, "_workers", []))
    waiting = getattr(it, "_rcvd_idx", None)
    info = getattr(it, "_task_info", {}).get(waiting)
    return workers, waiting, (info[0] if info else None)
