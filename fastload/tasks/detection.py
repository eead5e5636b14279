"""Object detection on a COCO instances split: torchvision detection models, the sum of
their loss dict, COCO box mAP with pycocotools' COCOeval.

The metric: val_map = COCO AP@[.50:.95] (COCOeval's stats[0]) and val_map50 = AP@.50, both
on a 0-100 scale (as the detection papers and model zoos print them; COCOeval's 0-1 x 100).

The ground truth is the validation split's annotation file (dataset.layout's
`annotations`) whenever it is there, whatever the storage: the official protocol, crowd
regions and all. A pack used without its dataset folder has no such file; the ground truth
is then what the pack holds (crowd and degenerate boxes already dropped), and the log says so.
"""

from __future__ import annotations

import contextlib
import io
import logging
from functools import partial
from pathlib import Path

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from fastload import dist
from fastload.data.batch import IMAGE, TARGET
from fastload.data.detection import (
    DetectionDataset,
    category_ids,
    collate_detection,
    dropped_counts,
)
from fastload.errors import ConfigError
from fastload.tasks.base import Evaluator, Task, TrainStep, packed_side

log = logging.getLogger("fastload")


def where(reader) -> str:
    """The annotation file of a disk/tmpfs split, else the store's folder (a pack)."""
    return str(getattr(getattr(reader, "source", None), "annotations", reader.store_root()))


class DetectionTask(Task):
    kind = "detection"
    metric, metric_label, metric_unit = "val_map", "best mAP@[.5:.95]", ""
    models = (
        "fcos_tiny",
        "fasterrcnn_resnet50_fpn",
        "retinanet_resnet50_fpn",
        "fcos_resnet50_fpn",
        "fasterrcnn_mobilenet_v3_large_320_fpn",
    )
    suggest = "model=fcos_tiny on a CPU, model=fasterrcnn_resnet50_fpn on a GPU"
    collate = staticmethod(collate_detection)

    def dataset(self, split: str, reader, backend, normalize=None):
        transform = instantiate(self.data[f"{split}_transform"])
        if split != "train" and getattr(transform, "hflip", 0):
            # the boxes flip with the pixels, but the detections are scored against the
            # annotation file's unflipped boxes: a mirrored, silently low mAP
            raise ConfigError(
                f"dataset.{split}_transform.hflip={transform.hflip}: evaluation scores the "
                f"detections against the annotations as they are, so its images are not "
                f"flipped. Set dataset.{split}_transform.hflip=0."
            )
        common = dict(seed=self.seed, skip_corrupt=self.data.skip_corrupt, normalize=normalize)
        return DetectionDataset(reader, backend, transform, train=split == "train", **common)

    def check(self, train_reader, val_reader) -> None:
        """dataset.num_classes against the annotation file's categories (a model with too few
        outputs fails mid-epoch; too many trains outputs no label ever uses), and the two
        splits' categories against each other (labels would mean different things), and
        that the device prep does not normalise (the model does)."""
        d = self.data
        if list(d.mean) != [0.0] * 3 or list(d.std) != [1.0] * 3:
            raise ConfigError(
                f"dataset.mean={list(d.mean)}, dataset.std={list(d.std)}: a detection model "
                f"normalises its input itself (torchvision's ImageNet mean/std, on x / 255), so "
                f"these would normalise it twice; keep mean [0, 0, 0] and std [1, 1, 1]."
            )
        ids = category_ids(train_reader)
        if self.data.num_classes != len(ids):
            raise ConfigError(
                f"dataset.num_classes={self.data.num_classes}, but {where(train_reader)} has "
                f"{len(ids)} categories (ids {ids[:8].tolist()}{' ...' if len(ids) > 8 else ''}):"
                f" set dataset.num_classes={len(ids)} (object categories; the model adds the "
                f"background class itself)."
            )
        val_ids = category_ids(val_reader)
        if not np.array_equal(val_ids, ids):
            raise ConfigError(
                f"the categories of {where(val_reader)} (ids {val_ids.tolist()[:8]}) differ from "
                f"those of {where(train_reader)} (ids {ids.tolist()[:8]}): labels would not "
                f"match. Use the annotation files of one dataset for both splits."
            )

    def check_storage(self, storage) -> None:
        """A pack stored smaller than the training resize's shorter side (storage.kind=raw
        keeps 256 px by default, an ImageNet size) is upscaled on every image: a blurred
        training set, said once before any work."""
        key, stored = packed_side(storage) or (None, None)
        wanted = self.data.train_transform.get("min_size")
        if wanted is not None and not isinstance(wanted, int):  # a list: the largest
            wanted = max(wanted)
        if stored and wanted and stored < wanted:
            log.warning(
                "storage=%s stores the images at most %d px on their longer side "
                "(storage.%s=%d), but dataset.train_transform.min_size=%d resizes their shorter "
                "side to %d: every training image is upscaled %.1fx or more, a blurred set. "
                "Pack them at full size (storage.%s=null) or at least as large as "
                "dataset.train_transform.max_size.",
                storage.name, stored, key, stored, wanted, wanted, wanted / stored, key,
            )  # fmt: skip

    def epoch_info(self, reader) -> dict:
        """What the training split left out: crowd and degenerate annotations, images without
        any usable box (fastload/data/detection.py)."""
        return {f"dropped_{k}": int(v) for k, v in dropped_counts(reader).items()}

    def step(self, state, cfg: DictConfig, ctx, amp):
        return DetectionStep(state, cfg, ctx, amp)


