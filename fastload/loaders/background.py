"""loader=bg: prefetch_generator's BackgroundGenerator around the DataLoader iterator.

A thread runs the DataLoader iterator (with num_workers=0: read, decode, augment, collate and
pin; with workers: collecting results from the worker queues) up to `max_prefetch` batches
ahead, while the training thread runs the step. It helps where the training thread would
otherwise do that host work itself, and where the step releases the GIL (CUDA kernels
launch asynchronously; a CPU step in torch ops releases it too).

The stock BackgroundGenerator swallows BaseExceptions, blocks forever on `queue.put` once
the consumer has gone (keeping the DataLoader and its workers alive), and cannot be closed;
`BackgroundIterator` fixes those:

* an exception in the thread is re-raised in the consumer thread as the same object, so
  its traceback still shows the frames where it happened;
* `close()` (called on early break, crash or exhaustion by the loader, and on garbage
  collection) sets a stop event; the producer's bounded `put` polls it, so the thread ends,
  and on its way out it closes the source iterator in its own thread (which shuts down the
  DataLoader workers: the thread that drives an iterator is the one that stops it);
* the thread is a daemon, and an atexit hook closes any still-open iterators, so a forgotten
  iterator never blocks interpreter exit.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref

from prefetch_generator import BackgroundGenerator

from fastload.errors import ConfigError
from fastload.loaders.checks import check_max_prefetch
from fastload.loaders.dataloader_stream import DataLoaderStream

log = logging.getLogger(__name__)

_POLL_S = 0.1
_END = object()


class _Producer(BackgroundGenerator):
    """The thread. It holds the queue, the source and the stop event, never the consumer-side
    `BackgroundIterator`, so dropping that object lets it be collected (and close us)."""

    def __init__(self, source, max_prefetch: int, stop: threading.Event, name: str):
        self.stop = stop
        super().__init__(source, max_prefetch=max_prefetch)  # starts the thread
        self.name = f"{name}-{self.ident}"

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def run(self):
        try:
            for item in self.generator:
                if not self._put((True, item)):
                    return
                del item  # do not keep a reference to a batch the consumer has released
            self._put((False, _END))
        except BaseException as exc:  # noqa: B036  (re-raised in the consumer thread)
            self._put((False, exc))
        finally:
            close = getattr(self.generator, "close", None)
            self.generator = None
            if close is not None:
                close()


class BackgroundIterator:
    """`BackgroundGenerator(source, max_prefetch)` that re-raises with the original traceback,
    can be closed, and stops its thread when closed or collected."""

    def __init__(
        self, source, max_prefetch: int = 2, join_timeout: float = 10.0, name: str = "fastload-bg"
    ):
        if int(max_prefetch) < 1:
            raise ConfigError(
                f"loader.max_prefetch={max_prefetch}: use 1 or more (a bounded queue)."
            )
        self._stop = threading.Event()
        self._done = False
        self.join_timeout = join_timeout
        self._thread = _Producer(iter(source), int(max_prefetch), self._stop, name)
        _live.add(self)

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        while True:
            try:
                ok, item = self._thread.queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._thread.queue.empty():
                    self._done = True
                    raise RuntimeError(
                        "the background loader thread ended without a result"
                    ) from None
        if ok:
            return item
        self.close()
        if item is _END:
            raise StopIteration
        raise item.with_traceback(item.__traceback__)

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread (after the batch it may be producing) and wait for it, bounded."""
        self._done = True
        self._stop.set()
        thread = self._thread
        while True:  # wake a producer blocked on a full queue; drop batches nobody will use
            try:
                thread.queue.get_nowait()
            except queue.Empty:
                break
        if thread is threading.current_thread() or not thread.is_alive():
            return
        thread.join(self.join_timeout if timeout is None else timeout)
        if thread.is_alive():
            log.warning(
                "the background loader thread is still inside the DataLoader after %.0fs; it "
                "stops once the current batch arrives (a stalled worker? set loader.timeout)",
                self.join_timeout if timeout is None else timeout,
            )

    def __del__(self):
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()  # no join from a finaliser: the producer notices within _POLL_S


_live: weakref.WeakSet[BackgroundIterator] = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    # Registered after torch's own exit hook, so it runs before it (atexit is LIFO) while
    # DataLoader workers can still be shut down properly.
    for it in list(_live):
        it.close(timeout=2.0)


class BackgroundLoader(DataLoaderStream):
    """loader=bg: the DataLoader iterator runs in a background thread."""

    def __init__(self, *args, max_prefetch: int = 2, **kwargs):
        check_max_prefetch(max_prefetch)
        self.max_prefetch = max_prefetch
        super().__init__(*args, **kwargs)

    @property
    def stage_batches(self) -> int:
        # the queue, plus the batch the thread holds while waiting to put it
        return super().stage_batches + self.max_prefetch + 1

    def _host_batches(self):
        return BackgroundIterator(super()._host_batches(), self.max_prefetch)
