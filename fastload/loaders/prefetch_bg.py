"""loader=prefetch+bg: the background thread and the CUDA prefetcher together.

The order that overlaps the most, and why:

    DataLoader iterator ──(thread: BackgroundIterator)──► queue ──► CUDA prefetcher ──► step
    host work: worker queues,                            training thread: async H2D copy +
    unpickling, pinning; with                            convert on the side stream, one
    num_workers=0 decode+augment too                     batch ahead

* The thread takes the host-side work, the part that costs the training thread real time
  (milliseconds to seconds per batch with num_workers=0) and that it would otherwise do
  between two steps while the GPU idles.
* The prefetcher stays in the training thread: queuing an async copy and a few kernels costs
  microseconds, and its safety argument (`wait_stream` on the consumer's current stream,
  `record_stream`, an event per batch; see cuda_prefetch.py) is about the thread that runs the
  model (with a GPU-decoding backend the prefetcher's device prep has a thread of its own,
  cuda_prefetch.py says why). In the other order the thread would queue GPU work against a
  stream that is not the model's and hold `max_prefetch` extra batches in GPU memory for
  nothing.

This is plain cooperative inheritance: BackgroundLoader overrides the host stage,
CudaPrefetchLoader the device stage; no code here, and no if/elif over strategy names.
"""

from __future__ import annotations

from fastload.loaders.background import BackgroundLoader
from fastload.loaders.cuda_prefetch import CudaPrefetchLoader


class PrefetchBackgroundLoader(CudaPrefetchLoader, BackgroundLoader):
    """loader=prefetch+bg (MRO: CudaPrefetch -> Background -> Baseline)."""