class DetectionStep(TrainStep):
    """torchvision detection models return their losses as a dict in train mode: their sum
    is the loss. Train sums [loss x images, images]; validation: COCO mAP."""

    train_sums = 2

    def __init__(self, state, cfg: DictConfig, ctx, amp):
        super().__init__(state, cfg, ctx, amp)
        self.cfg, self.ctx = cfg, ctx
        self.truth: GroundTruth | None = None  # built at the first evaluation

    def forward_loss(self, batch: dict):
        images, targets = batch[IMAGE], batch[TARGET]
        wanted = [{"boxes": t["boxes"], "labels": t["labels"]} for t in targets]
        losses = self.model(images, wanted)
        loss = sum(losses.values())
        n = torch.tensor(len(images), dtype=torch.float64, device=self.device)
        return loss, torch.stack([loss.detach().double() * n, n])

    @staticmethod
    def train_metrics(sums: list[float]) -> dict:
        loss_sum, count = sums
        return {"train_loss": loss_sum / max(count, 1)}

    def evaluator(self, model=None) -> CocoEvaluator:
        if self.truth is None:
            self.truth = GroundTruth.from_config(self.cfg)
        return CocoEvaluator(
            partial(self.predict, self.model if model is None else model), self.truth
        )

    @torch.no_grad()
    def predict(self, model, images: list) -> list[dict]:
        """In fp32 whatever trainer.precision trains in, as torchvision's detection reference
        evaluates: under bf16 autocast the box decoders run in bf16 (8 bits of mantissa:
        coordinates on 4-8 px steps at COCO's 800-1333 px, scores on 1/256 steps), which
        lowers mAP by points. One image at a time, as that reference evaluates (batch 1): the
        model pads a batch to its largest image, and the padding changes the detections, so
        the same weights scored differently with the batch size and the world size (on the
        tests' set: mAP 32.6 at batch 1, 43.3 at 4, 43.7 at 4 on 3 ranks)."""
        return [out for im in images for out in model([im.float()])]


class GroundTruth:
    """The validation split's category ids (label k is category_ids[k - 1]) and, when it is
    there, its annotation file (read on rank 0 only, when evaluating)."""

    def __init__(self, category_ids: np.ndarray, annotations: Path | None):
        self.category_ids, self.annotations = category_ids, annotations
        self._file_coco = None  # the file parsed once (val2017's takes ~1 s), on rank 0

    @classmethod
    def from_config(cls, cfg: DictConfig) -> GroundTruth:
        layout = instantiate(cfg.dataset.layout)
        split = cfg.dataset.val_split
        reader = instantiate(cfg.storage).open(layout, split)
        file = layout.annotation_file(split) if hasattr(layout, "annotation_file") else None
        if file is None or not Path(file).is_file():
            log.info("no annotation file %s: mAP against the boxes %s holds (crowd regions "
                     "were dropped when packing)", file, reader.store_root())  # fmt: skip
            file = None
        return cls(category_ids(reader), file)

    def coco(self, images: dict):
        """pycocotools' COCO of the file, or of the evaluated images' own boxes."""
        from pycocotools.coco import COCO

        with contextlib.redirect_stdout(io.StringIO()):
            if self.annotations is not None:
                self._file_coco = self._file_coco or COCO(str(self.annotations))
                return self._file_coco
            coco = COCO()
            coco.dataset = boxes_as_coco(images, self.category_ids)
            coco.createIndex()
        return coco


