"""The detection sample path inside a worker: storage -> whole-image decode -> resize with a
max size + horizontal flip that move the boxes -> (uint8 CHW image, target dict).

A target is a dict of tensors, what torchvision's detection models take:
    boxes     (n, 4) float32 x0, y0, x1, y1 in pixels of the transformed image
    labels    (n,) int64, contiguous 1..K (0 is the background of torchvision's models); the
              category ids of the annotations file map to them in id order
    image_id  () int64, the COCO image id
    orig_size (2,) int64 (height, width) of the decoded image: the evaluator maps predicted
              boxes back to it, then (when they differ) to the annotation file's size

`collate_detection` batches them into {IMAGE: list of uint8 CHW tensors (sizes differ),
TARGET: list of target dicts, SKIPPED, COUNTS, SKIPPED_FILES} (fastload/data/batch.py).
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from fastload.data import rawimage
from fastload.data.batch import IMAGE, SKIPPED, TARGET, Skipped, put_optional, sum_counts
from fastload.data.dataset import sample_rng, undecodable
from fastload.data.frames import in_stored_frame
from fastload.errors import DatasetError


class ResizeFlip:
    """Resize so the shorter side is `min_size` unless the longer would pass `max_size`
    (torchvision's GeneralizedRCNNTransform rule, done here once, in uint8, in the workers),
    then flip horizontally with probability `hflip`; the boxes move with the pixels.
    `min_size` may be a list: one is drawn per sample from its (seed, epoch, index) RNG
    (multi-scale training, as torchvision's GeneralizedRCNNTransform and Detectron2's
    ResizeShortestEdge pick one per image; training only, evaluation takes one size)."""

    def __init__(self, min_size=800, max_size: int = 1333, hflip: float = 0.0):
        sizes = [min_size] if isinstance(min_size, (int, float)) else list(min_size)
        if not sizes or min(sizes) < 1 or max_size < max(sizes):
            raise ValueError(f"ResizeFlip: need 1 <= min_size <= max_size ({min_size}, {max_size})")
        self.min_sizes, self.max_size, self.hflip = [int(s) for s in sizes], int(max_size), hflip

    def output_size(self, height: int, width: int, min_size: int) -> tuple[int, int]:
        scale = min(min_size / min(height, width), self.max_size / max(height, width))
        return max(1, round(height * scale)), max(1, round(width * scale))

    def __call__(self, pixels: np.ndarray, boxes: np.ndarray, rng: np.random.Generator):
        """uint8 HWC pixels, float32 (n, 4) xyxy boxes -> the same, transformed."""
        h, w = pixels.shape[:2]
        size = self.min_sizes[int(rng.integers(len(self.min_sizes)))]
        nh, nw = self.output_size(h, w, size)
        if (nh, nw) != (h, w):
            img = Image.fromarray(pixels).resize((nw, nh), Image.BILINEAR)
            pixels = np.asarray(img)
            boxes = boxes * np.array([nw / w, nh / h, nw / w, nh / h], np.float32)
        if self.hflip and rng.random() < self.hflip:
            pixels = pixels[:, ::-1]
            boxes = np.stack([nw - boxes[:, 2], boxes[:, 1], nw - boxes[:, 0], boxes[:, 3]], 1)
        return np.ascontiguousarray(pixels), boxes.astype(np.float32).reshape(-1, 4)


def xywh_to_xyxy(boxes: np.ndarray) -> np.ndarray:
    out = np.asarray(boxes, np.float32).reshape(-1, 4).copy()
    out[:, 2:] += out[:, :2]
    return out


def category_ids(reader) -> np.ndarray:
    """The sorted COCO category ids of a split, whatever its storage: the source's (disk,
    tmpfs) or what the pack recorded (lmdb, shards)."""
    source = getattr(reader, "source", None)
    if source is not None and hasattr(source, "category_ids"):
        return np.asarray(source.category_ids, np.int64)
    ids = getattr(reader, "meta", {}).get("params", {}).get("category_ids")
    if ids is None:
        raise DatasetError(
            f"{reader.store_root()} holds no COCO category ids: detection needs a COCO split "
            f"(dataset.layout=CocoLayout; a pack made with --source coco)."
        )
    return np.asarray(ids, np.int64)


def dropped_counts(reader) -> dict:
    """Annotations the source left out (crowd, degenerate boxes) and its images without any
    box, from the source (disk, tmpfs) or the pack's record of it; {} when unknown."""
    source = getattr(reader, "source", None)
    if source is not None and hasattr(source, "dropped"):
        return dict(source.dropped)
    return dict(getattr(reader, "meta", {}).get("params", {}).get("dropped") or {})


