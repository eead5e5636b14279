"""The task seam: what a workload (classification, detection, super-resolution) adds to the
data path and the loop, so that neither the builder (fastload/pipeline.py) nor the engine
(fastload/engine.py) knows which workload runs.

A dataset yaml names its task (`task: {_target_: fastload.tasks.<module>.<Class>}`); a model
yaml says which task it is for (`task: classification`), and the two are checked against each
other before anything is built. A `Task`:

    kind                       "classification" | "detection" | "super_resolution"
    metric                     the validation metric that decides "best" (e.g. "val_acc1"),
                               `higher_is_better`, and how the summary table shows it
    data, seed                 its settings, given at construction (`build_task`): the
                               dataset yaml's section (transforms, skip_corrupt, num_classes,
                               scale, ...) and the run's seed
    dataset(split, reader, backend, normalize)
                               -> the torch Dataset of a split, indexed by (epoch, index) keys;
                               it reads the records' fields by name (fastload/data/records.py)
    collate                    the batch function (None: fastload/data/batch.collate, which
                               can reuse shared-memory batch slots)
    sample_bytes(dataset, where)
                               bytes of one collated image for the reused slots, or None
    check(train_reader, val_reader)
                               what must agree before training (class counts, ...)
    epoch_info(reader)         extra entries for every epoch row (e.g. annotations dropped)
    build_model(cfg)           the model of conf/model/<name>.yaml, checked against the task
    step(state, cfg, ctx, amp) -> a `Step`

A `Step` is what the loop calls on each batch (the benchmarks pass their own):

    train_mode(), eval_mode(), after_step()
    train(batch)               one optimisation step -> a 1-D float64 device tensor of sums
                               (no host sync): the batch's loss sum first, its sample count
                               last (the loop stops on a non-finite loss from them);
                               `train_metrics(sums)` turns their all-reduced values into the
                               epoch row's train_* entries
    scaler_skips()             (optional) steps the fp16 loss scaler skipped since the last
                               call, None without a scaler
    evaluator()                -> an `Evaluator`: `add(batch)` per validation batch,
                               `result(ctx)` -> the val_* entries, the same on every rank
"""

from __future__ import annotations

import abc

import torch
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from fastload import dist
from fastload.errors import ConfigError
from fastload.torch_internals import grad_scale


class Evaluator(abc.ABC):
    @abc.abstractmethod
    def add(self, batch: dict) -> None:
        """One validation batch (device-ready, as the loader yields it)."""

    @abc.abstractmethod
    def result(self, ctx) -> dict:
        """The val_* metrics over every rank's batches (a collective under DDP)."""


class Task(abc.ABC):
    kind: str
    metric: str
    metric_label: str  # the summary table's label for the best value, e.g. "best top-1"
    metric_unit: str = ""
    higher_is_better = True
    collate = None  # None: fastload.data.batch.collate

    def __init__(self, *, data: DictConfig | None = None, seed: int = 0):
        self.data = data if data is not None else OmegaConf.create({})  # the dataset section
        self.seed = int(seed)

    @abc.abstractmethod
    def dataset(self, split: str, reader, backend, normalize=None):
        """The split's Dataset: (epoch, index) keys -> samples `collate` batches."""

    def sample_bytes(self, dataset, where: str) -> int | None:
        """Bytes of one collated image, for the reused batch slots; None: no slots."""
        return None

    def check(self, train_reader, val_reader) -> None:
        """What must agree between the settings and the data before training."""
        return None

    def epoch_info(self, reader) -> dict:
        """Extra entries for the epoch row, from the training split's reader."""
        return {}

    def build_model(self, cfg: DictConfig) -> torch.nn.Module:
        """conf/model/<name>.yaml's model, refused with the fix when it is for another task."""
        opts = OmegaConf.to_container(cfg.model, resolve=True)
        made_for = opts.pop("task", "classification")
        if made_for != self.kind:
            raise ConfigError(
                f"model={model_choice(cfg)} is a {made_for} model, but dataset="
                f"{dataset_choice(cfg)} trains {self.kind}: pick one of its models "
                f"({', '.join(self.models)}){self.suggest and f', e.g. {self.suggest}'}."
            )
        classes = opts.get("num_classes")
        if classes is not None and (isinstance(classes, bool) or not isinstance(classes, int)
                                    or classes < 1):  # fmt: skip
            raise ConfigError(
                f"dataset.num_classes={classes!r}: use a whole number >= 1 (the classes or "
                f"object categories the model predicts)."
            )
        return instantiate(opts)

    models: tuple[str, ...] = ()  # conf/model names for this task, for the message above
    suggest: str = ""  # a whole working choice for that message, e.g. "model=srcnn optim=adam"

    @abc.abstractmethod
    def step(self, state, cfg: DictConfig, ctx, amp):
        """The Step that trains and evaluates this task's model."""

    def best(self, old: float | None, new: float) -> float:
        if old is None:
            return new
        return max(old, new) if self.higher_is_better else min(old, new)