def boxes_as_coco(images: dict, category_ids) -> dict:
    """{image_id: (h, w, gt (n, 5) x, y, w, h, category id, dets)} -> a COCO instances dict."""
    anns = []
    for image_id, (_, _, gt, _) in images.items():
        for x, y, w, h, cat in gt.tolist():
            anns.append({"id": len(anns) + 1, "image_id": image_id, "bbox": [x, y, w, h],
                         "area": w * h, "iscrowd": 0, "category_id": int(cat)})  # fmt: skip
    return {
        "images": [{"id": i, "height": h, "width": w} for i, (h, w, _, _) in images.items()],
        "annotations": anns,
        "categories": [{"id": int(c), "name": str(c)} for c in category_ids],
    }


class CocoEvaluator(Evaluator):
    """Collects each image's detections (boxes in the decoded image's pixels, x, y, w, h;
    category ids) and its own boxes; `result` gathers them on rank 0, runs COCOeval there
    and hands every rank the same numbers."""

    def __init__(self, predict, truth: GroundTruth):
        self.predict, self.truth = predict, truth
        self.images: dict[int, tuple] = {}  # image_id -> (h, w, gt (n, 5), dets (m, 6))

    def add(self, batch: dict) -> None:
        outputs = self.predict(batch[IMAGE])
        for image, target, out in zip(batch[IMAGE], batch[TARGET], outputs, strict=True):
            h, w = (int(v) for v in target["orig_size"].tolist())
            scale = np.array([w / image.shape[-1], h / image.shape[-2]] * 2, np.float64)
            keep = out["labels"] > 0  # 0: background (never a COCO category)
            dets = self.detections(out["boxes"][keep], out["labels"][keep], scale)
            scores = out["scores"][keep].double().cpu().numpy()[:, None]
            gt = self.detections(target["boxes"], target["labels"], scale)
            self.images[int(target["image_id"])] = (h, w, gt, np.hstack([dets[:, :4], scores,
                                                                         dets[:, 4:]]))  # fmt: skip

    def detections(self, boxes, labels, scale) -> np.ndarray:
        """(n, 5) x, y, w, h in decoded-image pixels, COCO category id."""
        xyxy = boxes.double().cpu().numpy().reshape(-1, 4) * scale
        cats = self.truth.category_ids[labels.cpu().numpy() - 1]
        return np.hstack([xyxy[:, :2], xyxy[:, 2:] - xyxy[:, :2], cats[:, None]])

    def result(self, ctx) -> dict:
        parts = dist.gather_lists(list(self.images.items()), ctx)
        metrics = None
        if ctx.is_main:
            images = dict(parts)
            metrics = coco_map(self.truth.coco(images), images)
        return dist.broadcast_object(metrics, ctx)


def coco_map(gt, images: dict) -> dict:
    """COCOeval (bbox) of the detections in `images` against `gt` over those images only
    (a subset run evaluates its subset). Detections are rescaled to the size `gt` records
    for the image (a pack re-encoded at a max side stores smaller images; none where the file
    states no size, or 0). 0-100; 0 when
    there is nothing to evaluate or nothing was detected."""
    from pycocotools.cocoeval import COCOeval

    rows = []
    for image_id, (h, w, _, dets) in images.items():
        info = gt.imgs[image_id]
        # a width/height of 0 or null is not stated, as CocoSource.sizes reads it
        sx, sy = (info.get("width") or w) / w, (info.get("height") or h) / h
        for x, y, bw, bh, score, cat in dets.tolist():
            rows.append([image_id, x * sx, y * sy, bw * sx, bh * sy, score, cat])
    if not rows:
        return {"val_map": 0.0, "val_map50": 0.0, "val_map75": 0.0}
    with contextlib.redirect_stdout(io.StringIO()):  # COCOeval prints its tables
        evaluation = COCOeval(gt, gt.loadRes(np.array(rows, np.float64)), "bbox")
        evaluation.params.imgIds = sorted(images)
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    ap, ap50, ap75 = (max(0.0, float(v)) * 100 for v in evaluation.stats[:3])  # -1: no GT
    return {"val_map": ap, "val_map50": ap50, "val_map75": ap75}
