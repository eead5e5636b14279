"""backend=nvjpeg: workers ship encoded JPEG bytes; device prep decodes the batch on the GPU.

In the worker, `load` reads the header, samples the crop box on the full-resolution size (the
same RNG draw, the same box as backend=pil) and returns an `EncodedJpeg` instead of pixels;
`collate` packs a batch's deferred samples into one contiguous uint8 byte tensor with
offsets, boxes and flips (batch["encoded"]). After the transfer, DevicePrep calls this
backend's `device_decoder`: the encoded bytes stay in host memory (nvJPEG reads them from
there), one batched `torchvision.io.decode_jpeg(list, device=cuda)` call decodes the batch,
then `batched_resized_crop` crops, resizes and flips it in a few kernels per group of images.

GPU decoding is not free: it runs on the GPU that trains, synchronously in the training
thread, so its GPU time comes out of the model's. Measured on an H100 (BENCHMARKS.md, "On an H100"):
decode_jpeg alone 6,691 img/s, ~0.15 ms of GPU per ImageNet-sized JPEG, 38 ms per batch of
256, while a compiled ResNet-50 step on that batch takes ~45 ms: use it when the CPUs cannot
keep up (few cores per GPU), not by default.

Files nvJPEG cannot turn into the reference image (not JPEG, CMYK/YCCK, EXIF-rotated) are
decoded in the worker with PIL (same transform), counted as decode_fallback_*, and merged back
into their batch positions on the device. The worker-side fallback keeps a bad file's error
in the worker, with its path; a JPEG that passes the header check but that nvJPEG rejects
fails the whole batch (decode_jpeg returns no partial results) with the batch's error.
"""

from __future__ import annotations

import numpy as np
import torch

from fastload.decode.base import DeferredSample, JpegOnlyBackend, Need
from fastload.decode.jpeg_header import FALLBACK_REASONS, Counts
from fastload.decode.pil import pillow_name
from fastload.errors import ConfigError


class EncodedJpeg(DeferredSample):
    """A deferred sample: the JPEG bytes plus the crop that the device decoder will apply."""

    __slots__ = ("data", "box", "flip", "size")

    def __init__(self, data: bytes, box, flip: bool, size: int):
        self.data = np.frombuffer(data, np.uint8)
        self.box, self.flip, self.size = tuple(int(v) for v in box), bool(flip), int(size)

    @staticmethod
    def collate(samples: list[EncodedJpeg], positions: list[int]) -> dict:
        """Batch form shipped to the main process: one byte tensor (one shared-memory block,
        pinnable), offsets into it, boxes (left, top, w, h), flips, and the positions of these
        samples within the batch (the others are CPU-decoded fallbacks in batch["image"])."""
        lengths = [len(s.data) for s in samples]
        return {
            "data": torch.from_numpy(np.concatenate([s.data for s in samples])),
            "offsets": torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64),
            "box": torch.tensor([s.box for s in samples], dtype=torch.int64),
            "flip": torch.tensor([s.flip for s in samples], dtype=torch.bool),
            "size": samples[0].size,
            "position": torch.tensor(positions, dtype=torch.int64),
        }


GROUP = 64  # images per batched crop call: bounds the padded canvas (64 x 3 x 640^2 fp16: 157 MB)