def model_choice(cfg) -> str:
    return _choice(cfg, "model")


def dataset_choice(cfg) -> str:
    return _choice(cfg, "dataset")


def _choice(cfg, group: str) -> str:
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.choices[group]
    except Exception:  # no Hydra run (a test composing the config)
        return str(cfg[group].get("arch") or cfg[group].get("_target_", "?"))


def build_task(cfg: DictConfig) -> Task:
    """The dataset yaml's `task:`, given its settings (the dataset section, the seed): built
    once per run (fastload/pipeline.py: `build_plan`) and handed down."""
    spec = cfg.dataset.get("task")
    if spec is None:
        raise ConfigError(
            f"dataset={dataset_choice(cfg)} names no task: add `task: {{_target_: "
            f"fastload.tasks.classification.ClassificationTask}}` (or the detection / "
            f"super_resolution task) to its yaml, as conf/dataset/synthetic.yaml does."
        )
    # Constructed directly rather than through instantiate, which would merge and resolve
    # `data` (the dataset section: its layout, transforms and prepare nodes are built where
    # they are used, and its root may not resolve when a test supplies its own dataset).
    params = OmegaConf.to_container(spec, resolve=True)
    return get_class(params.pop("_target_"))(**params, data=cfg.dataset, seed=cfg.seed)


class TrainStep(abc.ABC):
    """The part of a Step every task shares: the model under DDP / torch.compile as set, one
    optimisation step under autocast with the loss scaler, the per-iteration LR step.
    A task's step implements `forward_loss(batch) -> (loss, sums)`."""

    def __init__(self, state, cfg: DictConfig, ctx, amp):
        self.state, self.amp, self.device = state, amp, ctx.device
        self.model = dist.wrap_ddp(state.model, cfg, ctx)
        if cfg.trainer.compile:
            self.model = torch.compile(self.model)
        self.skipped_by_scaler = torch.zeros((), dtype=torch.float64, device=ctx.device)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None)

    def train_mode(self) -> None:
        self.model.train()

    def eval_mode(self) -> None:
        self.model.eval()

    @abc.abstractmethod
    def forward_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss to back-propagate, the batch's sums for train_metrics)."""

    def train(self, batch: dict) -> torch.Tensor:
        with self.autocast():
            loss, sums = self.forward_loss(batch)
        s = self.state
        s.optimizer.zero_grad(set_to_none=True)
        s.scaler.scale(loss).backward()
        s.scaler.step(s.optimizer)
        scale = grad_scale(s.scaler) if s.scaler.is_enabled() else None
        before = None if scale is None else scale.clone()
        s.scaler.update()
        if before is not None:
            # update() lowers the scale exactly when this step's gradients overflowed and
            # step() skipped the optimizer: count it on the device, no host sync.
            self.skipped_by_scaler += grad_scale(s.scaler) < before
        return sums

    def scaler_skips(self) -> float | None:
        """Steps the fp16 loss scaler skipped since the last call (they trained nothing);
        None when no scaler runs. Read once per epoch: a host sync."""
        if not self.state.scaler.is_enabled():
            return None
        n = float(self.skipped_by_scaler)
        self.skipped_by_scaler.zero_()
        return n

    def after_step(self) -> None:
        self.state.scheduler.step()  # per iteration, skipped batches included


class SumsEvaluator(Evaluator):
    """Validation metrics that are sums over samples: `sums_of(batch)` -> a device tensor,
    all-reduced at the end and turned into metrics by `finish(totals)`."""

    def __init__(self, device, size: int, sums_of, finish):
        self.totals = torch.zeros(size, dtype=torch.float64, device=device)
        self.sums_of, self.finish = sums_of, finish

    def add(self, batch: dict) -> None:
        self.totals += self.sums_of(batch)

    def result(self, ctx) -> dict:
        return self.finish(dist.all_reduce(self.totals.tolist(), ctx))
