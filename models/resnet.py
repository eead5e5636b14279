"""torchvision ResNets, built from scratch (no weight downloads)."""

from __future__ import annotations

import torch
import torchvision


def build_resnet(arch: str = "resnet50", num_classes: int = 1000, zero_init_residual: bool = True):
    """zero_init_residual starts each residual branch as identity (Goyal et al.), which
    helps large-batch and short schedules."""
    if arch not in torchvision.models.list_models(module=torchvision.models):
        raise ValueError(f"model.arch={arch!r} is not a torchvision classification model")
    model: torch.nn.Module = torchvision.models.get_model(
        arch, weights=None, num_classes=num_classes, zero_init_residual=zero_init_residual
    )
    return model
