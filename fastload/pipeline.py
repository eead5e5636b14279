"""The data path, built in one place from the config:

    storage (conf/storage) -> reader -> dataset (+ backend, transform) -> sampler -> loader

`build_loader(cfg, split)` builds one split's loader; `build_data(cfg, ctx)` both splits for
training; `prepare_data(cfg, ctx)` runs the once-per-node steps before either. The engine,
every benchmark and the tests call these, so a new loader argument is added here once.

The builder decides where normalisation happens (`loader.normalize_on`) and tells both sides:
the dataset gets the `Normalize` (cpu) or device prep does (device), never both. It refuses
combinations that cannot work when building, not inside a worker: a GPU-decoding backend or a
device-normalising loader with normalize_on=cpu.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from fastload import dist
from fastload.data.dataset import Normalize
from fastload.data.sampling import EpochSampler, ShardSampler, ShardStreamSampler
from fastload.errors import ConfigError
from fastload.loaders.device_prep import DTYPES, DevicePrep
from fastload.tasks.base import build_task

SPLIT_KEYS = {"train": "train_split", "val": "val_split"}
NORMALIZE_ON = ("device", "cpu")


@dataclass
class DataPath:
    """Both splits of a training run, built from one storage and one backend."""

    train: object  # a loader (fastload/loaders/)
    val: object
    backend: object  # fastload.decode.base.DecodeBackend
    storage: object  # fastload.storage.base.Storage
    train_reader: object  # fastload.storage.base.Reader
    task: object = None  # fastload.tasks.base.Task

    def close(self) -> None:
        self.train.close()
        self.val.close()

    def before_epoch(self) -> None:
        """Reset the storage's read counters (cold_cache: evict its files first)."""
        self.train_reader.before_epoch()

    def epoch_stats(self, ctx) -> dict:
        """Bytes the storage read this epoch (all ranks), the read bandwidth one reader saw,
        and what decoded (the backend's own report)."""
        s = self.train_reader.epoch_stats()
        nbytes, seconds = dist.all_reduce([s["read_mb"], s["read_s"]], ctx)
        return {
            **self.backend.info(),
            "read_mb": nbytes,
            "read_mb_per_s": nbytes / seconds if seconds > 0 else None,
            "cold_cache": s["cold_cache"],
            **(self.task.epoch_info(self.train_reader) if self.task is not None else {}),
        }


def build_storage(cfg: DictConfig):
    return instantiate(cfg.storage)


def build_backend(cfg: DictConfig):
    return instantiate(cfg.backend)


def build_layout(cfg: DictConfig):
    """How the dataset lies under dataset.root (fastload/data/layouts.py)."""
    return instantiate(cfg.dataset.layout)


def prepare_data(cfg: DictConfig, ctx):
    """Once per node (local rank 0) before training: the dataset's `prepare` (generate the
    synthetic set) and the storage's (stage to tmpfs, pack); the other ranks wait. Returns
    the storage object."""
    storage = build_storage(cfg)
    if ctx.is_local_main:
        if cfg.dataset.prepare is not None:
            instantiate(cfg.dataset.prepare)
        splits = [cfg.dataset[k] for k in SPLIT_KEYS.values()]
        storage.prepare(build_layout(cfg), splits, skip_corrupt=cfg.dataset.skip_corrupt)
    dist.barrier(ctx)
    return storage


def normalize_on(cfg: DictConfig, backend=None) -> str:
    """Where the single normalisation happens, with the combinations that cannot work refused."""
    where = cfg.loader.normalize_on
    if where not in NORMALIZE_ON:
        raise ConfigError(f"loader.normalize_on={where!r}: use 'device' or 'cpu'.")
    if cfg.loader.input_dtype not in DTYPES:
        raise ConfigError(
            f"loader.input_dtype={cfg.loader.input_dtype!r}: use one of {list(DTYPES)}."
        )
    if where == "cpu" and get_class(cfg.loader._target_).normalizes_on_device:
        raise ConfigError(
            "loader.normalize_on='cpu' with a CUDA-prefetching loader: it normalises on the "
            "GPU, and normalising twice corrupts the input (timm#73). Use "
            "loader.normalize_on=device (the default), or loader=baseline / loader=bg for "
            "CPU-side normalisation."
        )
    if where == "cpu" and backend is not None and backend.device_decoder is not None:
        raise ConfigError(
            f"backend={backend.name} decodes in device prep, after the workers: it needs "
            f"loader.normalize_on=device (not cpu)."
        )
    return where


