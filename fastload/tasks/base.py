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

    train_mode(), eval_mode()
    begin(batches)             the epoch (or what is left of it) runs `batches` batches from
                               here: gradient-accumulation groups are counted from here
    train(batch)               forward and backward of one batch -> a 1-D float64 device
                               tensor of sums (no host sync): the batch's loss sum first, its
                               sample count last (the loop stops on a non-finite loss from
                               them); `train_metrics(sums)` turns their all-reduced values
                               into the epoch row's train_* entries
    train_empty()              this rank's batch held no decodable sample (every one skipped
                               as corrupt): under DDP the rank still takes part in the step's
                               collectives, so that no rank waits for it
    after_step()               after every batch (an all-skipped one included): the optimizer
                               update and the LR step once a group of
                               trainer.grad_accum_steps batches is complete
    settled                    True when no gradient waits for its update: the loop stops and
                               checkpoints only then, so a checkpoint never loses half a group
    finish()                   the update of a group the data ended inside of
    scaler_skips()             (optional) steps the fp16 loss scaler skipped since the last
                               call, None without a scaler
    evaluator(model=None)      -> an `Evaluator` of `model` (None: the step's own; the
                               engine passes the EMA of the weights too): `add(batch)` per
                               validation batch, `result(ctx)` -> the val_* entries, the
                               same on every rank
