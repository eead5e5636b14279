"""Single-image super-resolution (DIV2K, SRCNN): LR patch in, HR patch out, MSE, PSNR.

The batch (fastload/data/pairs.py): IMAGE = the LR patches, which device prep turns into
x / 255 (dataset.mean 0, std 1); TARGET = the HR patches, left uint8 on the device and
divided by 255 here.

Metrics, in dB, per image then averaged over the images:
* train_psnr: RGB over the whole training patch (a cheap running signal);
* val_psnr (the run's metric, higher is better): measured as SR papers measure it (the output
  clipped to [0, 1] and rounded to 8-bit levels, the luma (Y of ITU-R BT.601, as MATLAB's
  rgb2ycbcr) compared, `scale` pixels cropped off every border), but on each validation
  image's centre patch (dataset.val_patch_size LR pixels), not the whole image: compare it
  with val_psnr_bicubic, not with published whole-image DIV2K figures;
* val_psnr_bicubic: the same measure of plain bicubic upsampling of the same LR patches, the
  baseline a trained model must beat;
* val_loss: the MSE training minimises (RGB, [0, 1]).
An image whose output equals the target (MSE 0) counts PSNR_CAP_DB, not infinity, so that one
perfect patch cannot turn the mean into inf.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from fastload.data.batch import IMAGE, TARGET
from fastload.data.pairs import PairDataset, collate_pairs
from fastload.errors import ConfigError
from fastload.models.srcnn import bicubic_up
from fastload.tasks.base import SumsEvaluator, Task, TrainStep, packed_side

log = logging.getLogger("fastload")

PSNR_CAP_DB = 100.0
# BT.601 luma of [0, 1] RGB, in [16, 235] / 255 (MATLAB rgb2ycbcr, as the SR literature).
_Y_WEIGHTS = torch.tensor([65.481, 128.553, 24.966]) / 255.0


def psnr(out: torch.Tensor, target: torch.Tensor, border: int = 0, y_only: bool = False):
    """Per-image PSNR in dB (N,) of [0, 1] NCHW images, peak 1, capped at PSNR_CAP_DB;
    `border` pixels cropped off each side; `y_only`: on BT.601 luma."""
    out, target = out.double(), target.double()
    if y_only:
        w = _Y_WEIGHTS.to(out.device, torch.float64).view(1, 3, 1, 1)
        out, target = (out * w).sum(1, keepdim=True), (target * w).sum(1, keepdim=True)
    if border:
        out = out[..., border:-border, border:-border]
        target = target[..., border:-border, border:-border]
    mse = (out - target).pow(2).flatten(1).mean(1)
    return (10 * torch.log10(1.0 / mse.clamp_min(10 ** (-PSNR_CAP_DB / 10)))).clamp_max(PSNR_CAP_DB)


def to_8bit(x: torch.Tensor) -> torch.Tensor:
    """An output as saved to a PNG: clipped to [0, 1], rounded to 1/255 steps."""
    return x.float().clamp(0, 1).mul(255).round().div(255)


class SuperResolutionTask(Task):
    kind = "super_resolution"
    metric, metric_label, metric_unit = "val_psnr", "best PSNR", " dB"
    models = ("srcnn",)
    suggest = "model=srcnn optim=adam (or experiment=srcnn_div2k)"
    collate = staticmethod(collate_pairs)

    def dataset(self, split: str, reader, backend, normalize=None):
        d, train = self.data, split == "train"
        return PairDataset(
            reader,
            backend,
            scale=d.scale,
            patch_size=d.patch_size if train else d.val_patch_size,
            train=train,
            seed=self.seed,
            repeat=d.repeat if train else 1,
            skip_corrupt=d.skip_corrupt,
            normalize=normalize,
        )

    def check_storage(self, storage) -> None:
        """A pack that resizes or re-encodes the pairs (storage.kind=raw keeps 256 px unless
        storage.size=null; storage.max_side re-encodes them as JPEG) is a supported way to
        store less, but PSNR then scores the packed pixels, not the dataset's: on the same
        pairs 31.2 dB packed raw at 256 px against 33.4 dB from the files. Said once,
        before any training."""
        key, stored = packed_side(storage) or (None, None)
        if stored is not None:
            log.warning(
                "storage=%s storage.%s=%s resizes%s the super-resolution pairs as it packs "
                "them: val_psnr and val_psnr_bicubic score those pixels, not the dataset's, "
                "and compare only with runs on the same pack. storage.%s=null keeps the "
                "pairs as they are.",
                storage.name, key, stored,
                "" if key == "size" else " and re-encodes (JPEG)", key,
            )  # fmt: skip

    def step(self, state, cfg: DictConfig, ctx, amp):
        return SRStep(state, cfg, ctx, amp)

    def build_model(self, cfg: DictConfig) -> torch.nn.Module:
        """The model, whose scale follows dataset.scale (an override that differs is refused)."""
        if cfg.model.get("scale") not in (None, self.data.scale):
            raise ConfigError(
                f"model.scale={cfg.model.scale} but dataset.scale={self.data.scale}: drop the "
                f"model.scale override (it follows dataset.scale)."
            )
        return super().build_model(cfg)

    def check(self, train_reader, val_reader) -> None:
        """The scale, patch and repeat settings, and that LR files the layout names are in
        the store (a pack made without them would silently train on generated LR)."""
        d = self.data
        if not isinstance(d.scale, int) or d.scale < 2:
            raise ConfigError(f"dataset.scale={d.scale!r}: use 2, 3, 4 or 8 (DIV2K's X2..X8).")
        for key in ("patch_size", "val_patch_size", "repeat"):
            low = 4 if key != "repeat" else 1
            if isinstance(d[key], bool) or not isinstance(d[key], int) or d[key] < low:
                raise ConfigError(f"dataset.{key}={d[key]!r}: use a whole number >= {low}.")
        if list(d.mean) != [0.0] * 3 or list(d.std) != [1.0] * 3:
            raise ConfigError(
                f"dataset.mean={list(d.mean)}, dataset.std={list(d.std)}: super-resolution "
                f"reads its input as x / 255 (the model adds its output to the bicubic input, "
                f"and the PSNR compares [0, 1] pixels); keep mean [0, 0, 0] and std [1, 1, 1]."
            )
        if d.layout.get("lr"):
            for reader in (train_reader, val_reader):
                if not reader.has("lr"):
                    raise ConfigError(
                        f"dataset.layout.lr={d.layout.lr} names LR images, but "
                        f"{reader.store_root()} holds none (packed without --lr?). Delete that "
                        f"pack to re-pack it with pairs, or set dataset.layout.lr=null to "
                        f"make the LR patches by bicubic downscaling."
                    )


class SRStep(TrainStep):
    """MSE between the model's output and the HR patch, both [0, 1] RGB; train sums
    [loss sum, PSNR sum, count], validation sums [loss sum, PSNR sum, bicubic PSNR sum,
    count] (see the module doc for which PSNR)."""

    train_sums = 3

    def __init__(self, state, cfg: DictConfig, ctx, amp):
        super().__init__(state, cfg, ctx, amp)
        self.scale = int(cfg.dataset.scale)

    @staticmethod
    def target(batch: dict) -> torch.Tensor:
        return batch[TARGET].float().div_(255)

    def forward_loss(self, batch: dict):
        x, hr = batch[IMAGE], self.target(batch)
        out = self.model(x).float()
        loss = F.mse_loss(out, hr)
        n = torch.tensor(len(hr), dtype=torch.float64, device=self.device)
        with torch.no_grad():
            quality = psnr(out.clamp(0, 1), hr).sum()
        return loss, torch.stack([loss.detach().double() * len(hr), quality, n])

    @staticmethod
    def train_metrics(sums: list[float]) -> dict:
        loss_sum, psnr_sum, count = sums
        return {"train_loss": loss_sum / max(count, 1), "train_psnr": psnr_sum / max(count, 1)}

    def evaluator(self, model=None) -> SumsEvaluator:
        sums = partial(self.eval_sums, self.model if model is None else model)
        return SumsEvaluator(self.device, 4, sums, self.val_metrics)

    @torch.no_grad()
    def eval_sums(self, model, batch: dict) -> torch.Tensor:
        x, hr = batch[IMAGE], self.target(batch)
        with self.autocast():
            out = model(x)
        out = out.float()
        n = torch.tensor(len(hr), dtype=torch.float64, device=self.device)
        loss = F.mse_loss(out, hr).double() * len(hr)
        s = self.scale
        model_psnr = psnr(to_8bit(out), hr, border=s, y_only=True).sum()
        # from the exact 8-bit LR: a bf16 input (loader.input_dtype) rounds it a little
        lr = (x.float() * 255).round() / 255
        bicubic = psnr(to_8bit(bicubic_up(lr, s)), hr, border=s, y_only=True).sum()
        return torch.stack([loss, model_psnr, bicubic, n])

    @staticmethod
    def val_metrics(sums: list[float]) -> dict:
        loss, model_psnr, bicubic, n = sums
        n = max(n, 1)
        return {"val_loss": loss / n, "val_psnr": model_psnr / n, "val_psnr_bicubic": bicubic / n}
