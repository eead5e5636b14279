"""The data path, built in one place from the config:

    storage (conf/storage) -> reader -> dataset (+ backend, transform) -> sampler -> loader

`build_plan(cfg)` resolves the config once into a `DataPlan` of objects and values: the
storage, the layout, the backend, the task (with its settings), where normalisation happens,
the loader's options with num_workers a whole number; every later step takes the plan, not
the config. `build_loader(plan, split)` builds one split's loader; `build_data(plan, ctx)`
both splits for training; `prepare_data(cfg, ctx)` runs the once-per-node steps before
either. The engine, every benchmark and the tests call these, so a new loader argument is
added here once.

The builder decides where normalisation happens (`loader.normalize_on`) and tells both sides:
the dataset gets the `Normalize` (cpu) or device prep does (device), never both. It refuses
combinations that cannot work when building, not inside a worker: a GPU-decoding backend or a
device-normalising loader with normalize_on=cpu.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from fastload import dist
from fastload.data.dataset import Normalize
from fastload.data.sampling import (
    EpochSampler,
    ShardSampler,
    ShardStreamSampler,
    window_class_mix,
)
from fastload.errors import ConfigError
from fastload.host import sigterm_interrupts
from fastload.loaders.device_prep import DTYPES, DevicePrep
from fastload.loaders.workers import resolve_num_workers
from fastload.tasks.base import build_task

log = logging.getLogger(__name__)

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

    counting: bool = False  # the read counters were reset before this process's first epoch

    def before_epoch(self, ctx=None) -> None:
        """Reset the storage's read counters before the first epoch (what loader=auto's
        trials read is no epoch's), keep them after: the workers may have begun this epoch
        (cold_cache: evict its files first). Every rank of a job (`ctx`, a DistContext)
        calls it: the page cache (and a streamed split's node cache) is the node's, so its
        local rank 0 evicts the split once and every rank waits for the evictions at a
        barrier (each rank evicting the whole split was ~2.6 s CPU per 300k files per rank,
        and could evict what another rank's workers had already read this epoch)."""
        node = ctx is not None and ctx.distributed
        evict = not node or ctx.is_local_main
        self.train_reader.before_epoch(reset=not self.counting, evict=evict)
        if node and self.train_reader.cold_cache:
            dist.barrier(ctx)
        self.counting = True

    def epoch_stats(self, ctx, epoch: int) -> dict:
        """Bytes the storage read for `epoch`'s samples (all ranks), the read bandwidth one
        reader saw, and what decoded (the backend's own report)."""
        s = self.train_reader.epoch_stats(epoch)
        nbytes, seconds = dist.all_reduce([s["read_mb"], s["read_s"]], ctx)
        return {
            **self.backend.info(),
            "read_mb": nbytes,
            "read_mb_per_s": nbytes / seconds if seconds > 0 else None,
            "cold_cache": s["cold_cache"],
            **(self.task.epoch_info(self.train_reader) if self.task is not None else {}),
        }


# Config groups whose yaml may set storage.* keys for the storage it picks (conf/variant/,
# conf/experiment/): with another storage= on the command line, those keys stay.
SETTING_GROUPS = ("variant", "experiment")


def group_choices(cfg: DictConfig) -> dict:
    """The config groups' chosen options (Hydra's runtime choices), {} where unknown."""
    choices = OmegaConf.select(cfg, "hydra.runtime.choices", default=None)
    if choices is None:
        from hydra.core.hydra_config import HydraConfig

        try:
            choices = HydraConfig.get().runtime.choices
        except ValueError:  # no Hydra run (a config built by hand)
            return {}
    return {k: v for k, v in dict(choices).items() if v is not None}


def storage_settings(cfg: DictConfig) -> list[tuple[str, str, set, str | None]]:
    """(group, option, the storage.* keys its yaml sets, the storage= it picks or None) for
    each chosen variant= / experiment= that sets storage keys."""
    from fastload.config import conf_dir

    choices, out = group_choices(cfg), []
    for group in SETTING_GROUPS:
        name = choices.get(group)
        path = conf_dir() / group / f"{name}.yaml"
        if name is None or not path.is_file():
            continue
        node = OmegaConf.load(path)
        keys = set(node.get("storage") or {})
        picks = None
        for entry in node.get("defaults") or []:
            if isinstance(entry, DictConfig) and "override /storage" in entry:
                picks = entry["override /storage"]
        if keys:
            out.append((group, name, keys, picks))
    return out


def check_storage_options(cfg: DictConfig) -> None:
    """A storage.* key that the chosen storage's class does not take, refused before any
    data work with the storages that take it: a variant= (or experiment=) written for one
    storage keeps its keys when storage= picks another (variant=lmdb_lz4 storage=shards:
    storage.compression), and the storage's constructor failed with a traceback."""
    from fastload.added_keys import target_parameters
    from fastload.config import conf_dir

    target = cfg.storage.get("_target_")
    # True: takes **kwargs, or not importable here (instantiating it says why)
    params = target_parameters(cfg.storage)
    if params is None or params is True:
        return
    extra = [k for k in cfg.storage if not str(k).startswith("_") and k not in params]
    if not extra:
        return
    key = extra[0]
    chosen = group_choices(cfg).get("storage", target)
    takers = sorted(p.stem for p in conf_dir().glob("storage/*.yaml") if key in OmegaConf.load(p))
    if takers:
        names = " or ".join(filter(None, [", ".join(takers[:-1]), takers[-1]]))
        fix = f", or pick a storage that takes it (storage={names})"
    else:
        fix = " (no shipped storage takes it)"
    setters = [(g, n, picks) for g, n, keys, picks in storage_settings(cfg) if key in keys]
    if setters:
        group, name, picks = setters[0]
        written = f", written for storage={picks}," if picks else ""
        raise ConfigError(
            f"storage.{key}={cfg.storage[key]!r}: {group}={name} sets it{written} but "
            f"storage={chosen} takes no such option. Drop {group}= (or storage=){fix}."
        )
    raise ConfigError(
        f"storage.{key}={cfg.storage[key]!r}: storage={chosen} takes no such option. Drop it{fix}."
    )


def word(value) -> str:
    """A config value as it is written on the command line (null, true, 8)."""
    return (
        "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    )


def build_storage(cfg: DictConfig):
    choices = group_choices(cfg)
    for group, name, keys, picks in storage_settings(cfg):
        if picks is not None and choices.get("storage") not in (None, picks):
            # e.g. variant=raw_shards storage=lmdb: an LMDB of raw pixels, not shards
            log.info(
                "storage=%s with %s=%s's %s (%s=%s is written for storage=%s)",
                choices["storage"], group, name,
                ", ".join(f"storage.{k}={word(cfg.storage.get(k))}" for k in sorted(keys)),
                group, name, picks,
            )  # fmt: skip
    return instantiate(cfg.storage)


def build_backend(cfg: DictConfig):
    return instantiate(cfg.backend)


def build_layout(cfg: DictConfig):
    """How the dataset lies under dataset.root (fastload/data/layouts.py)."""
    return instantiate(cfg.dataset.layout)


def prepare_data(cfg: DictConfig, ctx, storage=None, splits=tuple(SPLIT_KEYS)):
    """Once per node (local rank 0) before training: the dataset's `prepare` (generate the
    synthetic set) and the storage's (stage to tmpfs, pack) for `splits` (train, val: a
    benchmark that reads the training split alone stages and packs nothing else); the other
    ranks wait, for as long as that takes. Returns the storage object (`storage`, or the
    config's)."""
    storage = storage if storage is not None else build_storage(cfg)

    def prepare() -> None:
        if cfg.dataset.prepare is not None:
            instantiate(cfg.dataset.prepare)
        names = [cfg.dataset[SPLIT_KEYS[s]] for s in splits]
        storage.prepare(build_layout(cfg), names, skip_corrupt=cfg.dataset.skip_corrupt)

    # staging hundreds of GB can take longer than a collective's timeout: no deadline. A
    # SIGTERM, to the rank at work or to one waiting for it, stops it as Ctrl-C does
    # (nothing half-written kept, one line), not killed without a word.
    with sigterm_interrupts():
        try:
            dist.agreed(ctx, "preparing the data", prepare if ctx.is_local_main else None,
                        waiting="waiting for local rank 0 to prepare the data")  # fmt: skip
        except dist.RankFailed:
            # this node's preparation went well, another's failed: the run stops before
            # training, whose end would have cleaned up (storage.cleanup=true: a tmpfs copy)
            if ctx.is_local_main:
                names = [cfg.dataset[SPLIT_KEYS[s]] for s in splits]
                try:
                    storage.finish(build_layout(cfg), names)
                except Exception as exc:  # the other node's error is the one to report
                    log.warning("could not clean up after the data preparation: %s", exc)
            raise
    return storage


def normalize_on(cfg: DictConfig, backend=None, loader_target: str | None = None) -> str:
    """Where the single normalisation happens, with the combinations that cannot work refused
    (`loader_target`: the loader class when it is not cfg.loader's, as loader=auto's choice)."""
    where = cfg.loader.normalize_on
    loader_class = get_class(loader_target or cfg.loader._target_)
    if where not in NORMALIZE_ON:
        raise ConfigError(f"loader.normalize_on={where!r}: use 'device' or 'cpu'.")
    if cfg.loader.input_dtype not in DTYPES:
        raise ConfigError(
            f"loader.input_dtype={cfg.loader.input_dtype!r}: use one of {list(DTYPES)}."
        )
    if where == "cpu" and loader_class.normalizes_on_device:
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
    if backend is not None and backend.device_decoder is not None:
        if not loader_class.normalizes_on_device:
            log.info(
                "backend=%s decodes in the training thread with this loader, between steps, "
                "and its decode call returns after the GPU's queued work; loader=prefetch (or "
                "prefetch+bg) decodes in a thread of its own, two batches ahead",
                backend.name,
            )
    return where


def loader_options(cfg: DictConfig, local_world_size: int = 1) -> dict:
    """conf/loader/<name>.yaml as the loader class takes it: without the keys the builder
    owns (normalize_on, input_dtype) and loader=auto's probe settings (fastload/autotune.py
    resolves those into the keys here at the start of a run), num_workers a whole number."""
    opts = OmegaConf.to_container(cfg.loader, resolve=True)
    for key in ("normalize_on", "input_dtype"):
        opts.pop(key)
    opts.pop("auto", None)
    opts["num_workers"] = resolve_num_workers(opts["num_workers"], local_world_size)
    if opts.get("cross_epoch") and cfg.storage.get("cold_cache", False):
        # The eviction runs when an epoch starts; a stream across epochs has read that
        # epoch's first batches before it, from the warm cache, and booked them to the
        # epoch before: a cold-cache epoch would be part warm and its reads misattributed.
        log.info(
            "storage.cold_cache=true: loader.cross_epoch is off (each epoch's reads start "
            "after its eviction, so all of them are cold)"
        )
        opts["cross_epoch"] = False
    return opts


@dataclass(frozen=True)
class DataPlan:
    """A run's data path, resolved once from the config (`build_plan`)."""

    storage: object  # fastload.storage.base.Storage
    layout_config: object  # dataset.layout; built on first use (a custom dataset needs none)
    backend: object  # fastload.decode.base.DecodeBackend
    task: object  # fastload.tasks.base.Task, with its settings
    splits: dict  # "train" / "val" -> the split's folder name
    normalize_on: str  # "device" | "cpu"
    normalize: Normalize
    input_dtype: torch.dtype
    loader: dict  # `loader_options`: the loader class (_target_) and its arguments
    batch_size: int
    seed: int
    epochs: int
    max_steps_per_epoch: int | None
    local_world_size: int = 1
    readers: dict = dataclasses.field(default_factory=dict, compare=False)
    built: dict = dataclasses.field(default_factory=dict, compare=False)

    @property
    def layout(self):
        """How the dataset lies under dataset.root (fastload/data/layouts.py), built once."""
        if "layout" not in self.built:
            self.built["layout"] = instantiate(self.layout_config)
        return self.built["layout"]

    def reader(self, split: str):
        """The split's reader, opened once."""
        if split not in self.readers:
            self.readers[split] = self.storage.open(self.layout, self.splits[split])
        return self.readers[split]

    def replace(self, **changes) -> DataPlan:
        """The same plan with some parts changed (the readers kept when the storage is)."""
        keep = "storage" not in changes and "layout_config" not in changes
        return dataclasses.replace(
            self, **changes, readers=self.readers if keep else {}, built=self.built if keep else {}
        )

    def with_loader(self, **options) -> DataPlan:
        """The plan with some loader options changed (loader=auto's trials and its choice)."""
        return self.replace(loader={**self.loader, **options})


def build_plan(cfg: DictConfig, *, local_world_size: int = 1, storage=None, backend=None,
               task=None) -> DataPlan:  # fmt: skip
    """The config resolved once; `storage` / `backend` / `task` are the ones already built
    (the engine builds the backend and the task before preparing the data)."""
    backend = backend if backend is not None else build_backend(cfg)
    where = normalize_on(cfg, backend)
    return DataPlan(
        storage=storage if storage is not None else build_storage(cfg),
        layout_config=cfg.dataset.layout,
        backend=backend,
        task=task if task is not None else build_task(cfg),
        splits={split: cfg.dataset[key] for split, key in SPLIT_KEYS.items()},
        normalize_on=where,
        normalize=Normalize(cfg.dataset.mean, cfg.dataset.std),
        input_dtype=DTYPES[cfg.loader.input_dtype],
        loader=loader_options(cfg, local_world_size),
        batch_size=int(cfg.trainer.batch_size),
        seed=int(cfg.seed),
        epochs=int(cfg.trainer.epochs),
        max_steps_per_epoch=cfg.trainer.max_steps_per_epoch,
        local_world_size=local_world_size,
    )


_MIX_CHECKED: set = set()


def warn_if_class_sorted(reader, split: str) -> None:
    """A store read as a stream of shards (storage=webdataset) mixes only within its window:
    shards written class by class (another tool's, or an image folder's order) train on a
    few classes per batch. Said once, with the numbers, from the class labels it lists."""
    field = next((f for f in reader.schema.columns if f.classes), None)
    key = (getattr(reader, "base", None), split, len(reader), reader.shuffle_buffer)
    if field is None or key in _MIX_CHECKED:  # loader=auto's trials build it again
        return
    _MIX_CHECKED.add(key)
    seen, uniform = window_class_mix(reader.column(field.name), reader.shard_sizes,
                                     reader.shuffle_buffer)  # fmt: skip
    if uniform >= 4 and seen < 0.5 * uniform:
        log.warning(
            "storage=webdataset: the %s shards are stored nearly class by class: a window of "
            "%d consecutive samples (storage.shuffle_buffer, what the epoch's shuffle mixes) "
            "holds %.1f classes on average, a full shuffle %.1f, so batches hold few classes. "
            "Write the shards in shuffled order (python -m fastload.pack webdataset does), or "
            "raise storage.shuffle_buffer (more shards open and cached at once).",
            split, reader.shuffle_buffer, seen, uniform,
        )  # fmt: skip


def build_loader(
    plan: DataPlan,
    split: str,
    *,
    device="cpu",
    channels_last: bool = False,
    rank: int = 0,
    world_size: int = 1,
    dataset=None,
    collate_fn=None,
):
    """One split's loader (split: train | val); `dataset` (with `collate_fn`) replaces the
    task's dataset, e.g. in tests."""
    train, task, backend = split == "train", plan.task, plan.backend
    cpu = plan.normalize if plan.normalize_on == "cpu" else None
    if dataset is None:
        dataset = task.dataset(split, plan.reader(split), backend, cpu)
        collate_fn = collate_fn or task.collate
    shard_sizes = getattr(getattr(dataset, "reader", None), "shard_sizes", None)
    # A store read shard by shard (storage=webdataset), when the dataset's index is the
    # reader's: a dataset that leaves samples out (detection train: images without boxes)
    # or repeats them (super-resolution patches) is sampled map-style, reading its shards
    # in place or through the node cache.
    if shard_sizes is not None and len(dataset) == int(shard_sizes.sum()):
        if train and rank == 0:
            warn_if_class_sorted(dataset.reader, split)
        sampler = ShardStreamSampler(
            shard_sizes,
            rank=rank,
            world_size=world_size,
            seed=plan.seed,
            train=train,
            window=dataset.reader.shuffle_buffer,
            remainder=dataset.reader.remainder,
        )
    elif train:
        sampler = EpochSampler(
            len(dataset), rank=rank, world_size=world_size, shuffle=True, seed=plan.seed
        )
    else:
        sampler = ShardSampler(len(dataset), rank=rank, world_size=world_size)
    prep = DevicePrep(
        torch.device(device),
        plan.normalize if plan.normalize_on == "device" else None,
        channels_last,
        plan.input_dtype,
        decoder=getattr(backend, "device_decoder", None),
        skip_corrupt=bool(getattr(dataset, "skip_corrupt", False)),
        describe=getattr(getattr(dataset, "reader", None), "describe", None),
    )
    return instantiate(plan.loader)(
        dataset,
        sampler,
        batch_size=plan.batch_size,
        device_prep=prep,
        train=train,
        seed=plan.seed,
        rank=rank,
        local_world_size=plan.local_world_size,
        sample_bytes=task.sample_bytes(dataset, plan.normalize_on) if collate_fn is None else None,
        epochs=plan.epochs if train else None,
        max_batches=plan.max_steps_per_epoch if train else None,
        collate_fn=collate_fn,
    )


def build_data(plan: DataPlan, ctx, *, channels_last: bool) -> DataPath:
    """Both splits for training on this rank, from one plan (one backend, one task)."""
    common = dict(
        device=ctx.device, channels_last=channels_last, rank=ctx.rank, world_size=ctx.world_size
    )
    train = build_loader(plan, "train", **common)
    val = build_loader(plan, "val", **common)
    if len(train) == 0:
        per_rank = len(train.sampler)
        raise ConfigError(
            f"trainer.batch_size={plan.batch_size} is larger than the {per_rank} training "
            f"images each of the {ctx.world_size} rank(s) gets from {plan.layout.root}, and "
            f"loader.drop_last=true leaves no batch. Lower trainer.batch_size (<= {per_rank})."
        )
    plan.task.check(train.dataset.reader, val.dataset.reader)
    if ctx.is_main:
        plan.task.check_storage(plan.storage)
    return DataPath(train, val, plan.backend, plan.storage, train.dataset.reader, plan.task)
