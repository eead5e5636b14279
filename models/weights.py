"""Local weight files for the model factories (nothing is downloaded here): a state dict as
torchvision, timm and train.py save them (checkpoint.state_dict_in says which shapes)."""

from __future__ import annotations

from pathlib import Path

import torch

from fastload.checkpoint import READABLE, state_dict_in, verified
from fastload.errors import CheckpointError, ConfigError


def read_state_dict(path: str, option: str) -> dict:
    """The state dict in the file `option` names; ConfigError naming both when there is none."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{option}={path}: no such file. Pass a local .pth state dict "
                          f"(nothing is downloaded here), or {option}=null.")  # fmt: skip
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle / zip errors differ by torch version
        raise ConfigError(f"{option}={path} is not a torch state dict ({exc}).") from None
    if isinstance(saved, dict) and saved.get("format") in READABLE and "checksum" in saved:
        try:  # a fastload checkpoint or best-weights file: checked as resume=/evaluate= check it
            verified(saved, file, "evaluate")
        except CheckpointError as exc:
            raise ConfigError(f"{option}={path}: {exc}") from None
    state = state_dict_in(saved)
    if state is None:
        raise ConfigError(
            f"{option}={path} holds a {type(saved).__name__} with no state dict in it (tensors "
            f"by name, alone or under 'state_dict' or 'model')."
        )
    return state


def load_weights(module, path: str, option: str, *, state: dict | None = None, ignore=(),
                 keep=(), fits: str = "") -> None:  # fmt: skip
    """The file's state dict (`state`, when it was read already) into `module`, strictly:
    less the keys starting with `ignore`; those starting with `keep` keep the module's own
    values. `fits`: what a file must be to fit, for the message when it does not."""
    state = read_state_dict(path, option) if state is None else state
    state = {k: v for k, v in state.items() if not k.startswith(ignore + keep)}
    if keep:
        state.update({k: v for k, v in module.state_dict().items() if k.startswith(keep)})
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        first = str(exc).splitlines()[1:3]
        raise ConfigError(
            f"{option}={path} does not fit this model ({'; '.join(s.strip() for s in first)})."
            f"{' ' + fits if fits else ''}"
        ) from None
