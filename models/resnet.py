"""torchvision ResNets, built from scratch (no weight downloads), or from a local weights
file (`weights`, e.g. torchvision's resnet50-0676ba61.pth saved elsewhere): loaded strictly,
except that a classifier (`fc`) of another class count starts fresh, as timm's and the
torchvision references' fine-tuning does."""

from __future__ import annotations

import logging

import torch
import torchvision
from fastload.models.weights import load_weights, read_state_dict

from fastload.errors import ConfigError

log = logging.getLogger("fastload")


def build_resnet(arch: str = "resnet50", num_classes: int = 1000, zero_init_residual: bool = True,
                 weights: str | None = None):  # fmt: skip
    """zero_init_residual starts each residual branch as identity (Goyal et al.), which
    helps large-batch and short schedules (the ResNet family's option; any other torchvision
    classification model is built without it)."""
    known = torchvision.models.list_models(module=torchvision.models)
    if arch not in known:
        near = [m for m in known if m.startswith(arch.rstrip("0123456789_"))][:8] or known[:8]
        raise ConfigError(
            f"model.arch={arch!r} is not a torchvision classification model; e.g. "
            f"{', '.join(near)} (torchvision.models.list_models() lists them)."
        )
    options = {"num_classes": num_classes}
    if arch.startswith(("resnet", "resnext", "wide_resnet")):
        options["zero_init_residual"] = zero_init_residual
    model: torch.nn.Module = torchvision.models.get_model(arch, weights=None, **options)
    if weights:
        state = read_state_dict(weights, "model.weights")
        saved, fc = state.get("fc.weight"), getattr(model, "fc", None)
        # another number of classes on the same trunk: a fresh fc; another trunk (a deeper
        # ResNet's 2048 features) is no fresh fc but weights of another model, refused below
        fresh = (fc is not None and saved is not None and saved.ndim == 2
                 and saved.shape[1] == fc.weight.shape[1] and saved.shape[0] != fc.weight.shape[0])  # fmt: skip
        if fresh:
            log.info("model.weights=%s has a classifier of %d classes; this run predicts %d "
                     "(dataset.num_classes): fc starts fresh", weights, saved.shape[0],
                     num_classes)  # fmt: skip
        load_weights(model, weights, "model.weights", state=state, keep=("fc.",) if fresh else (),
                     fits=f"It must be a state dict of a torchvision {arch}.")  # fmt: skip
    return model
