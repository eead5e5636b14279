"""backend=nvjpeg: workers ship encoded JPEG bytes and crop plans; device prep decodes the batch
on the GPU (nvImageCodec, on the GPU's hardware JPEG engines where it has them) and crops and
resizes the whole batch in a few kernels.

In the worker, `load` reads the header, samples the crop box on the full-resolution size (the
same RNG draw, the same box as backend=pil) and plans it (fastload/decode/batched_crop.py: the
block-aligned region that covers the box, the pre-averaging factors); `collate` packs a
batch's deferred samples into one contiguous uint8 byte tensor with offsets and the plans
(batch["encoded"]). After the transfer, DevicePrep calls this backend's `device_decoder`: one
batched nvImageCodec call decodes every image into its slot of one padded canvas on the
current CUDA stream, with no synchronisation of ours (with loader=prefetch that is the side
stream; nvImageCodec's call itself appears to return only once the batch is decoded, so on an
H100 the decode still held the training thread ~18 ms per batch of 256), then
`resize_regions` gathers each crop's region, block-averages, resizes and flips the batch.

Whole images, not regions: nvImageCodec 0.9.0 decodes no region on the GPU (every one comes
back refused on an H100, hardware and hybrid decoders alike; its issue #55), while whole
images decode at full speed; the crop costs a gather on the GPU instead.

nvImageCodec's backends, in order: the hardware decoder (NVJPG engines on A100, H100, H200,
B200 and some others; not on consumer GPUs) takes `hw_load` of each batch, the CUDA decoders
the rest and whatever the hardware refuses. The GPU time it takes comes out of the model's on
the same GPU (the engines run beside the SMs, the hybrid decoder and the resize on them): use
it when the CPUs cannot keep up (few cores per GPU); BENCHMARKS.md has the measured cost.

Files the GPU path does not take (not JPEG, CMYK/YCCK, EXIF-rotated, progressive) are decoded
in the worker with PIL (the same box), counted as decode_fallback_*, and merged back into
their batch positions on the device. An image nvImageCodec refuses on the device is decoded
on the host with PIL instead (the same box), logged and counted in `NvjpegDecoder.refused`.
"""

from __future__ import annotations

import logging
from collections import deque

import numpy as np
import torch

from fastload.decode.base import DeferredSample, JpegOnlyBackend, Need, open_rgb
from fastload.decode.batched_crop import plan, resize_regions
from fastload.decode.jpeg_header import FALLBACK_REASONS, Counts, fallback_reason, jpeg_info
from fastload.decode.pil import pillow_name
from fastload.errors import ConfigError

log = logging.getLogger(__name__)

NVJPEG_FALLBACK_REASONS = (*FALLBACK_REASONS, "progressive")
INSTALL = "pip install 'nvidia-nvimgcodec-cu13[nvjpeg]'"


class EncodedJpeg(DeferredSample):
    """A deferred sample: the JPEG bytes, the crop box and flip, and the box's decode plan."""

    __slots__ = ("data", "box", "flip", "size", "shape", "factors", "region", "local")

    def __init__(self, data: bytes, box, flip: bool, size: int, width: int, height: int):
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
        }


