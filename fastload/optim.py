"""Optimiser with weight decay only on weights that should decay, and a warm-up + cosine
schedule stepped per iteration."""

from __future__ import annotations

import math

import torch


def check_options(optim_cfg) -> None:
    """Numbers the optimiser would reject with a traceback (a negative lr) or, worse, accept
    and train on to nothing (nan, inf), and optim=apex_sgd where apex is missing: refused
    before anything starts, naming the option."""
    rules = {
        "base_lr": (lambda v: v > 0, "a finite number > 0 (e.g. 0.1; it is scaled by the "
                    "global batch / 256)"),
        "weight_decay": (lambda v: v >= 0, "a finite number >= 0"),
        "warmup_epochs": (lambda v: v >= 0, "a finite number of epochs >= 0"),
        "min_lr_ratio": (lambda v: 0 <= v <= 1, "a fraction of base_lr in [0, 1]"),
        "label_smoothing": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
        "clip_grad_norm": (lambda v: v > 0, "null (no clipping) or a finite number > 0, the "
                           "largest global L2 norm of the gradients (e.g. 1.0)"),
    }  # fmt: skip
    for key, (ok, use) in rules.items():
        value = optim_cfg.get(key)
        if value is None and key in ("label_smoothing", "clip_grad_norm"):
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and ok(value)):
            from fastload.errors import ConfigError

            raise ConfigError(f"optim.{key}={value!r}: use {use}.")
    optimizer = optim_cfg.get("optimizer") or {}
    if optimizer.get("_target_") == f"{__name__}.apex_fused_sgd":
        apex_fused_sgd_class()  # apex missing: said before any work, not after the data's


def param_groups(model: torch.nn.Module, weight_decay: float, skip_bn_and_bias: bool) -> list:
    """BatchNorm/LayerNorm scales and all biases are 1-D: decaying them only hurts
    (Goyal et al.; the torchvision and timm recipes exclude them)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (no_decay if skip_bn_and_bias and p.ndim <= 1 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model, optim_cfg, lr: float, device: torch.device):
    factory = optim_cfg.optimizer  # a functools.partial from hydra (_partial_: true)
    groups = param_groups(model, optim_cfg.weight_decay, optim_cfg.no_weight_decay_on_bn_and_bias)
    kwargs = {}
    # torch's fused SGD/AdamW kernels replace apex's FusedSGD on CUDA.
    if device.type == "cuda" and getattr(factory, "func", None) in (
        torch.optim.SGD,
        torch.optim.AdamW,
    ):
        kwargs["fused"] = True
    return factory(groups, lr=lr, **kwargs)


def warmup_cosine(total_steps: int, warmup_steps: int, min_ratio: float = 0.0):
    """LR multiplier: linear warm-up from 1/warmup_steps to 1, then cosine to min_ratio."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def apex_fused_sgd_class():
    """apex.optimizers.FusedSGD, or the ConfigError saying how to get apex."""
    try:
        from apex.optimizers import FusedSGD
    except ImportError:
        from fastload.errors import ConfigError

        raise ConfigError(
            "optim=apex_sgd needs NVIDIA apex, which is not importable here. It is not on PyPI: "
            "use an NVIDIA PyTorch container (it ships apex) or build it from source "
            "(github.com/NVIDIA/apex); or use optim=sgd (torch's fused SGD on CUDA)."
        ) from None
    return FusedSGD


def apex_fused_sgd(params, **kwargs):
    """apex.optimizers.FusedSGD (NVIDIA containers ship apex; it is not on PyPI). torch's own
    fused SGD, which optim=sgd uses on CUDA, is the portable equivalent."""
    return apex_fused_sgd_class()(params, **kwargs)
