"""Shared fixtures: the real Hydra config, composed and shrunk; tiny image folders in tmp."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict
from PIL import Image

import fastload.config  # noqa: F401  (resolvers)

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"


def make_image_folder(root: Path, classes=("cat", "dog", "eel"), per_split=(6, 3), size=(96, 72)):
    """A tiny ImageFolder tree of JPEGs whose colour depends on the class."""
    rng = np.random.default_rng(0)
    for split, n in zip(("train", "val"), per_split, strict=True):
        for ci, cls in enumerate(classes):
            d = root / split / cls
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                base = np.zeros((size[1], size[0], 3), np.uint8)
                base[..., ci % 3] = 180
                noise = rng.integers(0, 60, base.shape, dtype=np.uint8)
                Image.fromarray(base + noise).save(d / f"{cls}_{i:03d}.jpg", quality=90)
    return root


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("data") / "tiny")


def tiny_overrides(root: Path, run_dir: Path, *extra: str) -> list[str]:
    """Shrink the real config to seconds on 2 CPU cores. trainer.device=cpu: these runs test
    the application's logic (bit-exact resume, gloo DDP, messages) the same way on a GPU
    machine; the cuda-marked tests train on the GPU."""
    return [
        "trainer.device=cpu",
        f"dataset.root={root}",
        "dataset.prepare=null",
        "dataset.num_classes=3",
        "dataset.train_transform.size=32",
        "dataset.val_transform.size=32",
        "dataset.val_transform.resize=36",
        "trainer.epochs=2",
        "trainer.batch_size=4",
        "trainer.progress=false",
        "loader.num_workers=0",
        "logger=none",
        f"hydra.run.dir={run_dir}",
        f"output_root={run_dir.parent.parent}",
        *extra,
    ]


def compose_config(overrides: list[str], run_dir: Path | None = None):
    """The real config as `python train.py <overrides>` would see it, with HydraConfig set
    so that engine code reading HydraConfig works in-process."""
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(run_dir)
        HydraConfig.instance().set_config(cfg)
    return cfg


def build_test_loader(
    *overrides: str,
    folder: Path | None = None,
    split: str = "train",
    batch_size: int = 4,
    seed: int = 0,
    device="cpu",
    channels_last: bool = False,
    **kw,
):
    """A loader from the real config through the one builder (fastload/pipeline.py): the
    image folder `folder` with 24 px crops, or a custom `dataset` (kw, with `collate_fn`)."""
    from fastload.pipeline import build_loader, build_plan

    base = [f"dataset.root={folder}"] if folder is not None else []
    base += [
        "dataset.prepare=null",
        "dataset.train_transform.size=24",
        "dataset.val_transform.size=24",
        "dataset.val_transform.resize=27",
        f"trainer.batch_size={batch_size}",
        f"seed={seed}",
    ]
    cfg = compose_config([*base, *overrides])
    parts = {k: kw.pop(k) for k in ("storage", "backend") if k in kw}  # built already
    plan = build_plan(cfg, **parts)
    return build_loader(plan, split, device=device, channels_last=channels_last, **kw)


@functools.cache
def can_mount_privately() -> bool:
    """Whether this machine lets a test mount in a private mount namespace (root with
    unshare): a small /dev/shm, a read-only dataset folder, as in a container."""
    probe = ["unshare", "-m", "--propagation", "private", "sh", "-c",
             "mount -t tmpfs -o size=1m tmpfs /dev/shm"]  # fmt: skip
    try:
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_train(
    args: list[str], *, env=None, timeout=300, cwd=REPO, **kw
) -> subprocess.CompletedProcess:
    """`python train.py ARGS` in a subprocess, as a user runs it."""
    full_env = {**os.environ, "WANDB_SILENT": "true", **(env or {})}
    return subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd,
        **kw,
    )


def run_torchrun(root: Path, workdir: Path, *extra: str, nproc: int = 2, timeout=300, env=None,
                 launcher: tuple[str, ...] = ()):  # fmt: skip
    """`torchrun --standalone --nproc_per_node=N [launcher args] train.py` on tiny data (gloo
    on CPU); the run directory is left to the config (output_root/name/<launch time>) so
    ranks must agree. `env`: extra environment variables."""
    extra_env = env or {}
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(extra_env)
    overrides = [
        o
        for o in tiny_overrides(root, workdir / "unused")
        if not o.startswith(("hydra.run.dir", "output_root"))
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *launcher,
        str(REPO / "train.py"),
        *overrides,
        *extra,
    ]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**env, "PYTHONPATH": str(REPO)},
        cwd=workdir,
    )
