"""backend=nvjpeg: workers ship encoded JPEG bytes; device prep decodes the batch on the GPU.

In the worker, `load` reads the header, samples the crop box on the full-resolution size (the
same RNG draw, the same box as backend=pil) and returns an `EncodedJpeg` instead of pixels;
`collate` packs a batch's deferred samples into one contiguous uint8 byte tensor with
offsets, boxes and flips (batch["encoded"]). After the transfer, DevicePrep calls this
backend's `device_decoder`: one batched `torchvision.io.decode_jpeg(list, device=cuda)` call
(nvJPEG), then per image an antialiased bilinear resized_crop (torchvision's antialias
matches PIL's resize) and the flip, on the GPU.

Files nvJPEG cannot turn into the reference image (not JPEG, CMYK/YCCK, EXIF-rotated) are
decoded in the worker with PIL (same transform), counted as decode_fallback_*, and merged back
into their batch positions on the device. The worker-side fallback keeps a bad file's error
in the worker, with its path; a JPEG that passes the header check but that nvJPEG rejects
fails the whole batch (decode_jpeg returns no partial results) with the batch's error.
"""

from __future__ import annotations

import numpy as np
import torch

from fastload.decode.base import DeferredSample, JpegOnlyBackend
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


class NvjpegDecoder:
    """Device prep's decode step: (CPU-decoded fallbacks or None, batch["encoded"], device)
    -> uint8 NCHW batch on `device`, in sample order. Runs on CPU too (torchvision's
    libjpeg-turbo path), which is how it is tested without a GPU."""

    def __call__(self, image: torch.Tensor | None, encoded: dict, device) -> torch.Tensor:
        from torchvision.io import ImageReadMode, decode_jpeg
        from torchvision.transforms.v2 import functional as F

        data, offsets = encoded["data"], encoded["offsets"].tolist()
        chunks = [data[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
        decoded = decode_jpeg(chunks, mode=ImageReadMode.RGB, device=device)
        size = int(encoded["size"])
        crops = []
        for img, (left, top, w, h), flip in zip(
            decoded, encoded["box"].tolist(), encoded["flip"].tolist(), strict=True
        ):
            out = F.resized_crop(img, top, left, h, w, [size, size], antialias=True)
            crops.append(out.flip(-1) if flip else out)
        out = torch.stack(crops)
        if image is None:
            return out
        n = len(crops) + image.shape[0]
        full = torch.empty((n, *out.shape[1:]), dtype=out.dtype, device=out.device)
        on_device = torch.zeros(n, dtype=torch.bool, device=out.device)
        pos = encoded["position"].to(out.device)
        on_device[pos] = True
        full[pos] = out
        full[~on_device] = image.to(out.device)
        return full


class NvjpegBackend(JpegOnlyBackend):
    name = "nvjpeg"

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
