"""torchvision detection models, built from scratch (no weight downloads here), plus local
weights when given.

    build_detector(arch, num_classes, weights=None, weights_backbone=None, ...)

arch: a torchvision detection builder (fasterrcnn_resnet50_fpn, retinanet_resnet50_fpn,
fcos_resnet50_fpn, fasterrcnn_mobilenet_v3_large_320_fpn, ...) or `fcos_tiny`, an FCOS on a
ResNet-18 trunk with a 64-channel, 3-level pyramid and a 2-conv head: ~0.3 s per step of 8
images of 160-224 px on 2 CPU cores, where the ResNet-50 FPN models take 5-15 s.

num_classes: the dataset's object categories (dataset.num_classes, 80 for COCO); the model
gets one more output, index 0, the background of torchvision's label convention.

The dataset transform does all resizing (fastload/data/detection.py ResizeFlip, in the
workers, in uint8): the model's own GeneralizedRCNNTransform is kept for what it does on the
device (normalise with ImageNet mean/std, pad the images into one batch) but does not resize
again, so dataset.train_transform / val_transform alone decide the input size; torchvision's
resize options (model.min_size, max_size, fixed_size) are refused, naming those.

weights: a local state-dict file of this very model as built here (its num_classes + 1
outputs are background and the dataset's categories in id order, 1..K), e.g. an earlier
run's checkpoint; loaded strictly, with weights_only=True, then trained as torchvision
trains pretrained detectors (frozen trunk batch norms, trainable_backbone_layers of a ResNet
trunk, default 3). weights_backbone: a local ImageNet classification state dict of the trunk
(e.g. resnet50-0676ba61.pth): loaded into the backbone, whose batch norms are then frozen and
whose first layers stop training (trainable_backbone_layers, default 3), as torchvision does
with its downloaded backbone weights.

torchvision's COCO-trained detector weights are not such a file: their 91 class outputs are
indexed by COCO category id (background 0 and the 10 unused ids among 1-90 included), where
a model for COCO's 80 categories here has 81 (label k: the k-th category in id order), so
the strict load refuses them. Their trunk does load, as weights_backbone: the entries under
`backbone.body.`, with that prefix cut, saved with torch.save.
"""

from __future__ import annotations

import logging

import torch
import torchvision
from fastload.models.weights import load_weights
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops.misc import FrozenBatchNorm2d

from fastload.errors import ConfigError

log = logging.getLogger("fastload")

RESNET_LAYERS = ("layer4", "layer3", "layer2", "layer1", "conv1")
# torchvision's GeneralizedRCNNTransform options that resize: PadNormalize does not resize
RESIZE_OPTIONS = ("min_size", "max_size", "fixed_size", "_skip_resize")
WHOLE_MODEL_FITS = (
    "Its classes must match dataset.num_classes + 1 (background), and the arch must be the one "
    "it was saved from; for an ImageNet trunk use model.weights_backbone."
)


class PadNormalize(GeneralizedRCNNTransform):
    """The model's input transform without its resize: the dataset resized already."""

    def normalize(self, image):
        # The loader's images are CHW views of the decoder's HWC arrays; fed as they are, the
        # padded batch keeps that layout and the CPU convolutions ran 5-10x slower (measured
        # with fcos_tiny, 2 cores). One contiguous copy per image on the device is cheap.
        return super().normalize(image.contiguous())

    def resize(self, image, target=None):
        return image, target


def fcos_tiny(num_classes: int, **kwargs):
    from torchvision.models.detection import FCOS
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.backbone_utils import BackboneWithFPN
    from torchvision.models.detection.fcos import FCOSHead

    trunk = torchvision.models.resnet18(weights=None)
    backbone = BackboneWithFPN(
        trunk, {"layer2": "0", "layer3": "1", "layer4": "2"}, [128, 256, 512], 64
    )  # + a max-pooled 4th level (LastLevelMaxPool): strides 8, 16, 32, 64
    anchors = AnchorGenerator(((16,), (32,), (64,), (128,)), ((1.0,),) * 4)
    head = FCOSHead(64, 1, num_classes, num_convs=2)
    return FCOS(backbone, num_classes, anchor_generator=anchors, head=head, **kwargs)


LOCAL = {"fcos_tiny": fcos_tiny}