def loader_factory(cfg: DictConfig):
    """conf/loader/<name>.yaml without the two keys the builder owns (normalize_on and
    input_dtype): a partial of the loader class, given the rest at `build_loader`."""
    opts = OmegaConf.to_container(cfg.loader, resolve=True)
    for key in ("normalize_on", "input_dtype"):
        opts.pop(key)
    # loader=auto: the probe's settings (fastload/autotune.py), resolved at the start
    # of a run into the keys above; a loader built without the probe uses its base values.
    opts.pop("auto", None)
    return instantiate(opts)


def build_loader(
    cfg: DictConfig,
    split: str,
    *,
    device="cpu",
    channels_last: bool = False,
    rank: int = 0,
    world_size: int = 1,
    local_world_size: int = 1,
    storage=None,
    backend=None,
    dataset=None,
    collate_fn=None,
    reader=None,
):
    """One split's loader (split: train | val). `storage` / `backend` / `reader` (the split's
    opened reader) reuse objects built already; `dataset` (with `collate_fn`) replaces the
    image dataset, e.g. in tests."""
    train = split == "train"
    task = build_task(cfg)
    if dataset is None:
        backend = backend if backend is not None else build_backend(cfg)
        if reader is None:
            storage = storage if storage is not None else build_storage(cfg)
            reader = storage.open(build_layout(cfg), cfg.dataset[SPLIT_KEYS[split]])
    where = normalize_on(cfg, backend)
    normalize = Normalize(cfg.dataset.mean, cfg.dataset.std)
    if dataset is None:
        dataset = task.dataset(cfg, split, reader, backend, normalize if where == "cpu" else None)
        collate_fn = collate_fn or task.collate
    shard_sizes = getattr(getattr(dataset, "reader", None), "shard_sizes", None)
    # A store read shard by shard (storage=webdataset), when the dataset's index is the
    # reader's: a dataset that leaves samples out (detection train: images without boxes)
    # or repeats them (super-resolution patches) is sampled map-style, reading its shards
    # in place or through the node cache.
    if shard_sizes is not None and len(dataset) == int(shard_sizes.sum()):
        sampler = ShardStreamSampler(
            shard_sizes,
            rank=rank,
            world_size=world_size,
            seed=cfg.seed,
            train=train,
            window=dataset.reader.shuffle_buffer,
            remainder=dataset.reader.remainder,
        )
    elif train:
        sampler = EpochSampler(
            len(dataset), rank=rank, world_size=world_size, shuffle=True, seed=cfg.seed
        )
    else:
        sampler = ShardSampler(len(dataset), rank=rank, world_size=world_size)
    prep = DevicePrep(
        torch.device(device),
        normalize if where == "device" else None,
        channels_last,
        DTYPES[cfg.loader.input_dtype],
        decoder=getattr(backend, "device_decoder", None),
    )
    return loader_factory(cfg)(
        dataset,
        sampler,
        batch_size=cfg.trainer.batch_size,
        device_prep=prep,
        train=train,
        seed=cfg.seed,
        rank=rank,
        local_world_size=local_world_size,
        sample_bytes=task.sample_bytes(dataset, where) if collate_fn is None else None,
        epochs=cfg.trainer.epochs if train else None,
        max_batches=cfg.trainer.max_steps_per_epoch if train else None,
        collate_fn=collate_fn,
    )


def build_data(cfg: DictConfig, ctx, storage, *, channels_last: bool, backend=None) -> DataPath:
    """Both splits for training on this rank, sharing one backend."""
    backend = backend if backend is not None else build_backend(cfg)
    common = dict(
        device=ctx.device,
        channels_last=channels_last,
        rank=ctx.rank,
        world_size=ctx.world_size,
        local_world_size=ctx.local_world_size,
        storage=storage,
        backend=backend,
    )
    train = build_loader(cfg, "train", **common)
    val = build_loader(cfg, "val", **common)
    if len(train) == 0:
        per_rank = len(train.sampler)
        raise ConfigError(
            f"trainer.batch_size={cfg.trainer.batch_size} is larger than the {per_rank} training "
            f"images each of the {ctx.world_size} rank(s) gets from {cfg.dataset.root}, and "
            f"loader.drop_last=true leaves no batch. Lower trainer.batch_size (<= {per_rank})."
        )
    task = build_task(cfg)
    task.check(cfg, train.dataset.reader, val.dataset.reader)
    return DataPath(train, val, backend, storage, train.dataset.reader, task)
