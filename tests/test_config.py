"""Every option of every config group composes, and what a run uses is what it prints."""

from __future__ import annotations

import pytest
from conftest import CONF, REPO, compose_config, run_train
from hydra.utils import instantiate
from omegaconf import OmegaConf

from fastload.tasks.base import build_task

GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_group_option_composes(group, option, tmp_path):
    overrides = [f"{group}={option}", f"hydra.run.dir={tmp_path}"]
    cfg = compose_config(overrides, tmp_path)
    if OmegaConf.is_missing(cfg.dataset, "root"):  # a real dataset (imagenet, coco2017, ...)
        cfg = compose_config([*overrides, "dataset.root=/data/real"], tmp_path)
    # Resolving everything catches typos in interpolations and missing keys.
    resolved = {
        k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
        for k in cfg
        if k != "hydra"
    }
    assert cfg.hydra.runtime.choices[group] == option
    assert resolved["name"] and cfg.hydra.run.dir
    for key in ("storage", "backend", "loader", "model", "logger"):
        assert "_target_" in resolved[key], f"{key} has no _target_"


def test_groups_named_in_design_exist():
    expected = {
        "dataset",
        "storage",
        "backend",
        "loader",
        "model",
        "optim",
        "logger",
        "trainer",
        "experiment",
        "debug",
    }
    assert expected <= set(GROUPS)


def test_model_and_optimizer_instantiate(tmp_path):
    cfg = compose_config([f"hydra.run.dir={tmp_path}", "dataset.num_classes=7"], tmp_path)
    model = build_task(cfg).build_model(cfg)
    assert model.fc.out_features == 7
    partial = instantiate(cfg.optim).optimizer
    opt = partial(model.parameters(), lr=0.1)
    assert opt.defaults["nesterov"] is True and opt.defaults["momentum"] == 0.9


def test_cfg_job_prints_the_resolved_groups():
    out = run_train(["--cfg", "job", "loader=baseline"], timeout=120)
    assert out.returncode == 0, out.stderr
    for key in ("dataset:", "storage:", "backend:", "loader:", "trainer:", "num_workers:"):
        assert key in out.stdout


def test_unknown_group_option_names_the_choices():
    out = run_train(["loader=nope"], timeout=120)
    assert out.returncode != 0
    assert "loader/nope" in out.stderr and "baseline" in out.stderr
    assert "Traceback" not in out.stderr


def test_readme_and_ci_use_the_same_test_command():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test" in readme and "make test" in ci


def test_default_dataset_folder_is_named_by_generator_version(tmp_path):
    """A new synthetic renderer must land in a new cache folder, not trip over an old one."""
    from fastload.data.synthetic import GENERATOR_VERSION

    cfg = compose_config([f"hydra.run.dir={tmp_path}"], tmp_path)
    assert f"synthetic-imagenet-g{GENERATOR_VERSION}-" in cfg.dataset.root
