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


def test_torch_compiled_and_ddp_prefixes_are_dropped_and_other_trunks_are_no_fresh_fc(
    tmp_path, caplog
):
    from fastload.checkpoint import state_dict_in

    t = torch.zeros(1)
    for key in ("_orig_mod.conv1.weight", "module._orig_mod.conv1.weight",
                "_orig_mod.module.conv1.weight", "conv1.weight"):  # fmt: skip
        assert list(state_dict_in({key: t})) == ["conv1.weight"]
    # resnet50's weights into resnet18: another trunk (fc of 2048 features), not a fresh fc
    path = tmp_path / "r50.pth"
    torch.save(build_resnet("resnet50", 4).state_dict(), path)
    with caplog.at_level("INFO", logger="fastload"):
        with pytest.raises(ConfigError, match="does not fit"):
            build_resnet("resnet18", 4, weights=str(path))
    assert "fc starts fresh" not in caplog.text


def test_model_arch_is_checked_and_other_torchvision_classifiers_build():
    with pytest.raises(ConfigError, match=r"model.arch='resnet19' is not a torchvision .*resnet18"):
        build_resnet("resnet19", 3)
    mobile = build_resnet("mobilenet_v3_small", 3)  # it takes no zero_init_residual
    assert mobile(torch.zeros(2, 3, 32, 32)).shape == (2, 3)


def test_a_damaged_fastload_weights_file_is_refused_as_model_weights(tmp_path):
    """evaluate= and resume= verify a fastload file's checksum; model.weights loaded it
    unchecked."""
    from fastload import checkpoint as ckpt

    source = build_resnet("resnet18", 3)
    payload = ckpt.weights_payload(source, "model", 0, "val_acc1", 50.0, {})
    path = tmp_path / "best.pt"
    ckpt.save_atomic(payload, path)
    build_resnet("resnet18", 3, weights=str(path))  # intact: loads
    saved = torch.load(path, weights_only=True)
    saved["model"]["fc.bias"] += 1.0  # a bit flipped on the way, the checksum not
    torch.save(saved, path)
    with pytest.raises(ConfigError, match=f"model.weights={path}: checkpoint .* is damaged"):
        build_resnet("resnet18", 3, weights=str(path))
