"""The last stage before the model: move a uint8 batch to the device, then convert,
normalise (when normalize_on=device) and apply channels_last, once, in one place."""

from __future__ import annotations

import torch


class DevicePrep:
    def __init__(self, device: torch.device, normalize=None, channels_last: bool = False):
        self.device = torch.device(device)
        self.normalize = normalize  # a fastload.data.dataset.Normalize, or None (done on CPU)
        self.channels_last = channels_last

    def transfer(self, batch: dict) -> dict:
        """Copy every tensor of the batch to the device; non_blocking only for pinned
        sources, where it is truly asynchronous (for pageable memory it buys nothing)."""
        return {
            k: v.to(self.device, non_blocking=v.is_pinned()) if torch.is_tensor(v) else v
            for k, v in batch.items()
        }

    def convert(self, batch: dict) -> dict:
        image = batch["image"]
        if image is None:
            return batch
        if self.normalize is not None:
            image = self.normalize(image)
        elif not image.is_floating_point():
            image = image.float()
        if self.channels_last:
            image = image.contiguous(memory_format=torch.channels_last)
        return {**batch, "image": image}

    def __call__(self, batch: dict) -> dict:
        return self.convert(self.transfer(batch))
