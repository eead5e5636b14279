"""The last stage before the model: move a uint8 batch to the device, then convert,
normalise (when normalize_on=device) and apply channels_last, once, in one place.

With a GPU-decoding backend (backend=nvjpeg) the batch arrives with an "encoded" part
(JPEG bytes + crop boxes, left on the host by `transfer`); `convert` first runs the backend's
device decoder on it, which yields the uint8 image batch, then goes on as usual."""

from __future__ import annotations

import torch

from fastload.errors import ConfigError


class DevicePrep:
    def __init__(
        self, device: torch.device, normalize=None, channels_last: bool = False, decoder=None
    ):
        self.device = torch.device(device)
        self.normalize = normalize  # a fastload.data.dataset.Normalize, or None (done on CPU)
        self.channels_last = channels_last
        self.decoder = decoder  # backend.device_decoder (backend=nvjpeg), else None

    def transfer(self, batch: dict) -> dict:
        """Copy every tensor of the batch to the device; non_blocking only for pinned
        sources, where it is truly asynchronous (for pageable memory it buys nothing)."""
        return {
            k: v.to(self.device, non_blocking=v.is_pinned()) if torch.is_tensor(v) else v
            for k, v in batch.items()
        }

    def decode(self, batch: dict) -> dict:
        """Finish the deferred decode: (CPU-decoded part, encoded part) -> uint8 batch."""
        if self.decoder is None:
            raise ConfigError(
                "the batch carries encoded images (a GPU-decoding backend) but this loader gave "
                "device prep no decoder: build DevicePrep(..., decoder=backend.device_decoder)."
            )
        rest = {k: v for k, v in batch.items() if k != "encoded"}
        rest["image"] = self.decoder(batch["image"], batch["encoded"], self.device)
        return rest

    def convert(self, batch: dict) -> dict:
        if "encoded" in batch:
            batch = self.decode(batch)
        image = batch["image"]
        if image is None:
            return batch
        if self.normalize is not None:
            image = self.normalize(image)
        elif not image.is_floating_point():
            image = image.float()
        # The CPU batch may be NCHW with channels_last strides (collate's stack_images): give
        # the model the layout it asked for either way (a no-op when it already is).
        image = image.contiguous(
            memory_format=torch.channels_last if self.channels_last else torch.contiguous_format
        )
        return {**batch, "image": image}

    def __call__(self, batch: dict) -> dict:
        return self.convert(self.transfer(batch))