def build_detector(
    arch: str,
    num_classes: int,
    weights: str | None = None,
    weights_backbone: str | None = None,
    trainable_backbone_layers: int | None = None,
    **kwargs,
) -> torch.nn.Module:
    """The detection model `arch` for `num_classes` object categories (+ background)."""
    detection = torchvision.models.list_models(module=torchvision.models.detection)
    if arch not in LOCAL and arch not in detection:
        raise ConfigError(
            f"model.arch={arch!r} is not a detection model: use fcos_tiny or one of "
            f"torchvision's ({', '.join(sorted(detection))})."
        )
    resizing = [k for k in RESIZE_OPTIONS if k in kwargs]
    if resizing:
        raise ConfigError(
            f"model.{resizing[0]}={kwargs[resizing[0]]!r}: the model does not resize its input "
            f"here (the dataset's transform does, once, in the workers). Set "
            f"dataset.train_transform.min_size / max_size and dataset.val_transform.min_size / "
            f"max_size instead, and drop model.{resizing[0]}."
        )
    layers = trainable_backbone_layers
    if layers is not None and (type(layers) is not int or not 0 <= layers <= 5):
        raise ConfigError(
            f"model.trainable_backbone_layers={layers!r}: use 0 to 5 (how many of a ResNet "
            f"trunk's stages train, from the last; torchvision's default 3)."
        )
    if layers is not None and not (weights or weights_backbone):
        # torchvision warns the same and trains every layer
        log.warning(
            "model.trainable_backbone_layers=%s has no effect without model.weights or "
            "model.weights_backbone: a model trained from scratch trains all its layers.",
            layers,
        )
    if arch in LOCAL:
        model = LOCAL[arch](num_classes + 1, **kwargs)
    else:
        model = torchvision.models.get_model(
            arch, weights=None, weights_backbone=None, num_classes=num_classes + 1, **kwargs
        )
    t = model.transform
    model.transform = PadNormalize(
        t.min_size, t.max_size, t.image_mean, t.image_std, t.size_divisible, t.fixed_size
    )
    if weights_backbone:
        load_backbone(model, weights_backbone, trainable_backbone_layers)
    if weights:
        load_weights(model, weights, "model.weights", fits=WHOLE_MODEL_FITS)
        # torchvision's regime for any pretrained detector, not only a pretrained trunk:
        # batch norms trained on batches of 2-8 images would overwrite the weights' statistics
        pretrained_regime(model, trainable_backbone_layers)
    return model


def load_backbone(model, path: str, trainable_layers: int | None) -> None:
    """An ImageNet state dict into the ResNet trunk, then torchvision's pretrained-backbone
    regime: frozen batch norms, only the last `trainable_layers` stages trained."""
    body = getattr(getattr(model, "backbone", None), "body", None)
    if body is None or not hasattr(body, "layer1"):
        raise ConfigError("model.weights_backbone: supported for ResNet-trunk models only.")
    load_weights(body, path, "model.weights_backbone", ignore=("fc.",))
    pretrained_regime(model, trainable_layers)


def pretrained_regime(model, trainable_layers: int | None) -> None:
    """torchvision's for pretrained weights: the trunk's batch norms frozen with their
    statistics, and of a ResNet trunk only the last `trainable_layers` stages (default 3)
    trained."""
    body = getattr(getattr(model, "backbone", None), "body", None)
    if body is None:
        return
    if hasattr(body, "layer1"):
        frozen = 3 if trainable_layers is None else int(trainable_layers)
        for name in RESNET_LAYERS[frozen:]:
            getattr(body, name).requires_grad_(False)
    freeze_batch_norms(body)


def freeze_batch_norms(module: torch.nn.Module) -> None:
    """Every BatchNorm2d under `module` replaced by a FrozenBatchNorm2d with its statistics:
    the usual choice for detection batches of a few images per GPU."""
    for name, child in module.named_children():
        if isinstance(child, torch.nn.BatchNorm2d):
            frozen = FrozenBatchNorm2d(child.num_features, child.eps)
            for key in ("weight", "bias", "running_mean", "running_var"):
                getattr(frozen, key).copy_(getattr(child, key).detach())
            setattr(module, name, frozen)
        else:
            freeze_batch_norms(child)