def crop_plan(box, size: int, height: int, width: int):
    """For one box (left, top, w, h) of a height x width image: the integer pre-averaging
    factors (kx, ky) (antialiasing, as turbo's cv2 path: exact block means while the
    downscale is >= 2), the block-aligned source region (x0, y0, nx * kx, ny * ky) that
    covers the box, and the box in the averaged region's pixels."""
    left, top, w, h = box
    kx, ky = max(1, w // size), max(1, h // size)
    nx, ny = -(-w // kx), -(-h // ky)
    x0 = max(0, min(left, width - nx * kx))
    y0 = max(0, min(top, height - ny * ky))
    nx, ny = min(nx, width // kx), min(ny, height // ky)
    return (kx, ky), (x0, y0, nx * kx, ny * ky), ((left - x0) / kx, (top - y0) / ky, w / kx, h / ky)


def batched_resized_crop(images: list, boxes: list, flips: list, size: int) -> torch.Tensor:
    """Crop each CHW uint8 image to its box, resize to size x size (bilinear, PIL's pixel
    centres, block-averaged first where the downscale is >= 2), flip where asked; returns
    uint8 NCHW. A few kernels per group of images with the same averaging factors (a padded
    canvas, one avg_pool2d, one grid_sample), not a chain of kernels per image."""
    import torch.nn.functional as F

    device = images[0].device
    out = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=device)
    plans = [
        crop_plan(b, size, img.shape[1], img.shape[2]) for img, b in zip(images, boxes, strict=True)
    ]
    groups: dict[tuple, list[int]] = {}
    for i, (k, _, _) in enumerate(plans):
        groups.setdefault(k, []).append(i)
    work = torch.float16 if device.type == "cuda" else torch.float32
    for (kx, ky), members in groups.items():
        for start in range(0, len(members), GROUP):
            idx = members[start : start + GROUP]
            canvas = _canvas([images[i] for i in idx], [plans[i][1] for i in idx]).to(work)
            if kx > 1 or ky > 1:
                canvas = F.avg_pool2d(canvas, (ky, kx))
            theta = _thetas([plans[i][2] for i in idx], [flips[i] for i in idx], canvas.shape)
            grid = F.affine_grid(
                theta.to(device, work), [len(idx), 3, size, size], align_corners=False
            )
            warped = F.grid_sample(canvas, grid, "bilinear", "border", align_corners=False)
            out[torch.tensor(idx, device=device)] = warped.round_().clamp_(0, 255).to(torch.uint8)
    return out


def _canvas(images: list, regions: list) -> torch.Tensor:
    """The regions, top-left aligned on one canvas whose rest repeats each region's last
    column and row (so bilinear taps past a region's edge see its border, as PIL's do)."""
    hmax = max(r[3] for r in regions)
    wmax = max(r[2] for r in regions)
    canvas = torch.empty(
        (len(images), 3, hmax, wmax), dtype=images[0].dtype, device=images[0].device
    )
    for c, img, (x0, y0, w, h) in zip(canvas, images, regions, strict=True):
        c[:, :h, :w] = img[:, y0 : y0 + h, x0 : x0 + w]
        c[:, :h, w:] = c[:, :h, w - 1 : w]
        c[:, h:, :] = c[:, h - 1 : h, :]
    return canvas


def _thetas(boxes: list, flips: list, shape) -> torch.Tensor:
    """affine_grid matrices mapping output pixel centres to `src = left + (i + 0.5) * w / size
    - 0.5` in canvas pixels (PIL's mapping), the flip folded in as i -> size - 1 - i."""
    _, _, hc, wc = shape
    rows = []
    for (left, top, w, h), flip in zip(boxes, flips, strict=True):
        a, d = w / wc, h / hc
        b, e = 2 * left / wc + a - 1, 2 * top / hc + d - 1
        rows.append([[-a if flip else a, 0.0, b], [0.0, d, e]])
    return torch.tensor(rows, dtype=torch.float32)


class NvjpegDecoder:
    """Device prep's decode step: (CPU-decoded fallbacks or None, batch["encoded"], device)
    -> uint8 NCHW batch on `device`, in sample order. Runs on CPU too (torchvision's
    libjpeg-turbo path), which is how it is tested without a GPU."""

    def __call__(self, image: torch.Tensor | None, encoded: dict, device) -> torch.Tensor:
        from torchvision.io import ImageReadMode, decode_jpeg

        data, offsets = encoded["data"], encoded["offsets"].tolist()
        chunks = [data[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
        device = torch.device(device)
        if device.type == "cuda":
            # nvJPEG may write its outputs before work already queued on this stream has run,
            # into memory the caching allocator just handed back from it (vision PR #9606,
            # torchcodec #1634): let that work finish first. decode_jpeg synchronises its
            # stream before returning anyway, so this moves the wait, it does not add one.
            torch.cuda.current_stream(device).synchronize()
        decoded = decode_jpeg(chunks, mode=ImageReadMode.RGB, device=device)
        boxes, flips = encoded["box"].tolist(), encoded["flip"].tolist()
        out = batched_resized_crop(decoded, boxes, flips, int(encoded["size"]))
        if image is None:
            return out
        n = len(decoded) + image.shape[0]
        full = torch.empty((n, *out.shape[1:]), dtype=out.dtype, device=out.device)
        on_device = torch.zeros(n, dtype=torch.bool, device=out.device)
        pos = encoded["position"].to(out.device)
        on_device[pos] = True
        full[pos] = out
        full[~on_device] = image.to(out.device)
        return full


class NvjpegBackend(JpegOnlyBackend):
    name = "nvjpeg"
    decoder_module, install = "torchvision", "pip install torchvision"

    @classmethod
    def needs(cls, options: dict, facts, on_cuda: bool) -> list[Need]:
        if on_cuda:
            return []
        return [Need("decoders", "fatal", "backend=nvjpeg decodes on the GPU, and none is used "
                     "here", "Run on a GPU machine, or backend=turbo.")]  # fmt: skip

    def __init__(self):
        if not torch.cuda.is_available():
            raise ConfigError(
                "backend=nvjpeg decodes JPEGs on the GPU with nvJPEG (torchvision.io.decode_jpeg"
                "(device='cuda')), but CUDA is not available here (torch "
                f"{torch.__version__}). Use a CPU backend: backend=turbo (fastest here), "
                "backend=pil or backend=pillow-simd."
            )
        self.counts = Counts(*(f"decode_fallback_{r}" for r in FALLBACK_REASONS))
        self.device_decoder = NvjpegDecoder()

    def info(self) -> dict:
        import torchvision

        return {
            "decoder": f"nvjpeg (torchvision-{torchvision.__version__} decode_jpeg, batched)",
            "decoder_fallback": pillow_name(),
        }

    def load_jpeg(self, data: bytes, info, box, flip: bool, transform):
        return EncodedJpeg(data, box, flip, transform.size)