"""

from __future__ import annotations

import abc
import warnings
from contextlib import nullcontext

import torch
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from fastload import dist
from fastload.data.batch import IMAGE, TARGET
from fastload.errors import ConfigError, DatasetError
from fastload.torch_internals import grad_scale, skip_next_buffer_sync

# torch's warning when the first scheduler step comes before any optimizer step.
LR_BEFORE_OPTIMIZER = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


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

    def check_storage(self, storage) -> None:
        """What the task says of how the storage keeps its images (a pack stored smaller)."""
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
    """The part of a Step every task shares: the model under DDP / torch.compile as set, the
    backward under autocast with the loss scaler, and one optimizer update (and LR step, and
    EMA update with trainer.ema) per trainer.grad_accum_steps batches (the gradients' norm
    clipped to optim.clip_grad_norm first, when set). A task's step implements
    `forward_loss(batch) -> (loss, sums)`.

    Gradient accumulation as timm's --grad-accum-steps: each batch's mean loss is divided by
    its group's size, so a group of A full batches of B makes the update one batch of A x B
    would (up to BatchNorm, which normalises each batch by its own statistics); the epoch's
    last group may be shorter and is divided by its own size. A batch is weighted as a batch,
    not by its samples: one made smaller (by corrupt samples skipped, a continued elastic
    epoch's last steps, or loader.drop_last=false's last batch) weighs as much in its group
    as a full one, as without accumulation a short batch makes a whole update. Under DDP the
    gradients are all-reduced once per group, on its last backward (`no_sync` on the
    others)."""

    def __init__(self, state, cfg: DictConfig, ctx, amp):
        self.state, self.amp, self.device = state, amp, ctx.device
        self.model = dist.wrap_ddp(state.model, cfg, ctx)
        self.ddp = self.model if self.model is not state.model else None
        self.ctx = ctx
        # apex's DDP has no no_sync: it all-reduces every backward, which sums the same
        self.no_sync = getattr(self.model, "no_sync", None)
        if cfg.trainer.compile:
            self.model = torch.compile(self.model)
        self.accum = int(cfg.trainer.grad_accum_steps)
        self.clip = cfg.optim.get("clip_grad_norm")  # None: off
        self.skipped_by_scaler = torch.zeros((), dtype=torch.float64, device=ctx.device)
        self.distributed, self.rank = ctx.distributed, ctx.rank
        self.spare: dict | None = None  # two samples of the first batch, for train_empty
        self.begin(None)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None)

    def train_mode(self) -> None:
        self.model.train()

    def eval_mode(self) -> None:
        """Before an evaluation, on every rank. Native DDP broadcasts rank 0's buffers
        (BatchNorm's statistics) in the first forward after training's; a rank with no
        validation batch (fewer samples than ranks, or all of them skipped as corrupt)
        makes no forward and left the others waiting in that broadcast until the process
        group's timeout. So every rank makes it here, and the evaluation's forwards none."""
        self.model.eval()
        if self.ddp is not None and skip_next_buffer_sync(self.ddp):
            dist.broadcast_tensors(list(self.state.model.buffers()), self.ctx)

    @abc.abstractmethod
    def forward_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss to back-propagate, the batch's sums for train_metrics)."""

    def begin(self, batches: int | None) -> None:
        """`batches` batches follow (None: no end known): groups are counted from here."""
        self.left = batches
        self.in_group = self.backwards = 0
        self.group = self.next_group()
        self.state.optimizer.zero_grad(set_to_none=True)

    def next_group(self) -> int:
        return self.accum if self.left is None else max(1, min(self.accum, self.left))

    @property
    def settled(self) -> bool:
        return self.in_group == 0

    def train(self, batch: dict, weight: float = 1.0) -> torch.Tensor:
        if self.distributed and self.spare is None:
            self.spare = {k: first_two(batch[k]) for k in (IMAGE, TARGET)}
        closes = self.in_group + 1 >= self.group
        # the forward too: DDP prepares its all-reduce there
        quiet = self.no_sync() if self.no_sync is not None and not closes else nullcontext()
        with quiet:
            with self.autocast():
                loss, sums = self.forward_loss(batch)
            if self.group > 1 or weight != 1.0:
                loss = loss * (weight / self.group)
            self.state.scaler.scale(loss).backward()
        self.backwards += 1
        return sums

    def train_empty(self, skipped_files=(), spare=None) -> None:
        """Under DDP every rank's forward broadcasts buffers and its backward all-reduces the
        gradients, in step with the other ranks': a rank that skipped both would leave them
        waiting (a hang until the process group's timeout) or pair its next step's
        collectives with their current ones. So it runs the step on two samples of its first
        batch with the loss weighted 0 (nothing learnt from them) and its buffers
        (BatchNorm's running statistics) put back after. DDP averages over all ranks, so that
        update's gradient is the other ranks' scaled by their share of the world; every rank
        makes the same update, as it must to stay in step. Before a first batch with a
        decodable sample, the two come from `spare()` (the loader's `spare_batch`: the
        dataset's first decodable samples), so that this rank does not stop alone while the
        others wait for it."""
        if not self.distributed:
            return
        if self.spare is None and spare is not None:
            batch = spare()
            if batch is not None and batch.get(IMAGE) is not None:
                self.spare = {k: first_two(batch[k]) for k in (IMAGE, TARGET)}
        if self.spare is None:
            shown = ", ".join(map(str, list(skipped_files)[:4])) or "not named"
            raise DatasetError(
                f"rank {self.rank}: its first training batch held no decodable sample (every "
                f"one was skipped as corrupt; files: {shown}), and neither did the first "
                f"samples of its dataset, so it has nothing to take part in the other ranks' "
                f"step with. Fix or remove those files, or run with dataset.skip_corrupt=false "
                f"to stop at the first one with its error."
            )
        kept = [b.detach().clone() for b in self.state.model.buffers()]
        self.train(self.spare, weight=0.0)
        with torch.no_grad():
            for buf, old in zip(self.state.model.buffers(), kept, strict=True):
                buf.copy_(old)

    def after_step(self) -> None:
        self.in_group += 1
        if self.in_group >= self.group:
            self.update()

    def finish(self) -> None:
        if self.in_group:
            self.update()

    def update(self) -> None:
        """The group's optimizer update (none when every batch of it was skipped as corrupt),
        then the LR step: per update, skipped groups included."""
        s = self.state
        if self.backwards:
            if self.clip is not None:  # on the true gradients: unscaled from fp16's loss scale
                s.scaler.unscale_(s.optimizer)
                torch.nn.utils.clip_grad_norm_(s.model.parameters(), self.clip)
            s.scaler.step(s.optimizer)
            scale = grad_scale(s.scaler) if s.scaler.is_enabled() else None
            before = None if scale is None else scale.clone()
            s.scaler.update()
            if before is not None:
                # update() lowers the scale exactly when this step's gradients overflowed and
                # step() skipped the optimizer: count it on the device, no host sync.
                self.skipped_by_scaler += grad_scale(s.scaler) < before
        s.optimizer.zero_grad(set_to_none=True)
        if s.ema is not None:  # trainer.ema: per update attempted, as the schedule below
            s.ema.update(s.model)
        # Per update attempted, as timm and the torchvision references step it: a first update
        # that fp16's scaler skipped (or that had only corrupt batches) still moves the
        # schedule, so the LR stays a function of the step count that resume restores.
        # torch warns then ("lr_scheduler.step() before optimizer.step()"): for code that
        # calls them in the wrong order, which this is not.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", LR_BEFORE_OPTIMIZER, UserWarning)
            s.scheduler.step()
        if self.left is not None:
            self.left -= self.in_group
        self.in_group = self.backwards = 0
        self.group = self.next_group()

    def scaler_skips(self) -> float | None:
        """Updates the fp16 loss scaler skipped since the last call (they trained nothing);
        None when no scaler runs. Read once per epoch: a host sync."""
        if not self.state.scaler.is_enabled():
            return None
        n = float(self.skipped_by_scaler)
        self.skipped_by_scaler.zero_()
        return n


def first_two(value):
    """A copy of the first two samples of a batch field: a tensor's first two rows, a list's
    first two items (detection: image tensors, target dicts of tensors)."""
    if torch.is_tensor(value):
        return value[:2].clone()
    return [clone(v) for v in value[:2]]


def clone(value):
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    return value


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


def packed_side(storage) -> tuple[str, int | None] | None:
    """How a pack storage bounds its images' longer side: ("size", N) for raw pixels,
    ("max_side", N) for re-encoded JPEGs (None: as they are); None for a storage that does
    not pack."""
    options = getattr(storage, "pack_options", lambda: None)()
    if not options:
        return None
    key = "size" if options.get("kind") == "raw" else "max_side"
    return key, options.get(key)
