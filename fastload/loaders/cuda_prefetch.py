"""loader=prefetch: copy and convert the next batch on a side CUDA stream while the current
one computes (the apex / timm PrefetchLoader idea, in the shape of timm's later fix).

Per loader, one side stream (timm#2781: a stream per epoch leaked memory). For each batch:

1. `side.wait_stream(consumer)`: the side stream starts only after everything the training
   thread has queued so far. Every kernel that reads an earlier batch was queued before
   the consumer let go of that batch, and the consumer is suspended in `next()` while we
   queue, so memory the caching allocator hands back to the side stream is never
   overwritten while a queued kernel may still read it.
2. On the side stream: pinned uint8 tensors are copied with non_blocking=True (the host
   allocator keeps each pinned source alive until its copy has finished), then DevicePrep
   converts: float (or loader.input_dtype), normalise, channels_last. The uint8 copy is
   freed on the side stream, which is also its only user.
3. An event is recorded after the batch's work; at hand-over the consumer's current stream
   waits on that event only (waiting on the whole side stream would also wait for the
   *next* batch's copy and serialise the overlap away), and every tensor of the batch gets
   `record_stream(consumer)`, so the allocator does not reuse its memory before the
   consumer's work on it is done even if the consumer uses the batch past step 1's reach
   (for example, keeps it beyond the next step).

With a backend that decodes on the device (backend=nvjpeg), device prep runs in a prep thread
instead, `PREP_AHEAD` batches ahead: nvImageCodec's decode call returns once the batch is
decoded, which on a busy GPU takes as long as the work queued before it (it releases the GIL
meanwhile), so in the training thread it would stall the next step's launches at every batch
(on an H100 the step lost ~18 ms per batch of 256 that way). The thread skips step 1, whose
argument needs the consumer suspended in `next()` while we queue; memory stays safe without it:
the caching allocator hands the side stream only blocks of its own pool, a batch's blocks are
reused only after the consumer's uses recorded by step 3 have run, and the decoder keeps its
canvases and host bytes until their readers have run.

Normalisation happens here exactly once, on the GPU: the builder refuses loader.normalize_on=cpu
with this loader (`normalizes_on_device`).
Nested batches (dicts, lists, tuples, with non-tensor entries such as `meta`) are mapped
recursively; non-tensors pass through. Without CUDA the loader falls back to the baseline's
same-thread transfer, says so once, and yields the same batches.
"""

from __future__ import annotations

import logging

import torch

from fastload.loaders.background import BackgroundIterator
from fastload.loaders.dataloader_stream import DataLoaderStream
from fastload.loaders.device_prep import map_tensors

log = logging.getLogger(__name__)
_said_no_cuda = False
PREP_AHEAD = 2  # device-decoded batches the prep thread keeps ready (each ~77 MB at 256x224²)


class CudaPrefetchLoader(DataLoaderStream):
    """loader=prefetch: one batch ahead, copied and converted on a side CUDA stream."""

    normalizes_on_device = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        device = self.device_prep.device
        self.stream = None
        if device.type == "cuda" and torch.cuda.is_available():
            self.stream = torch.cuda.Stream(device=device)
            # DevicePrep moved mean/std to the GPU on the current stream; make sure that copy
            # has landed before the side stream first reads them.
            torch.cuda.current_stream(device).synchronize()
            if not self.pin_memory:
                log.warning(
                    "loader=prefetch with loader.pin_memory=false: copies from pageable memory "
                    "are synchronous, so the side stream hides nothing (apex#304). Set "
                    "loader.pin_memory=true (or auto)."
                )
        else:
            global _said_no_cuda
            if not _said_no_cuda:
                _said_no_cuda = True
                log.info(
                    "loader: no CUDA device (trainer.device=%s), so the CUDA prefetcher runs "
                    "as a plain same-thread transfer; batches are the same",
                    device,
                )

    @property
    def prep_thread(self) -> bool:
        """Device prep runs in its own thread: the backend decodes on the device."""
        return self.device_prep.decoder is not None

    @property
    def stage_batches(self) -> int:
        # the batch being prepared on the side stream; with the prep thread, its queue and
        # the batch it holds while waiting to put it
        return super().stage_batches + 1 + (PREP_AHEAD + 1 if self.prep_thread else 0)

    def _device_batches(self, host_batches):
        if self.stream is None:
            yield from super()._device_batches(host_batches)
            return
        if self.prep_thread:
            yield from self._threaded_device_batches(host_batches)
            return
        side, device = self.stream, self.device_prep.device
        drain = self._device_stage_waits_for_gpu()  # the side stream waits for the consumer
        pending = None  # (batch, event) prepared on the side stream, not yet handed over
        for host in host_batches:
            if drain:
                self._drain_device()
            consumer = torch.cuda.current_stream(device)  # the training thread's, right now
            with torch.cuda.stream(side):
                side.wait_stream(consumer)  # (1) above
                batch = self.device_prep(host)  # (2): transfer() then convert()
                ready = torch.cuda.Event()
                ready.record(side)
            del host
            if pending is not None:
                yield self._hand_over(*pending)
            pending = (batch, ready)
            del batch
        if pending is not None:
            yield self._hand_over(*pending)

    def _threaded_device_batches(self, host_batches):
        prepared = BackgroundIterator(
            self._prepare(host_batches), max_prefetch=PREP_AHEAD, name="fastload-prep"
        )
        try:
            for batch, ready in prepared:
                yield self._hand_over(batch, ready)
                del batch
        finally:
            prepared.close()

    def _prepare(self, host_batches):
        """The prep thread's loop: step 2 on the side stream for each batch, with its event."""
        side, device = self.stream, self.device_prep.device
        with torch.cuda.device(device), torch.cuda.stream(side):  # both are per thread
            for host in host_batches:
                batch = self.device_prep(host)
                ready = torch.cuda.Event()
                ready.record(side)
                del host
                yield batch, ready
                del batch

    def _hand_over(self, batch, ready):
        consumer = torch.cuda.current_stream(self.device_prep.device)
        consumer.wait_event(ready)  # (3)

        def keep_for_consumer(t):
            if t.is_cuda:
                t.record_stream(consumer)
            return t

        map_tensors(keep_for_consumer, batch)
        return batch
