"""Model EMA: an exponential moving average of the weights, evaluated beside the model.

timm's --model-ema and the torchvision references' --model-ema keep one: after each optimizer
update, ema = decay x ema + (1 - decay) x model, over the parameters and the floating-point
buffers (BatchNorm's running statistics; integer buffers such as num_batches_tracked are
copied). The average of a run's late weights often evaluates better than its last weights,
and it costs one in-place lerp over the weights per update: no gradient, no collective, no
host sync.

trainer.ema (conf/trainer/default.yaml):

    decay    per optimizer update (timm's default 0.9998); the average spans about
             1 / (1 - decay) updates. null: no EMA
    every    update the EMA once every N optimizer updates, with decay ** N (the torchvision
             references' --model-ema-steps): the same span, N times fewer passes over the
             weights (they cost on a CPU)
    warmup   timm's warm-up: update t (counted from 0) uses min(decay, 1 - (1 + t) ** -2/3),
             so that the early average follows the model instead of holding on to its random
             initialisation (a copy at the first update; 0.95 at update 100, 0.99 at 1,000)

Under DDP every rank keeps one. The parameters are the same on every rank; BatchNorm's
statistics are each rank's own, so before evaluating, rank 0's are broadcast (`sync`): every
rank evaluates the EMA the checkpoint holds, and a resumed run evaluates the same one.
"""

from __future__ import annotations

import copy
import math

import torch

from fastload import dist
from fastload.errors import ConfigError

WARMUP_POWER = 2 / 3  # timm's ModelEmaV3 warm-up: 1 - (1 + t) ** -power


def check_options(ema_cfg) -> None:
    """trainer.ema's values, refused before anything starts, naming the option."""
    if ema_cfg is None:
        return
    decay, every, warmup = ema_cfg.get("decay"), ema_cfg.get("every", 1), ema_cfg.get("warmup")
    number = isinstance(decay, (int, float)) and not isinstance(decay, bool)
    if decay is not None and not (number and math.isfinite(decay) and 0 < decay < 1):
        raise ConfigError(
            f"trainer.ema.decay={decay!r}: use null (no EMA) or a number in (0, 1), the weight "
            f"the average keeps at each optimizer update (e.g. 0.9998; it spans about "
            f"1 / (1 - decay) updates)."
        )
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(
            f"trainer.ema.every={every!r}: use a whole number >= 1 (optimizer updates between "
            f"two EMA updates)."
        )
    if not isinstance(warmup, bool):
        raise ConfigError(
            f"trainer.ema.warmup={warmup!r}: use true (the average follows the model closely "
            f"at first) or false (decay from the first update)."
        )


class ModelEma:
    def __init__(self, model: torch.nn.Module, decay: float, every: int = 1, warmup: bool = True):
        # a copy of the unwrapped model (no DDP, no torch.compile), never trained
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay, self.every, self.warmup = float(decay), int(every), bool(warmup)
        self.updates = 0  # optimizer updates seen

    @classmethod
    def from_config(cls, ema_cfg, model: torch.nn.Module) -> ModelEma | None:
        """trainer.ema's EMA of `model`, or None when trainer.ema.decay is null."""
        check_options(ema_cfg)
        if ema_cfg is None or ema_cfg.get("decay") is None:
            return None
        return cls(model, ema_cfg.decay, ema_cfg.get("every", 1), ema_cfg.warmup)

    def decay_at(self, t: int) -> float:
        """The decay of optimizer update t (counted from 0)."""
        if not self.warmup:
            return self.decay
        return min(self.decay, 1.0 - (1.0 + t) ** -WARMUP_POWER)

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """After each optimizer update (every trainer.ema.every-th moves the average)."""
        self.updates += 1
        if self.updates % self.every:
            return
        keep = self.decay_at(self.updates - 1) ** self.every
        ema_floats, ema_others = _split(self.model)
        floats, others = _split(model)
        if len(ema_floats) != len(floats) or len(ema_others) != len(others):
            raise RuntimeError("the EMA's model and the trained model have other tensors")
        if floats:
            torch._foreach_lerp_(ema_floats, floats, 1.0 - keep)
        for mine, theirs in zip(ema_others, others, strict=True):
            mine.copy_(theirs)

    def sync(self, ctx) -> None:
        """Rank 0's buffers on every rank (BatchNorm's statistics differ between ranks)."""
        dist.broadcast_tensors(list(self.model.buffers()), ctx)

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.updates = int(state["updates"])


def _split(model: torch.nn.Module) -> tuple[list, list]:
    """A model's parameters and buffers, each once (a tied weight too): (floating point, the
    others)."""
    floats, others = [], []
    for value in [*model.parameters(), *model.buffers()]:
        value = value.detach()
        (floats if value.is_floating_point() else others).append(value)
    return floats, others
