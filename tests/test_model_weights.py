"""model.weights: a local state dict to start from (the classification ResNets here; the
detection models' in tests/test_detection.py), read as torchvision, timm and train.py save
them."""

from __future__ import annotations

import pytest
import torch
from fastload.models.resnet import build_resnet

from fastload.errors import ConfigError


def test_resnet_weights_load_whole_or_start_a_fresh_classifier(tmp_path, caplog):
    source = build_resnet("resnet18", 3)
    with torch.no_grad():  # weights no fresh build has
        for p in source.parameters():
            p.add_(0.5)
    path = tmp_path / "w.pth"  # as a DDP-wrapped model's, under timm's "state_dict"
    torch.save({"state_dict": {f"module.{k}": v for k, v in source.state_dict().items()}}, path)
    same = build_resnet("resnet18", 3, weights=str(path))
    for k, v in source.state_dict().items():
        assert torch.equal(same.state_dict()[k], v), k
    # fine-tuning to 5 classes: the trunk from the file, a fresh classifier, said once
    with caplog.at_level("INFO", logger="fastload"):
        tuned = build_resnet("resnet18", 5, weights=str(path))
    assert "classifier of 3 classes" in caplog.text and "fc starts fresh" in caplog.text
    for k, v in source.state_dict().items():
        if not k.startswith("fc."):
            assert torch.equal(tuned.state_dict()[k], v), k
    assert tuned.fc.weight.shape == (5, 512)


def test_resnet_weights_that_cannot_be_used_are_named(tmp_path):
    path = tmp_path / "w.pth"
    torch.save(build_resnet("resnet18", 3).state_dict(), path)
    with pytest.raises(ConfigError, match=f"model.weights={path} does not fit.*resnet50"):
        build_resnet("resnet50", 3, weights=str(path))
    with pytest.raises(ConfigError, match="no such file"):
        build_resnet("resnet18", 3, weights=str(tmp_path / "missing.pth"))
    torch.save({"epoch": 3, "notes": "no tensors"}, tmp_path / "junk.pth")
    with pytest.raises(ConfigError, match="no state dict in it"):
        build_resnet("resnet18", 3, weights=str(tmp_path / "junk.pth"))