class DetectionDataset(torch.utils.data.Dataset):
    """A COCO split as (image, target) samples, indexed by (epoch, index) keys like
    ImageDataset. train=True leaves out the images without any usable box once crowd and
    degenerate boxes are dropped (Detectron2 drops crowd-only images too): they teach nothing
    but cost a step; they are counted in the epoch row (dropped_images_without_boxes).
    torchvision's detection reference (`_coco_remove_images_without_annotations`) differs
    at the edges: it keeps an image whose only boxes are crowd ones (trained with no box)
    and leaves out one whose every box is at most 1 px wide or tall (kept here: such boxes
    are not degenerate). A box with no area once resized (a sliver whose float32 edges
    meet) is left out of its sample's target and counted (dropped_degenerate_resized).
    Evaluation keeps every image: detections on an empty image are false positives.

    Where the annotation file is here (disk, tmpfs), each decoded image is checked against
    the width and height it states, and decoded in its stored frame when that is the frame
    its boxes are in (fastload/data/frames.py; counted as `stored_frame_images`); a pack made
    the same check when it was written."""

    def __init__(self, reader, backend, transform, *, seed: int, train: bool,
                 skip_corrupt: bool = False, normalize=None):  # fmt: skip
        self.reader, self.backend, self.transform = reader, backend, transform
        self.seed, self.skip_corrupt, self.normalize = int(seed), skip_corrupt, normalize
        self.category_ids = category_ids(reader)
        # the annotation file's (width, height) per image: None for a pack (checked when made)
        self.stated = getattr(getattr(reader, "source", None), "sizes", None)
        n = len(reader)
        keep = np.arange(n, dtype=np.int64)
        if train:
            # the store's box counts (a source's offsets, a pack's index or manifest): reading
            # every record's labels was a pass over the whole split (webdataset: fetching and
            # hashing every shard) on every rank before the first step
            boxed = reader.nonempty("labels")
            if boxed is None:
                boxed = [self.has_boxes(i) for i in range(n)]
            keep = np.flatnonzero(np.asarray(boxed, bool)).astype(np.int64)
        self.indices = keep  # numpy: no per-worker refcount copies
        if n and not len(self.indices):
            raise DatasetError(
                f"none of the {n} images of {reader.store_root()} has a usable box (crowd and "
                f"degenerate boxes are dropped): nothing to train on. Check the annotation file."
            )

    def __len__(self) -> int:
        return len(self.indices)

    def has_boxes(self, index: int) -> bool:
        labels = self.reader.get(index, "labels")  # None: in a skipped corrupt shard
        return labels is not None and len(labels) > 0

    def labels(self, category: np.ndarray, index: int) -> np.ndarray:
        ok = np.isin(category, self.category_ids)
        if not ok.all():
            raise DatasetError(
                f"{self.reader.describe(index)} has category id {int(category[~ok][0])}, which "
                f"is not among the annotation file's categories {self.category_ids.tolist()}."
            )
        return np.searchsorted(self.category_ids, category) + 1

    def decode(self, data, index: int):
        """(uint8 HWC pixels in the frame of the image's boxes, decoded in its stored frame),
        or a Skipped for undecodable bytes."""
        try:
            if rawimage.is_raw(data):
                return rawimage.pixels(data), False
            pixels = self.backend.decode_rgb(data)
        except Exception as exc:  # any decoder's failure on bad bytes
            return undecodable(self, index, exc), False
        if self.stated is None:
            return pixels, False
        where = self.reader.describe(index)
        if not in_stored_frame(data, self.stated[index], where, shown=pixels.shape[1::-1]):
            return pixels, False
        return self.backend.decode_rgb(data, exif=False), True

    def __getitem__(self, key):
        epoch, position = key if isinstance(key, tuple) else (0, key)
        index = int(self.indices[position])
        self.reader.epoch = epoch  # its reads count in this epoch's row
        pixels, stored_frame = self.decode(self.reader.get(index, "image"), index)
        if isinstance(pixels, Skipped):
            return pixels
        image_id = self.reader.get(index, "image_id")
        boxes, category = self.reader.get(index, "boxes"), self.reader.get(index, "labels")
        h, w = pixels.shape[:2]
        rng = sample_rng(self.seed, epoch, index)
        pixels, xyxy = self.transform(pixels, xywh_to_xyxy(boxes), rng)
        # a box with area in the file's float64 pixels can have none in float32 once resized
        # (torchvision's detectors stop the run on it, naming no file): left out, counted
        kept = (xyxy[:, 2] > xyxy[:, 0]) & (xyxy[:, 3] > xyxy[:, 1])
        xyxy, category = xyxy[kept], category[kept]
        if not pixels.flags.writeable:  # a raw record's view of the pack, untransformed
            pixels = pixels.copy()
        image = torch.from_numpy(pixels).permute(2, 0, 1)  # CHW view of HWC uint8
        if self.normalize is not None:
            image = self.normalize(image)
        target = {
            "boxes": torch.from_numpy(xyxy),
            "labels": torch.from_numpy(self.labels(category, index)),
            "image_id": torch.tensor(int(image_id), dtype=torch.int64),
            "orig_size": torch.tensor([h, w], dtype=torch.int64),
        }
        counts = self.backend.pop_counts()
        counts["dropped_degenerate_resized"] = int(len(kept) - kept.sum())  # on every sample
        if self.stated is not None:  # on every sample: each batch carries the same keys
            counts["stored_frame_images"] = int(stored_frame)
        return (image, target, counts) if counts else (image, target)


def collate_detection(samples: list) -> dict:
    """Samples -> {IMAGE: list of CHW tensors, TARGET: list of dicts, SKIPPED: n, ...}: no
    stacking, the images differ in size (the model pads them into one batch on the device).
    IMAGE and TARGET are None when every sample was skipped."""
    kept = [s for s in samples if s is not None and not isinstance(s, Skipped)]
    gone = [s.where for s in samples if isinstance(s, Skipped)]
    batch = {
        IMAGE: [s[0] for s in kept] or None,
        TARGET: [s[1] for s in kept] or None,
        SKIPPED: len(samples) - len(kept),
    }
    put_optional(batch, sum_counts(s[2] for s in kept if len(s) > 2), gone)
    return batch
