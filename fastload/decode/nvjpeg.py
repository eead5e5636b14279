"""backend=nvjpeg: workers ship encoded JPEG bytes and crop plans; device prep decodes the batch
on the GPU (nvImageCodec, on the GPU's hardware JPEG engines where it has them) and crops and
resizes the whole batch in one kernel.

In the worker, `load` reads the header, samples the crop box on the full-resolution size (the
same RNG draw, the same box as backend=pil) and plans it (fastload/decode/batched_crop.py: the
block-aligned region that covers the box, the pre-averaging factors); `collate` packs a
batch's deferred samples into one contiguous uint8 byte tensor with offsets and the plans
(batch["encoded"]). After the transfer, DevicePrep calls this backend's `device_decoder`: one
batched nvImageCodec call decodes every image into its slot of a padded canvas (reused batch
after batch, with the decoder's image objects of its slots), then `resize_regions` crops,
block-averages, resizes and flips the batch (one Triton kernel on a GPU:
fastload/decode/crop_kernel.py).

nvImageCodec's call returns only once the batch is decoded, and on a busy GPU that takes as
long as the work queued before it (on an H200, four decodes that take 35 ms alone returned
after 250 ms behind 218 ms of queued matrix products, whether those ran on the default stream
or on a stream of their own: the CUDA decoders' share needs the SMs). In the training thread
that would stall every step's launches; loader=prefetch therefore runs device prep in a thread
of its own (fastload/loaders/cuda_prefetch.py), and the pipeline says so when backend=nvjpeg
runs with another loader.

Whole images, not regions: nvImageCodec 0.9.0 decodes no region on the GPU (every one comes
back refused on an H100, hardware and hybrid decoders alike; its issue #55), while whole
images decode at full speed; the crop reads the region out of the canvas instead.

nvImageCodec's backends, in order: the hardware decoder (NVJPG engines on A100, H100, H200,
B200 and some others; not on consumer GPUs) takes `hw_load` of each batch, the CUDA decoders
the rest and whatever the hardware refuses. The batch's decode is one call of fastload's C
extension (fastload/decode/nvimgcodec_batch.py, `backend.binding`) with the GIL released from
the first code stream to the last status; through nvImageCodec's Python binding, which takes
the GIL back once per image, the same H200 runs reached 0.78-0.82 of the ceiling, through the C
call 0.85-0.86. What it costs the model is host time more than GPU time: a compiled
ResNet-50's kernels ran as long as on a resident batch, while the training and autograd
threads' launches came later (that step is launch-bound; `bench train --profile` shows it),
now mostly beside the hardware decoder's own CUDA calls (a copy, a kernel, an event record and
a wait per image), which contend with them in the driver. Use it when the CPUs cannot keep up
(few cores per GPU); BENCHMARKS.md has the measured cost.

Files the GPU path does not take (not JPEG, CMYK/YCCK, EXIF-rotated, cut short, progressive)
are decoded in the worker with PIL (the same box), counted as decode_fallback_*, and merged
back into their batch positions on the device. An image nvImageCodec refuses on the device is
decoded on the host with PIL instead (the same box), logged and counted in
`NvjpegDecoder.refused`; one that PIL cannot decode either (damaged data behind a sound
header: the workers read headers only) is skipped and counted with dataset.skip_corrupt, else
stops the run with the file's name, as a corrupt file does in the workers
(fastload/loaders/device_prep.py).

Under `bench train --profile` the decoder's phases show in the trace as nvjpeg.* ranges on the
prep thread (waiting for a canvas, the decode call, the crop; through the Python binding also
making the code streams).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from contextlib import nullcontext

import numpy as np
import torch
from torch.profiler import record_function

from fastload.decode import nvimgcodec_batch
from fastload.decode.base import (
    DeferredSample,
    JpegOnlyBackend,
    Need,
    open_rgb,
    undecodable_message,
)
from fastload.decode.batched_crop import plan, resize_regions
from fastload.decode.jpeg_header import FALLBACK_REASONS, Counts, fallback_reason, jpeg_info
from fastload.decode.pil import pillow_name
from fastload.errors import ConfigError, CorruptImageError

log = logging.getLogger(__name__)

NVJPEG_FALLBACK_REASONS = (*FALLBACK_REASONS, "progressive")
INSTALL = "pip install 'nvidia-nvimgcodec-cu13[nvjpeg]'"


class EncodedJpeg(DeferredSample):
    """A deferred sample: the JPEG bytes, the crop box and flip, and the box's decode plan."""

    __slots__ = ("data", "box", "flip", "size", "shape", "factors", "region", "local", "index")

    def __init__(self, data: bytes, box, flip: bool, size: int, width: int, height: int):
        self.index = -1  # the dataset's index of the sample, set by ImageDataset
        self.data = np.frombuffer(data, np.uint8)
        self.box, self.flip, self.size = tuple(int(v) for v in box), bool(flip), int(size)
        self.shape = (int(width), int(height))
        self.factors, self.region, self.local = plan(self.box, self.size, width, height)

    @staticmethod
    def collate(samples: list[EncodedJpeg], positions: list[int]) -> dict:
        """Batch form shipped to the main process: one byte tensor (one shared-memory block,
        pinnable), offsets into it, the images' (width, height), the regions the crops read
        (x0, y0, w, h), the pre-averaging factors (kx, ky), the boxes in averaged region
        pixels, the flips, and the positions of these samples within the batch (the others
        are CPU-decoded fallbacks in batch["image"])."""
        lengths = [len(s.data) for s in samples]
        return {
            "data": torch.from_numpy(np.concatenate([s.data for s in samples])),
            "offsets": torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64),
            "shape": torch.tensor([s.shape for s in samples], dtype=torch.int64),
            "region": torch.tensor([s.region for s in samples], dtype=torch.int64),
            "factor": torch.tensor([s.factors for s in samples], dtype=torch.int64),
            "local": torch.tensor([s.local for s in samples], dtype=torch.float64),
            "flip": torch.tensor([s.flip for s in samples], dtype=torch.bool),
            "size": samples[0].size,
            "position": torch.tensor(positions, dtype=torch.int64),
            # the samples' dataset indices (-1: none), which name a sample that neither the
            # device nor PIL can decode (device prep asks the dataset's reader)
            "index": torch.tensor([s.index for s in samples], dtype=torch.int64),
        }


