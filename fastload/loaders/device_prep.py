"""The last stage before the model: move a uint8 batch to the device, then convert,
normalise (when normalize_on=device) and apply channels_last, once, in one place.

With a GPU-decoding backend (backend=nvjpeg) the batch arrives with an "encoded" part
(JPEG bytes + crop boxes, left on the host by `transfer`); `convert` first runs the backend's
device decoder on it, which yields the uint8 image batch, then goes on as usual."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastload.data.batch import ENCODED, IMAGE, SKIPPED, SKIPPED_FILES, TARGET
from fastload.decode.base import undecodable_message, undecodable_where
from fastload.errors import ConfigError, CorruptImageError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def map_tensors(fn: Callable[[torch.Tensor], object], obj):
    """Apply `fn` to every tensor of a nested batch (dicts, lists, tuples, namedtuples);
    everything else (strings, numbers, a `meta` dict of them, None) passes through as is."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    return obj


def iter_tensors(obj):
    """Every tensor of a nested batch, depth first."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)


def drop_undecodable(batch: dict, lost: dict, skip: bool, describe=None) -> dict:
    """The batch without the samples the device decoder could not decode (nor PIL after it),
    skipped and counted as the workers skip a corrupt file (`skip`: dataset.skip_corrupt), or
    the error that names the file (`describe`: the dataset reader's)."""
    image, target = batch[IMAGE], batch[TARGET]
    if not skip or not torch.is_tensor(target) or len(target) != len(image):
        raise CorruptImageError(undecodable_message(lost, describe))
    keep = torch.ones(len(image), dtype=torch.bool)
    keep[list(lost)] = False
    out = {**batch, SKIPPED: batch[SKIPPED] + len(lost)}
    out[SKIPPED_FILES] = [*batch.get(SKIPPED_FILES, ()), *undecodable_where(lost, describe)]
    if not keep.any():  # as collate gives a batch whose every sample was skipped
        return {**out, IMAGE: None, TARGET: None}
    out[IMAGE], out[TARGET] = image[keep.to(image.device)], target[keep.to(target.device)]
    return out


class DevicePrep:
    def __init__(
        self,
        device: torch.device,
        normalize=None,
        channels_last: bool = False,
        dtype: torch.dtype = torch.float32,
        decoder=None,
        skip_corrupt: bool = False,
        describe=None,
    ):
        self.device = torch.device(device)
        # a fastload.data.dataset.Normalize, or None (done on CPU); its mean/std are moved to
        # the device once here, not copied host-to-device at every batch.
        self.normalize = normalize.to(self.device) if normalize is not None else None
        self.channels_last = channels_last
        self.dtype = dtype
        self.decoder = decoder  # backend.device_decoder (backend=nvjpeg), else None
        # A sample the device decoder cannot decode either: skipped and counted, or the error
        # naming it (describe: the dataset reader's, index -> where the sample lives).
        self.skip_corrupt, self.describe = skip_corrupt, describe

    def transfer(self, batch):
        """Copy every tensor of the (nested) batch to the device; non_blocking only for
        pinned sources, where it is truly asynchronous (for pageable memory it buys nothing).
        The encoded part of a GPU-decoding batch stays on the host: nvImageCodec parses the
        headers and nvJPEG reads its input from host memory."""
        if isinstance(batch, dict) and ENCODED in batch:
            rest = {k: v for k, v in batch.items() if k != ENCODED}
            return {**self.transfer(rest), ENCODED: batch[ENCODED]}
        return map_tensors(lambda v: v.to(self.device, non_blocking=v.is_pinned()), batch)

    def decode(self, batch: dict) -> dict:
        """Finish the deferred decode: (CPU-decoded part, encoded part) -> uint8 batch."""
        if self.decoder is None:
            raise ConfigError(
                "the batch carries encoded images (a GPU-decoding backend) but this loader gave "
                "device prep no decoder: build DevicePrep(..., decoder=backend.device_decoder)."
            )
        rest = {k: v for k, v in batch.items() if k != ENCODED}
        decode = getattr(self.decoder, "decode", None)
        if decode is None:
            rest[IMAGE] = self.decoder(batch[IMAGE], batch[ENCODED], self.device)
            return rest
        rest[IMAGE], lost = decode(batch[IMAGE], batch[ENCODED], self.device)
        return drop_undecodable(rest, lost, self.skip_corrupt, self.describe) if lost else rest

    def _convert_image(self, image: torch.Tensor) -> torch.Tensor:
        if image.dim() == 4:
            # The CPU batch may be NCHW with channels_last strides (collate's stack_images):
            # give the model the layout it asked for either way (a no-op when it already
            # is), on the integer batch, which moves a quarter of the float's bytes.
            fmt = torch.channels_last if self.channels_last else torch.contiguous_format
            image = image.contiguous(memory_format=fmt)
        if self.normalize is not None:
            return self.normalize(image, self.dtype)  # elementwise: keeps the layout
        return image if image.dtype == self.dtype else image.to(self.dtype)

    def convert(self, batch):
        """uint8 -> float (or the configured dtype), normalise, channels_last: the batch's
        "image" entry only (a tensor, or a list of tensors of different sizes); every other
        entry is left as it is."""
        if not isinstance(batch, dict):
            return batch
        if ENCODED in batch:  # a GPU-decoding backend: decode first, then as usual
            batch = self.decode(batch)
        image = batch.get("image")
        if torch.is_tensor(image):
            image = self._convert_image(image)
        elif isinstance(image, (list, tuple)) and all(torch.is_tensor(i) for i in image):
            image = type(image)(self._convert_image(i) for i in image)
        else:
            return batch  # None: every sample of the batch was skipped
        return {**batch, "image": image}

    def __call__(self, batch):
        return self.convert(self.transfer(batch))
