"""The stall watchdog: when no batch arrives within loader.timeout, name the worker that owes
it, make it print its own stacks, print the main process's, and say what to check."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
import traceback

from fastload.errors import LoaderStallError
from fastload.loaders.workers import fault_stream
from fastload.torch_internals import stuck_worker

log = logging.getLogger("fastload.loaders")


def format_thread_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f'Thread "{names.get(ident, ident)}":\n{stack}')
    return "\n".join(parts)


@contextlib.contextmanager
def main_process_batch(timeout: float):
    """With num_workers=0 there is no worker to time out: dump the stacks if one batch
    takes longer than `timeout` (0: no watchdog)."""
    stream = fault_stream() if timeout else None
    if stream is None:
        yield
        return
    faulthandler.dump_traceback_later(timeout, exit=False, file=stream)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def is_timeout(exc: RuntimeError) -> bool:
    """torch's DataLoader raises RuntimeError('DataLoader timed out after N seconds'); a
    worker's own error re-raised (a network read that "timed out") is not a stall."""
    return str(exc).startswith("DataLoader timed out after")


def stall_error(it, timeout: float) -> LoaderStallError:
    """No batch within loader.timeout: say which worker owes it, dump stacks, and how to fix."""
    workers, waiting, stuck = stuck_worker(it)
    who = ", ".join(
        f"worker {i} (pid {w.pid}, {'alive' if w.is_alive() else 'dead'})"
        for i, w in enumerate(workers)
    )
    if stuck is not None and stuck < len(workers):
        pid = workers[stuck].pid
        culprit = f"worker {stuck} (pid {pid}) owes batch #{waiting} of this epoch"
        if hasattr(signal, "SIGUSR1"):
            try:
                os.kill(pid, signal.SIGUSR1)  # it prints its own stacks to stderr
                time.sleep(0.2)
                culprit += "; its Python stacks were printed to stderr"
            except OSError:
                pass
    else:
        culprit = "no single worker could be named"
    log.error(
        "loader stalled for %ss; workers: %s. Main-process stacks:\n%s",
        timeout,
        who or "none",
        format_thread_stacks(),
    )
    return LoaderStallError(
        f"the data loader produced no batch for loader.timeout={timeout:g}s: {culprit} "
        f"(workers: {who or 'none'}; main-process stacks are in the log). Check the "
        f"dataset's I/O for that item (network file system, a lock, a huge or corrupt file), "
        f"check /dev/shm (df -h /dev/shm; docker run --shm-size=8g), or raise loader.timeout "
        f"if items are legitimately this slow."
    )