def encoded_batch(datas: list[bytes], transform, rngs) -> dict | None:
    """batch["encoded"] of the JPEGs among `datas` that the device decodes (the workers'
    fallbacks left out: not JPEG, CMYK, EXIF-rotated, cut short, progressive), each box drawn
    with its rng as a worker draws it; None when there is none. For tools that time the device
    half."""
    samples = []
    for data, rng in zip(datas, rngs, strict=True):
        info = jpeg_info(data)
        if fallback_reason(info, data) is not None or info.progressive:
            continue
        box, flip = transform.sample(info.width, info.height, rng)
        samples.append(EncodedJpeg(data, box, flip, transform.size, info.width, info.height))
    return EncodedJpeg.collate(samples, list(range(len(samples)))) if samples else None


def device_ms_per_image(reader, task, backend, device, n: int = 64, reps: int = 3):
    """This backend's device half on `device`, ms per image: up to `n` of the reader's JPEGs
    (the ones it takes: no fallbacks) drawn, planned and collated as its workers do, then
    decoded, cropped and resized as one batch (the best of `reps` after a warm-up, the device
    synchronised around each), or None where there is nothing to time (no crop transform, no
    such JPEG, nvImageCodec missing). `doctor pipeline` and loader=auto charge it to the
    model's step: it is GPU time taken from the model."""
    import time

    from fastload.data.dataset import sample_rng

    transform = getattr(task.dataset("train", reader, backend, None), "transform", None)
    if transform is None or not hasattr(transform, "sample"):
        return None
    idx = np.linspace(0, len(reader) - 1, min(n, len(reader))).astype(int).tolist()
    batch = encoded_batch([reader.get(i, "image") for i in idx], transform,
                          [sample_rng(0, 0, i) for i in idx])  # fmt: skip
    if batch is None:
        return None
    configured = getattr(backend, "device_decoder", None)
    decoder = NvjpegDecoder(**configured.__getstate__()) if configured else NvjpegDecoder()
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    try:
        decoder(None, batch, device)  # warm-up: nvImageCodec's decoders, the resize's kernels
    except ConfigError:
        return None
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        decoder(None, batch, device)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 1000 * best / (len(batch["offsets"]) - 1)


