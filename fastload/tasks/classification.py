"""Image classification: an image folder's classes, cross-entropy, top-1 / top-5."""

from __future__ import annotations

import math
from functools import partial

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from fastload.data.batch import IMAGE, TARGET
from fastload.data.dataset import ImageDataset
from fastload.errors import ConfigError
from fastload.tasks.base import SumsEvaluator, Task, TrainStep


class ClassificationTask(Task):
    kind = "classification"
    metric, metric_label, metric_unit = "val_acc1", "best top-1", " %"
    models = ("resnet18", "resnet50")

    def __init__(self, item_cost_ms: float = 0.0, **settings):
        super().__init__(**settings)
        if not isinstance(item_cost_ms, (int, float)) or item_cost_ms < 0:
            raise ConfigError(
                f"dataset.task.item_cost_ms={item_cost_ms!r}: use a number of milliseconds >= 0."
            )
        self.item_cost_ms = float(item_cost_ms)

    def dataset(self, split: str, reader, backend, normalize=None):
        return ImageDataset(
            reader,
            backend,
            instantiate(self.data[f"{split}_transform"]),
            seed=self.seed,
            skip_corrupt=self.data.skip_corrupt,
            normalize=normalize,
            item_cost_ms=self.item_cost_ms,
        )

    def sample_bytes(self, dataset, where: str) -> int | None:
        """3 x size x size (uint8, or float32 when normalised in the workers); None when
        unknown (a custom dataset) or when decode is deferred to device prep."""
        size = getattr(getattr(dataset, "transform", None), "size", None)
        backend = getattr(dataset, "backend", None)
        if not isinstance(size, int) or getattr(backend, "device_decoder", None) is not None:
            return None
        return 3 * size * size * (4 if where == "cpu" else 1)

    def check(self, train_reader, val_reader) -> None:
        """dataset.num_classes against the class folders, and the splits against each other,
        before training: a model with too few outputs fails part-way through an epoch
        (IndexError: Target 2 is out of bounds), too many trains silently, and val class
        folders that differ from train's misalign every target."""
        classes, where = train_reader.classes, train_reader.store_root()
        if not classes:
            raise ConfigError(
                f"{where} has no class folders: classification needs <split>/<class>/<image> "
                f"(an ImageFolder); for COCO use dataset=coco, for DIV2K dataset=div2k."
            )
        if self.data.num_classes != len(classes):
            shown = ", ".join(classes[:6]) + (", ..." if len(classes) > 6 else "")
            raise ConfigError(
                f"dataset.num_classes={self.data.num_classes}, but {where} has "
                f"{len(classes)} class folders ({shown}): set dataset.num_classes={len(classes)}."
            )
        if tuple(val_reader.classes) != tuple(classes):
            extra = sorted(set(val_reader.classes) ^ set(classes))[:6]
            raise ConfigError(
                f"the class folders of {val_reader.store_root()} differ from those of {where} "
                f"({', '.join(extra) or 'same names, other order'}): targets would not match. "
                f"Give both splits the same class folders."
            )

    def step(self, state, cfg: DictConfig, ctx, amp):
        return ClassificationStep(state, cfg, ctx, amp)


class ClassificationStep(TrainStep):
    """Cross-entropy (with optim.label_smoothing); train sums [loss sum, correct, count],
    validation sums [loss sum, top-1 correct, top-5 correct, count]. The validation loss is
    plain cross-entropy, as timm's: with smoothing it has a floor above 0 that depends on
    optim.label_smoothing, so runs with different smoothing could not be compared on it."""

    train_sums = 3

    def __init__(self, state, cfg: DictConfig, ctx, amp):
        super().__init__(state, cfg, ctx, amp)
        smoothing = cfg.optim.get("label_smoothing") or 0.0  # null: none, as check_options says
        self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=smoothing)

    def forward_loss(self, batch: dict):
        x, y = batch[IMAGE], batch[TARGET]
        out = self.model(x)
        loss = self.criterion(out, y)
        n = torch.tensor(len(y), dtype=torch.float64, device=self.device)
        correct = (out.argmax(1) == y).sum().double()
        return loss, torch.stack([loss.detach().double() * len(y), correct, n])

    @staticmethod
    def train_metrics(sums: list[float]) -> dict:
        loss_sum, correct, count = sums
        return {
            "train_loss": loss_sum / max(count, 1),
            "train_acc1": 100.0 * correct / max(count, 1),
        }

    def evaluator(self, model=None) -> SumsEvaluator:
        sums = partial(self.eval_sums, self.model if model is None else model)
        return SumsEvaluator(self.device, 4, sums, self.val_metrics)

    @torch.no_grad()
    def eval_sums(self, model, batch: dict) -> torch.Tensor:
        x, y = batch[IMAGE], batch[TARGET]
        with self.autocast():
            out = model(x)
        loss = torch.nn.functional.cross_entropy(out.float(), y)
        top5 = out.topk(min(5, out.shape[1]), dim=1).indices
        n = torch.tensor(len(y), dtype=torch.float64, device=self.device)
        top1 = (top5[:, 0] == y).sum().double()
        hits5 = (top5 == y[:, None]).any(1).sum().double()
        if out.shape[1] <= 5:  # every label is in the top 5 of 5 classes: no measurement
            hits5 = torch.full_like(hits5, math.nan)
        return torch.stack([loss.double() * len(y), top1, hits5, n])

    @staticmethod
    def val_metrics(sums: list[float]) -> dict:
        """val_acc5 is null with 5 classes or fewer (it would be 100 % for any model)."""
        loss, top1, top5, n = sums
        n = max(n, 1)
        acc5 = None if math.isnan(top5) else 100 * top5 / n
        return {"val_loss": loss / n, "val_acc1": 100 * top1 / n, "val_acc5": acc5}