def encoded_batch(datas: list[bytes], transform, rngs) -> dict | None:
    """batch["encoded"] of the JPEGs among `datas` that the device decodes (the workers'
    fallbacks left out: not JPEG, CMYK, EXIF-rotated, progressive), each box drawn with its
    rng as a worker draws it; None when there is none. For tools that time the device half."""
    samples = []
    for data, rng in zip(datas, rngs, strict=True):
        info = jpeg_info(data)
        if fallback_reason(info) is not None or info.progressive:
            continue
        box, flip = transform.sample(info.width, info.height, rng)
        samples.append(EncodedJpeg(data, box, flip, transform.size, info.width, info.height))
    return EncodedJpeg.collate(samples, list(range(len(samples)))) if samples else None


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
    the nvImageCodec decoders are made on first use, one per device."""

    def __init__(self, hw_load: float = 0.9):
        if not 0.0 <= float(hw_load) <= 1.0:
            raise ConfigError(
                f"backend.hw_load={hw_load!r}: the share of each batch for the GPU's hardware "
                "JPEG decoder is a number from 0 (CUDA decoder only) to 1."
            )
        self.hw_load = float(hw_load)
        self.refused = 0  # images the device decoder refused, decoded on the host instead
        self._decoders: dict = {}
        self._in_flight: deque = deque()  # (event, host bytes) until the decode has run
        self._nv = None

    def __getstate__(self):
        return {"hw_load": self.hw_load}

    def __setstate__(self, state):
        self.__init__(**state)

    def _decoder(self, device: torch.device):
        key = str(device)
        if key not in self._decoders:
            nv = self._nv = load_nvimgcodec()
            kind = nv.BackendKind
            if device.type == "cuda":
                backends = [nv.Backend(kind.GPU_ONLY), nv.Backend(kind.HYBRID_CPU_GPU)]
                if self.hw_load > 0:
                    backends.insert(0, nv.Backend(kind.HW_GPU_ONLY, load_hint=self.hw_load))
                dec = nv.Decoder(device_id=device.index, backends=backends)
            else:
                dec = nv.Decoder(
                    device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY,
                    max_num_cpu_threads=1,
                    backends=[nv.Backend(kind.CPU_ONLY)],
                )
            self.params = nv.DecodeParams(
                apply_exif_orientation=False, color_spec=nv.ColorSpec.SRGB
            )
            self._decoders[key] = dec
        return self._decoders[key]

    def __call__(self, image: torch.Tensor | None, encoded: dict, device) -> torch.Tensor:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        shapes = encoded["shape"].tolist()
        size = int(encoded["size"])
        out = torch.empty((len(shapes), size, size, 3), dtype=torch.uint8, device=device)
        for a, b in canvas_chunks(shapes):
            part = {k: v[a:b] for k, v in encoded.items() if k in PER_SAMPLE}
            canvas = self._decode(encoded, a, b, shapes, device)
            resize_regions(
                canvas, part["region"], part["factor"], part["local"], part["flip"], size,
                out=out[a:b],
            )  # fmt: skip
        out = out.permute(0, 3, 1, 2)
        if image is None:
            return out
        n = len(shapes) + image.shape[0]
        full = torch.empty((n, *out.shape[1:]), dtype=out.dtype, device=out.device)
        on_device = torch.zeros(n, dtype=torch.bool, device=out.device)
        pos = encoded["position"].to(out.device)
        on_device[pos] = True
        full[pos] = out
        full[~on_device] = image.to(out.device)
        return full

    def _decode(self, encoded: dict, a: int, b: int, shapes: list, device) -> torch.Tensor:
        """Samples a..b decoded whole, each into its slot of one (b - a, H, W, 3) canvas, in
        one batched nvImageCodec call on the current stream (no host synchronisation)."""
        dec = self._decoder(device)
        nv = self._nv
        data, offsets = encoded["data"].numpy(), encoded["offsets"].tolist()
        hmax, wmax = max(h for _, h in shapes[a:b]), max(w for w, _ in shapes[a:b])
        canvas = torch.empty((b - a, hmax, wmax, 3), dtype=torch.uint8, device=device)
        on_gpu = device.type == "cuda"
        stream = torch.cuda.current_stream(device).cuda_stream if on_gpu else 0
        streams, slots = [], []
        for k in range(a, b):
            w, h = shapes[k]
            streams.append(nv.CodeStream(data[offsets[k] : offsets[k + 1]]))
            view = canvas[k - a, :h, :w]
            slots.append(nv.as_image(view if on_gpu else view.numpy(), cuda_stream=stream))
        got = dec.decode(streams, images=slots, params=self.params, cuda_stream=stream)
        if on_gpu:
            # The hardware decoder may read the host bytes after decode() returns: keep them
            # until the stream has passed this batch's decode.
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
            self._in_flight.append((done, encoded["data"]))
            while self._in_flight and self._in_flight[0][0].query():
                self._in_flight.popleft()
        refused = [k for k, g in enumerate(got) if g is None]
        if refused:
            self._decode_on_host(canvas, refused, data, offsets[a:], shapes[a:b])
        return canvas

    def _decode_on_host(self, canvas, refused, data, offsets, shapes) -> None:
        """PIL decodes the images the device decoder refused into their canvas slots."""
        self.refused += len(refused)
        log.warning(
            "backend=nvjpeg: nvImageCodec refused %d of %d JPEGs of a batch on %s; decoded "
            "on the host with PIL instead (%d so far)",
            len(refused), len(shapes), canvas.device, self.refused,
        )  # fmt: skip
        for k in refused:
            w, h = shapes[k]
            pixels = np.array(open_rgb(bytes(data[offsets[k] : offsets[k + 1]])))
            canvas[k, :h, :w] = torch.from_numpy(pixels)


# The per-sample entries of batch["encoded"] that a chunk of the batch slices.
PER_SAMPLE = ("region", "factor", "local", "flip")
CANVAS_BYTES = 1 << 30  # a chunk's canvas (samples x tallest x widest x 3) stays below this


def canvas_chunks(shapes: list, limit: int = CANVAS_BYTES) -> list[tuple[int, int]]:
    """Consecutive (start, end) spans of the batch whose padded canvas fits `limit` bytes (a
    few huge photos in a batch must not make a canvas of batch x huge x huge); usually one."""
    spans, start, hmax, wmax = [], 0, 0, 0
    for k, (w, h) in enumerate(shapes):
        grown_h, grown_w = max(hmax, h), max(wmax, w)
        if k > start and (k + 1 - start) * grown_h * grown_w * 3 > limit:
            spans.append((start, k))
            start, grown_h, grown_w = k, h, w
        hmax, wmax = grown_h, grown_w
    spans.append((start, len(shapes)))
    return spans


class NvjpegBackend(JpegOnlyBackend):
    name = "nvjpeg"
    decoder_module, install = "nvidia.nvimgcodec", INSTALL

    @classmethod
    def needs(cls, options: dict, facts, on_cuda: bool) -> list[Need]:
        if on_cuda:
            return []
        return [Need("decoders", "fatal", "backend=nvjpeg decodes on the GPU, and none is used "
                     "here", "Run on a GPU machine, or backend=turbo.")]  # fmt: skip

    def __init__(self, hw_load: float = 0.9):
        if not torch.cuda.is_available():
            raise ConfigError(
                "backend=nvjpeg decodes JPEGs on the GPU with nvImageCodec, but CUDA is not "
                f"available here (torch {torch.__version__}). Use a CPU backend: backend=turbo "
                "(fastest here), backend=pil or backend=pillow-simd."
            )
        self.counts = Counts(*(f"decode_fallback_{r}" for r in NVJPEG_FALLBACK_REASONS))
        self.device_decoder = NvjpegDecoder(hw_load)

    def info(self) -> dict:
        from fastload.decode import roi_nvimgcodec

        version = roi_nvimgcodec.package_version() or "unknown"
        hw = (
            f"hardware decoder {self.device_decoder.hw_load:g} of each batch, "
            if (self.device_decoder.hw_load)
            else ""
        )
        return {
            "decoder": f"nvjpeg (nvimgcodec-{version}, {hw}whole images, batched crop)",
            "decoder_fallback": pillow_name(),
        }

    def load_jpeg(self, data: bytes, info, box, flip: bool, transform):
        if info.progressive:  # the hardware decoder refuses them; the CUDA one is slow at them
            self.counts.add("decode_fallback_progressive")
            return self.crop_pixels(np.asarray(open_rgb(data)), box, flip, transform.size)
        return EncodedJpeg(data, box, flip, transform.size, info.width, info.height)