def phase(name: str):
    """A named range in a running profiler's trace, and nothing otherwise, not even
    record_function's ~13 us: this runs in the prep thread, whose Python time a launch-bound
    training thread waits for."""
    return record_function(name) if torch.autograd.profiler._is_profiler_enabled else nullcontext()


def load_nvimgcodec():
    """nvidia.nvimgcodec, set up as fastload's region decoders use it, or a ConfigError."""
    from fastload.decode import roi_nvimgcodec

    nv = roi_nvimgcodec.load()
    if nv is None:
        raise ConfigError(f"backend=nvjpeg: {roi_nvimgcodec.UNAVAILABLE_REASON}")
    return nv


class NvjpegDecoder:
    """Device prep's decode step: (CPU-decoded fallbacks or None, batch["encoded"], device)
    -> uint8 NCHW batch on `device` (channels_last strides), in sample order. On a CPU device
    it decodes with nvImageCodec's CPU backend (the same calls and the same resize), which is
    how it is tested without a GPU. Picklable (the backend travels to the loader's workers);
    the nvImageCodec decoders and canvases are made on first use, one per (device, stream):
    the training loader's prep thread and an evaluation loader each get their own."""

    def __init__(self, hw_load: float = 0.9, cpu_threads: int | None = None,
                 fancy_upsampling: bool = True, preallocate: bool = False,
                 binding: str = "auto"):  # fmt: skip
        if not 0.0 <= float(hw_load) <= 1.0:
            raise ConfigError(
                f"backend.hw_load={hw_load!r}: the share of each batch for the GPU's hardware "
                "JPEG decoder is a number from 0 (CUDA decoder only) to 1."
            )
        if cpu_threads is not None and (
            isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int) or cpu_threads < 1
        ):
            raise ConfigError(
                f"backend.cpu_threads={cpu_threads!r}: nvImageCodec's host threads for the GPU "
                "decoder, a whole number >= 1, or null (its default: about one per core)."
            )
        for key, value in (("fancy_upsampling", fancy_upsampling), ("preallocate", preallocate)):
            if not isinstance(value, bool):
                raise ConfigError(f"backend.{key}={value!r}: use true or false.")
        self.hw_load = float(hw_load)
        self.cpu_threads, self.fancy_upsampling = cpu_threads, fancy_upsampling
        self.preallocate = preallocate
        if binding not in nvimgcodec_batch.BINDINGS:
            raise ConfigError(
                f"backend.binding={binding!r}: use auto (fastload's C call where it is built), "
                "c or python (nvImageCodec's Python binding)."
            )
        self.binding = binding  # the decoders are made (and the C call loaded) on first use
        self.refused = 0  # images the device decoder refused, decoded on the host instead
        self._streams: dict = {}  # (device, stream) -> _StreamState
        self._lock = threading.Lock()
        self._nv = None

    def __getstate__(self):
        return {"hw_load": self.hw_load, "cpu_threads": self.cpu_threads,
                "fancy_upsampling": self.fancy_upsampling, "preallocate": self.preallocate,
                "binding": self.binding}  # fmt: skip

    def __setstate__(self, state):
        self.__init__(**state)

    def options(self, shapes: list) -> str:
        """nvImageCodec's decoder options: the upsampling, and with `preallocate` the hardware
        decoder's memory pool sized for a batch like `shapes` (its largest image, in slots)
        instead of the 1 x 1 image nvImageCodec reserves, which nvJPEG then grows. An unknown
        option would be ignored without a word, hence only these, tested."""
        out = [f":fancy_upsampling={int(self.fancy_upsampling)}"]
        if self.preallocate and shapes:
            hw = "nvjpeg_hw_decoder"
            out += [
                f"{hw}:preallocate_batch_size={len(shapes)}",
                f"{hw}:preallocate_width_hint={slot_side(max(w for w, _ in shapes))}",
                f"{hw}:preallocate_height_hint={slot_side(max(h for _, h in shapes))}",
            ]
        return " ".join(out)

    def _new_decoder(self, device: torch.device, shapes: list):
        """(a decoder for `device`, whether it is the C call's): the C call's where
        backend.binding lets it, else the Python binding's. On a GPU the hardware decoder
        first (where hw_load > 0), then the CUDA decoders."""
        nv = self._nv = load_nvimgcodec()
        batch, native = nvimgcodec_batch, nvimgcodec_batch.choose(self.binding)
        if device.type == "cuda":
            kinds = [(batch.GPU_ONLY, 1.0), (batch.HYBRID_CPU_GPU, 1.0)]
            if self.hw_load > 0:
                kinds.insert(0, (batch.HW_GPU_ONLY, self.hw_load))
            device_id, threads = device.index, self.cpu_threads or 0
        else:
            kinds, device_id, threads = [(batch.CPU_ONLY, 1.0)], batch.DEVICE_CPU_ONLY, 1
        if native is not None:
            return native.Decoder(device_id, threads, kinds, self.options(shapes)), True
        if self.binding == "auto":  # built but not loading: say so, not only in the results
            log.warning("backend=nvjpeg decodes through nvImageCodec's Python binding (slower "
                        "beside a launch-bound step): %s", nvimgcodec_batch.UNAVAILABLE_REASON)  # fmt: skip
        self.params = nv.DecodeParams(apply_exif_orientation=False, color_spec=nv.ColorSpec.SRGB)
        by_number = {batch.CPU_ONLY: nv.BackendKind.CPU_ONLY, batch.GPU_ONLY: nv.BackendKind.GPU_ONLY,
                     batch.HYBRID_CPU_GPU: nv.BackendKind.HYBRID_CPU_GPU,
                     batch.HW_GPU_ONLY: nv.BackendKind.HW_GPU_ONLY}  # fmt: skip
        backends = [nv.Backend(by_number[k], load_hint=hint) for k, hint in kinds]
        return nv.Decoder(device_id=device_id, max_num_cpu_threads=threads, backends=backends,
                          options=self.options(shapes)), False  # fmt: skip

    def state(self, device: torch.device, shapes: list = ()) -> _StreamState:
        """The decoder and canvas of `device`'s current stream (made on first use, for
        batches like `shapes`)."""
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (str(device), stream)
        with self._lock:
            if key not in self._streams:
                decoder, native = self._new_decoder(device, list(shapes))
                self._streams[key] = _StreamState(decoder, self._nv, device, stream, native)
            return self._streams[key]

    def __call__(self, image: torch.Tensor | None, encoded: dict, device) -> torch.Tensor:
        """The batch's images; CorruptImageError naming a sample that neither nvImageCodec nor
        PIL can decode (device prep calls `decode`, which leaves those to the dataset's
        skip_corrupt)."""
        full, lost = self.decode(image, encoded, device)
        if lost:
            raise CorruptImageError(undecodable_message(lost))
        return full

    def decode(self, image: torch.Tensor | None, encoded: dict, device):
        """(the batch's uint8 NCHW images, {batch position: (dataset index or -1, why)} of the
        samples that neither the device decoder nor PIL could decode: their rows hold no
        image)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        shapes = encoded["shape"].tolist()
        size = int(encoded["size"])
        state = self.state(device, shapes)
        out = torch.empty((len(shapes), size, size, 3), dtype=torch.uint8, device=device)
        failures: dict[int, str] = {}  # index among the encoded samples -> why
        with state.lock:  # a second thread on this stream waits for this batch's crops
            for a, b in canvas_chunks(shapes):
                part = {k: v[a:b] for k, v in encoded.items() if k in PER_SAMPLE}
                target, canvas, failed = self._decode(state, encoded, a, b, shapes)
                failures.update({a + k: why for k, why in failed.items()})
                with phase("nvjpeg.crop_resize"):
                    resize_regions(
                        canvas, part["region"], part["factor"], part["local"], part["flip"],
                        size, out=out[a:b],
                    )  # fmt: skip
                target.read_by_queued_work()
        out = out.permute(0, 3, 1, 2)
        lost = {}  # by batch position, with the dataset's index (rare: no lists made otherwise)
        if failures:
            positions, index = encoded["position"].tolist(), encoded["index"].tolist()
            lost = {positions[k]: (index[k], why) for k, why in failures.items()}
        if image is None:
            return out, lost
        n = len(shapes) + image.shape[0]
        full = torch.empty((n, *out.shape[1:]), dtype=out.dtype, device=out.device)
        on_device = torch.zeros(n, dtype=torch.bool, device=out.device)
        pos = encoded["position"].to(out.device)
        on_device[pos] = True
        full[pos] = out
        full[~on_device] = image.to(out.device)
        return full, lost

    def _decode(self, state: _StreamState, encoded: dict, a: int, b: int, shapes: list):
        """Samples a..b decoded whole, each into its slot of one of the stream's canvases (at
        the slot's top-left), in one batched nvImageCodec call: (the canvas, its pixels,
        {index from a: why} of the samples PIL could not decode either)."""
        data, offsets = encoded["data"].numpy(), encoded["offsets"]
        hmax, wmax = max(h for _, h in shapes[a:b]), max(w for w, _ in shapes[a:b])
        with phase("nvjpeg.wait_for_canvas"):
            target = state.next_canvas()
        canvas, slots = target.view(b - a, hmax, wmax, with_images=not state.native)
        if state.native:  # one C call: code streams, decode and statuses, the GIL released
            with phase("nvjpeg.decode"):
                _, rows, cols, _ = canvas.shape
                codes = state.decoder.decode(
                    data, offsets[a : b + 1].numpy(), canvas.data_ptr(), rows * cols * 3,
                    cols * 3, rows, cols, state.stream,
                )  # fmt: skip
            # the usual batch has no refusal: one C-speed count, no Python loop over it
            refused = [] if codes.count(0) == len(codes) else [k for k, c in enumerate(codes) if c]
            reasons = [nvimgcodec_batch.REFUSALS[codes[k]] for k in refused]
        else:
            offsets = offsets.tolist()
            with phase("nvjpeg.code_streams"):
                streams = [self._nv.CodeStream(data[offsets[k] : offsets[k + 1]])
                           for k in range(a, b)]  # fmt: skip
            with phase("nvjpeg.decode"):
                got = state.decoder.decode(
                    streams, images=slots, params=self.params, cuda_stream=state.stream
                )
            refused = [k for k, g in enumerate(got) if g is None]
            reasons = ["refused by the decoder"] * len(refused)
        target.host_bytes = encoded["data"]  # kept while the canvas's readers may run
        failed = {}
        if refused:
            offsets = encoded["offsets"].tolist()
            failed = self._decode_on_host(canvas, refused, data, offsets[a:], shapes[a:b],
                                          reasons)  # fmt: skip
        return target, canvas, failed

    def _decode_on_host(self, canvas, refused, data, offsets, shapes, reasons: list) -> dict:
        """PIL decodes the images the device decoder refused into their canvas slots:
        {index: why} of those it cannot decode either (damaged data behind a sound header)."""
        self.refused += len(refused)
        log.warning(
            "backend=nvjpeg: nvImageCodec refused %d of %d JPEGs of a batch on %s (%s); "
            "decoded on the host with PIL instead (%d so far)",
            len(refused), len(shapes), canvas.device,
            ", ".join(f"{n} {reason}" for reason, n in Counter(reasons).items()), self.refused,
        )  # fmt: skip
        failed = {}
        for k in refused:
            w, h = shapes[k]
            try:
                pixels = np.array(open_rgb(bytes(data[offsets[k] : offsets[k + 1]])))
                canvas[k, :h, :w] = torch.from_numpy(pixels)
            except Exception as exc:  # PIL's error on damaged data, or a size it disagrees on
                failed[k] = f"{type(exc).__name__}: {exc}"
        return failed


def slot_side(pixels: int) -> int:
    """A canvas slot's height or width for images up to `pixels`: rounded up to SLOT_GRID, so
    that batches of similar images share one slot layout (and its image objects)."""
    return -(-pixels // SLOT_GRID) * SLOT_GRID


class _StreamState:
    """One (device, stream)'s nvImageCodec decoder and its CANVASES decode targets, used in
    turn. A decode into a canvas must not start before the crops that read its previous batch
    have run, and nothing orders that on the GPU: the hardware decoder writes beside the SMs,
    while the crops may still wait for SMs the model fills. With one reused canvas and ~100 ms
    of matrix products queued per batch, the prep-thread test on an H200 got half of a batch's
    values wrong (the likely cause). So the host waits (an event) until the crops that last
    read a canvas have run before decoding into it again; with two canvases that is the batch
    before the previous one, long done in a steady pipeline. The other direction needs nothing: the call returns once the batch is decoded,
    so crops queued after it read the decoded pixels."""

    def __init__(self, decoder, nv, device: torch.device, stream: int, native: bool):
        self.decoder, self.device, self.stream, self.native = decoder, device, stream, native
        self.canvases = [_Canvas(nv, device, stream) for _ in range(CANVASES)]
        self.turn = 0
        self.lock = threading.Lock()

    def next_canvas(self) -> _Canvas:
        canvas = self.canvases[self.turn]
        self.turn = (self.turn + 1) % len(self.canvases)
        canvas.wait_for_readers()
        return canvas


class _Canvas:
    """A decode target: a uint8 buffer viewed as (n, H, W, 3) slots, and nvImageCodec image
    objects of its slots, per slot layout, made once and passed to every decode (it writes
    each image at the top-left of its slot, at the slot's row pitch). Making 256 image objects
    per batch took ~6 ms of host time on an H200's host; reused, a batch makes only its code
    streams. The buffer is kept (the largest chunk's canvas so far, below CANVAS_BYTES)."""

    def __init__(self, nv, device: torch.device, stream: int):
        self.nv, self.device, self.stream = nv, device, stream
        self.buffer: torch.Tensor | None = None
        self.layouts: dict[tuple[int, int], list] = {}
        self.readers: torch.cuda.Event | None = None
        # The JPEG bytes of the batch last decoded here: the hardware decoder may read them
        # after decode() returns, so they are kept until the crops after that decode have run.
        self.host_bytes: torch.Tensor | None = None

    def wait_for_readers(self) -> None:
        if self.readers is not None:
            self.readers.synchronize()
            self.readers = None
        self.host_bytes = None

    def read_by_queued_work(self) -> None:
        """The crops just queued on the current stream read this canvas: the next decode
        into it waits for them."""
        if self.device.type == "cuda":
            self.readers = torch.cuda.Event()
            self.readers.record(torch.cuda.current_stream(self.device))

    def view(self, n: int, height: int, width: int, with_images: bool = True):
        """(n, H, W, 3) slots for images up to height x width, and their image objects (the
        Python binding's; None without `with_images`: the C call makes its own)."""
        rows, cols = slot_side(height), slot_side(width)
        slot = rows * cols * 3
        if self.buffer is None or self.buffer.numel() < n * slot:
            self.buffer = torch.empty(n * slot, dtype=torch.uint8, device=self.device)
            self.layouts.clear()  # their images point into the old buffer
        room = self.buffer.numel() // slot
        whole = self.buffer[: room * slot].view(room, rows, cols, 3)
        if not with_images:
            return whole[:n], None
        images = self.layouts.setdefault((rows, cols), [])
        while len(images) < n:
            view = whole[len(images)]
            view = view.numpy() if self.device.type == "cpu" else view
            images.append(self.nv.as_image(view, cuda_stream=self.stream))
        return whole[:n], images[:n]


# The per-sample entries of batch["encoded"] that a chunk of the batch slices.
PER_SAMPLE = ("region", "factor", "local", "flip")
CANVASES = 2  # decode targets per stream, used in turn
CANVAS_BYTES = 1 << 30  # a chunk's canvas (samples x slot rows x slot columns x 3) stays below
SLOT_GRID = 128  # slot sides are multiples of this (ImageNet's 500 px sides: 512 px slots)


def canvas_chunks(shapes: list, limit: int = CANVAS_BYTES) -> list[tuple[int, int]]:
    """Consecutive (start, end) spans of the batch whose padded canvas fits `limit` bytes (a
    few huge photos in a batch must not make a canvas of batch x huge x huge); usually one."""
    spans, start, hmax, wmax = [], 0, 0, 0
    for k, (w, h) in enumerate(shapes):
        grown_h, grown_w = max(hmax, slot_side(h)), max(wmax, slot_side(w))
        if k > start and (k + 1 - start) * grown_h * grown_w * 3 > limit:
            spans.append((start, k))
            start, grown_h, grown_w = k, slot_side(h), slot_side(w)
        hmax, wmax = grown_h, grown_w
    spans.append((start, len(shapes)))
    return spans


class NvjpegBackend(JpegOnlyBackend):
    name = "nvjpeg"
    decoder_module, install = "nvidia.nvimgcodec", INSTALL

    @classmethod
    def needs(cls, options: dict, facts, on_cuda: bool) -> list[Need]:
        if not on_cuda:
            return [Need("decoders", "fatal", "backend=nvjpeg decodes on the GPU, and none is "
                         "used here", "Run on a GPU machine, or backend=turbo.")]  # fmt: skip
        binding = str(options.get("binding", "auto"))
        if binding == "python" or nvimgcodec_batch.built():
            return []
        return [Need("decoders", "fatal" if binding == "c" else "warn",
                     "backend=nvjpeg decodes through nvImageCodec's Python binding, whose GIL "
                     "hand-offs (one per image) delay a launch-bound training step",
                     f"{nvimgcodec_batch.BUILD_HINT}.")]  # fmt: skip

    def __init__(self, hw_load: float = 0.9, cpu_threads: int | None = None,
                 fancy_upsampling: bool = True, preallocate: bool = False,
                 binding: str = "auto"):  # fmt: skip
        if not torch.cuda.is_available():
            raise ConfigError(
                "backend=nvjpeg decodes JPEGs on the GPU with nvImageCodec, but CUDA is not "
                f"available here (torch {torch.__version__}). Use a CPU backend: backend=turbo "
                "(fastest here), backend=pil or backend=pillow-simd."
            )
        self.counts = Counts(*(f"decode_fallback_{r}" for r in NVJPEG_FALLBACK_REASONS))
        self.device_decoder = NvjpegDecoder(
            hw_load, cpu_threads, fancy_upsampling, preallocate, binding
        )

    def info(self) -> dict:
        from fastload.decode import roi_nvimgcodec

        version = roi_nvimgcodec.package_version() or "unknown"
        d = self.device_decoder
        hw = f"hardware decoder {d.hw_load:g} of each batch, " if d.hw_load else ""
        hw += f"{d.cpu_threads} host threads, " if d.cpu_threads else ""
        hw += "" if d.fancy_upsampling else "simple upsampling, "
        hw += "preallocated, " if d.preallocate else ""
        native = d.binding != "python" and nvimgcodec_batch.built()
        call = "fastload's C batch call" if native else "its Python binding"
        return {
            "decoder": f"nvjpeg (nvimgcodec-{version} through {call}, {hw}whole images, "
            "batched crop)",
            "decoder_fallback": pillow_name(),
        }

    def load_jpeg(self, data: bytes, info, box, flip: bool, transform):
        if info.progressive:  # the hardware decoder refuses them; the CUDA one is slow at them
            self.counts.add("decode_fallback_progressive")
            return self.crop_pixels(np.asarray(open_rgb(data)), box, flip, transform.size)
        return EncodedJpeg(data, box, flip, transform.size, info.width, info.height)
