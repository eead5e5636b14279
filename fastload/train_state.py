"""Everything a checkpoint holds, in one object: model, optimizer, LR schedule, loss scaler,
where training stands (epoch, step within it), the best validation metric and the epoch history.

With trainer.ema set, it also holds the model's EMA (fastload/ema.py) and its best metric.

`state_dict()` is the checkpoint layout, written in this one place; `load_state_dict()` reads
it back. Resuming from it continues bit for bit (tests/test_train.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from fastload import checkpoint as ckpt
from fastload.ema import ModelEma
from fastload.errors import CheckpointError
from fastload.optim import build_optimizer, warmup_cosine

log = logging.getLogger("fastload")


INIT_ONLY = ("model.weights", "model.weights_backbone", "model.zero_init_residual")
MODEL_CHECKED = ("model.arch:", "model.num_classes:", "dataset.num_classes:")


def model_config(cfg: DictConfig) -> dict:
    """What identifies the model a checkpoint was written for."""
    return {"arch": cfg.model.get("arch"), "num_classes": cfg.model.get("num_classes")}


@dataclass
class TrainState:
    model: torch.nn.Module  # unwrapped (no DDP / compile): what is saved
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    steps_per_epoch: int
    model_config: dict
    run_config: dict  # the config keys that shape the result (checkpoint.run_config)
    world_size: int = 1  # the ranks this run trains on
    batch_size: int = 0  # per rank
    grad_accum_steps: int = 1  # batches per optimizer update
    epoch: int = 0  # the epoch to run next
    step: int = 0  # steps of `epoch` already done at this world size (a mid-epoch checkpoint)
    # (world size, steps) of each stretch of `epoch` run at another world size before this
    # one (a run resumed on fewer or more ranks; fastload/data/elastic.py)
    stretches: list = field(default_factory=list)
    best_metric: float | None = None  # the task's validation metric at its best
    history: list = field(default_factory=list)
    ema: ModelEma | None = None  # trainer.ema: the weights' moving average
    best_ema_metric: float | None = None  # the metric of the EMA at its best
    # samples of each split ({"train": n, "val": m}), set by the engine: a resume on a
    # dataset.root whose contents changed is refused (`check_same_data`)
    data_sizes: dict | None = None
    # and their fingerprints ({"train": "files:<xxh3>"}, fastload/agreement.py): a resume on
    # as many samples whose files were renamed or relabelled is refused too
    data_fingerprints: dict | None = None
    # the decode backend trained with (loader=auto may choose another than backend=): a
    # resume keeps it (fastload/autotune.py: tune)
    backend: str | None = None
    # the files skipped as undecodable in `epoch` before a stop by a signal: listed with the
    # rest of the epoch's when it ends (a checkpoint inside the epoch does not know them)
    epoch_skipped: list = field(default_factory=list)

    @classmethod
    def create(
        cls,
        cfg: DictConfig,
        device,
        world_size: int,
        steps_per_epoch: int,
        *,
        amp,
        channels_last,
        model: torch.nn.Module | None = None,
    ):
        """The model, an SGD-style optimizer at the linearly scaled LR (base_lr x global
        batch / 256, the global batch being batch_size x world size x grad_accum_steps) and a
        warm-up + cosine schedule stepped per optimizer update; the EMA of the weights when
        trainer.ema.decay is set."""
        if model is None:  # the task's model (refused when it is for another task)
            from fastload.tasks.base import build_task

            model = build_task(cfg).build_model(cfg)
        model = model.to(device)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        accum = int(cfg.trainer.grad_accum_steps)
        lr = cfg.optim.base_lr * global_batch(cfg.trainer.batch_size, world_size, accum) / 256
        optimizer = build_optimizer(model, instantiate(cfg.optim), lr, device)
        updates = updates_per_epoch(steps_per_epoch, accum)
        total = updates * cfg.trainer.epochs
        warmup = max(1, min(total, int(cfg.optim.warmup_epochs * updates)))
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, warmup_cosine(total, warmup, cfg.optim.min_lr_ratio)
        )
        scaler = torch.amp.GradScaler(device.type, enabled=amp is torch.float16)
        return cls(
            model, optimizer, scheduler, scaler, steps_per_epoch, model_config(cfg),
            ckpt.run_config(cfg), world_size, int(cfg.trainer.batch_size), accum,
            ema=ModelEma.from_config(cfg.trainer.get("ema"), model),
        )  # fmt: skip

    def state_dict(self, rngs: list | None = None) -> dict:
        """The checkpoint. `rngs`: every rank's RNG state in rank order (`dist.gather_rng`),
        so that a resume on as many ranks gives each its own stream back; without them
        (one process) this process's."""
        rngs = rngs or [ckpt.rng_state()]
        ema = {} if self.ema is None else {
            "ema": self.ema.state_dict(), "best_ema_metric": self.best_ema_metric,
        }  # fmt: skip
        return {
            "format": ckpt.FORMAT,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.epoch,
            "step_in_epoch": self.step,
            "world_size": self.world_size,
            "grad_accum_steps": self.grad_accum_steps,
            # the schedule's updates per epoch: a resume on another world size continues it
            # at the same point of the run (change_global_batch)
            "updates_per_epoch": updates_per_epoch(self.steps_per_epoch, self.grad_accum_steps),
            "epoch_stretches": [list(x) for x in self.stretches],
            "best_metric": self.best_metric,
            "history": self.history,
            "rng": rngs[0],
            "rng_by_rank": rngs,
            "model_config": self.model_config,
            "run_config": self.run_config,
            "data_sizes": self.data_sizes,
            "data_fingerprints": self.data_fingerprints,
            "backend": self.backend,
            "epoch_skipped": self.epoch_skipped,
            **ema,
        }

    def load_state_dict(self, state: dict, path, rank: int = 0) -> None:
        """Restore from a checkpoint read by `checkpoint.load`; refuses one written for
        another model, or by a run whose result-shaping config differs, naming the keys."""
        self.check_same_run(state, path)
        self.check_same_data(state, path)
        have = state.get("model_config", {})
        if have != self.model_config:
            raise CheckpointError(
                f"checkpoint {path} was written for model {have}, but this run builds "
                f"{self.model_config}. Resume with the same model= and dataset= as that run, "
                f"or use resume=null."
            )
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(
                f"checkpoint {path} does not fit this run: {exc}. Use resume=null."
            ) from None
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.load_ema(state, path)
        self.epoch, self.step = state["epoch"], state["step_in_epoch"]
        self.stretches = [tuple(x) for x in state.get("epoch_stretches", [])]
        self.epoch_skipped = list(state.get("epoch_skipped", []))
        # checkpoints written before the detection and super-resolution tasks call it best_acc1
        self.best_metric = state.get("best_metric", state.get("best_acc1"))
        self.history = state["history"]
        saved = saved_world_size(state)
        # Each rank its own stream back (dropout, drop-path, anything random on the model's
        # side), bit for bit on as many ranks. On another world size the epoch's rest is
        # reshuffled anyway and the engine seeds every rank afresh; a checkpoint from before
        # rng_by_rank holds rank 0's state only.
        by_rank = state.get("rng_by_rank") or [state["rng"]]
        ckpt.set_rng_state(by_rank[rank] if rank < len(by_rank) else by_rank[0])
        saved_accum = int(state.get("grad_accum_steps", 1))
        if saved is not None and (saved, saved_accum) != (self.world_size, self.grad_accum_steps):
            self.change_global_batch(saved, saved_accum, path, say=rank == 0,
                                     saved_updates=state.get("updates_per_epoch"))  # fmt: skip

    def load_ema(self, state: dict, path) -> None:
        if self.ema is None:
            return
        if state.get("ema") is None:  # only a checkpoint that predates run_config gets here
            log.warning("%s holds no EMA of the weights: the EMA starts from its weights", path)
            self.ema = ModelEma(self.model, self.ema.decay, self.ema.every, self.ema.warmup)
            return
        try:
            self.ema.load_state_dict(state["ema"])
        except (RuntimeError, KeyError) as exc:
            raise CheckpointError(
                f"checkpoint {path}: its EMA does not fit this run's model: {exc}. Use resume=null."
            ) from None
        self.best_ema_metric = state.get("best_ema_metric")

    def last_update_lr(self) -> float:
        """The LR (first parameter group) the last optimizer update used. The schedule steps
        after each update, so the optimizer's own value is already the next update's (during
        warm-up, the next epoch's first)."""
        s = self.scheduler
        if s.last_epoch < 1:
            return self.optimizer.param_groups[0]["lr"]
        return s.base_lrs[0] * s.lr_lambdas[0](s.last_epoch - 1)

    def change_global_batch(self, saved: int, saved_accum: int, path, say: bool = True,
                            saved_updates: int | None = None) -> None:  # fmt: skip
        """Continue a run written at world size `saved` with `saved_accum` accumulation
        steps on this run's: on another world size the interrupted epoch goes on with the
        samples it had left (`stretches`). The learning rate follows the global batch
        (optim.base_lr x batch_size x world size x grad_accum_steps / 256, the rule every run
        starts with); a global batch kept (8 ranks -> 4 ranks x grad_accum_steps=2) keeps it.
        The schedule, built for this run's updates per epoch, continues at the same point of
        the run: the saved run's `saved_updates` an epoch mapped onto this run's. They are
        the global batches' ratio only roughly: each world size drops its own last partial
        batch, and trainer.max_steps_per_epoch caps both (1000 images in batches of 64: 7
        steps a rank on 2 ranks, 8 updates of 2 x 64 on 1). A checkpoint that predates
        `saved_updates` maps by samples seen."""
        if self.step and saved != self.world_size:
            self.stretches.append((saved, self.step))
            self.step = 0
        old = global_batch(self.batch_size, saved, saved_accum)
        new = global_batch(self.batch_size, self.world_size, self.grad_accum_steps)
        ratio = new / old
        before = self.scheduler.last_epoch
        updates = updates_per_epoch(self.steps_per_epoch, self.grad_accum_steps)
        scale = updates / saved_updates if saved_updates else 1 / ratio
        self.scheduler.last_epoch = round(before * scale)
        self.scheduler.base_lrs = [lr * ratio for lr in self.scheduler.base_lrs]
        for group, base, factor in zip(self.optimizer.param_groups, self.scheduler.base_lrs,
                                       self.scheduler.lr_lambdas, strict=True):  # fmt: skip
            group["initial_lr"] = base
            group["lr"] = base * factor(self.scheduler.last_epoch)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        if not say:  # every rank changes the same way; rank 0 says so
            return
        now = (
            f"trainer.batch_size={self.batch_size} x {self.world_size} rank(s) x "
            f"trainer.grad_accum_steps={self.grad_accum_steps}"
        )
        at = (
            f"the schedule goes on at update {self.scheduler.last_epoch} (was {before}, "
            f"{saved_updates} an epoch then, {updates} now: the same point of the run)"
            if saved_updates
            else f"the schedule goes on at update {self.scheduler.last_epoch} (was {before}: "
            f"the same samples seen)"
        )
        if ratio == 1:
            change = f"The global batch stays {new} ({now}): so does the LR, and {at}."
        else:
            keep = keeps(old, self.batch_size, self.world_size)
            change = (
                f"The global batch goes from {old} ({saved} rank(s) x grad_accum_steps="
                f"{saved_accum}) to {new} ({now}), so the learning rate is scaled by {ratio:.4g} "
                f"(optim.base_lr x global batch / 256) and {at}."
                + (f" trainer.grad_accum_steps={keep} would keep it." if keep else "")
            )
        log.warning(
            "%s was written by %d rank(s); this run has %d. %s%s", path, saved, self.world_size,
            change,
            f" Epoch {self.epoch} continues with the samples it had not trained yet, over "
            f"the {self.world_size} rank(s)." if self.stretches else "",
        )  # fmt: skip

    def check_same_run(self, state: dict, path) -> None:
        check_same_run(state, self.run_config, path)

    def check_same_data(self, state: dict, path) -> None:
        """CheckpointError when the checkpoint's run had another number of samples in a
        split than this one: the same dataset.root whose contents changed (files added or
        removed). Resumed inside an epoch, its plan of batches would index other files
        (some trained twice, others never), and the LR schedule's length follows the
        epoch's. As many samples with another fingerprint (files renamed, moved to another
        class) would do the same. Checkpoints written before the sizes (the fingerprints)
        were kept are not checked (by them); nor are fingerprints of another kind (a folder
        resumed from its pack: fastload/agreement.py)."""
        saved, now = state.get("data_sizes"), self.data_sizes
        if not saved or not now:
            return
        changed = [f"{k}: {saved[k]} -> {now[k]}" for k in now if k in saved and saved[k] != now[k]]
        if changed:
            raise CheckpointError(
                f"checkpoint {path} was written by a run on another dataset (samples per "
                f"split, checkpoint -> this run: {'; '.join(changed)}): files were added to or "
                f"removed from dataset.root since. Resumed on it, the epoch it continues would "
                f"train some samples twice and others never. Resume with the data as it was, "
                f"or start a new run: resume=null (or another name=)."
            )
        # Compared for a folder's files only ("files:<digest>"): a pack's fingerprint holds
        # its checksums, which a re-pack of the same samples (another node's, another
        # Pillow's re-encode) changes, and another storage= reads the same samples from
        # another kind of pack; those are checked by their counts above.
        saved, now = state.get("data_fingerprints") or {}, self.data_fingerprints or {}
        changed = [k for k in now if k in saved and saved[k] != now[k]
                   and kind_of(saved[k]) == kind_of(now[k]) == "files"]  # fmt: skip
        if changed:
            raise CheckpointError(
                f"checkpoint {path} was written by a run on other data in the "
                f"{' and '.join(changed)} split{'s' if len(changed) > 1 else ''}: as many "
                f"samples, but files renamed, replaced by others or moved to another class in "
                f"dataset.root since. Resumed on it, the epoch it continues would train some "
                f"samples twice and others never. Resume with the data as it was, or start a "
                f"new run: resume=null (or another name=)."
            )


def kind_of(fingerprint: str) -> str:
    """What a split fingerprint is of ("files", "pack:fastload-shards", ...): all but its
    digest (fastload/agreement.py: split_fingerprint)."""
    return fingerprint.rsplit(":", 1)[0]


def updates_per_epoch(steps_per_epoch: int, grad_accum_steps: int) -> int:
    """Optimizer updates of an epoch of `steps_per_epoch` batches: its last group may be short."""
    return -(-steps_per_epoch // grad_accum_steps)


def global_batch(batch_size: int, world_size: int, grad_accum_steps: int) -> int:
    """Samples per optimizer update, over all ranks."""
    return int(batch_size) * int(world_size) * int(grad_accum_steps)


def keeps(target: int, batch_size: int, world_size: int) -> int | None:
    """The grad_accum_steps that makes this world size's global batch `target`, if one does."""
    per_update = batch_size * world_size
    return target // per_update if target % per_update == 0 else None


def saved_world_size(state: dict) -> int | None:
    """The world size a checkpoint was written at (older checkpoints: their last epoch's
    row, or None when they have none)."""
    if "world_size" in state:
        return int(state["world_size"])
    rows = state.get("history") or []
    return int(rows[-1]["world_size"]) if rows and "world_size" in rows[-1] else None


def check_same_run(state: dict, run_config: dict, path) -> None:
    """CheckpointError naming the keys when the checkpoint's run had another
    result-shaping config than `run_config` (a model change is left to the model check)."""
    saved = state.get("run_config")
    if saved is None:
        return  # a format-1 checkpoint: load() already said it cannot be verified
    # Settings of the initial weights shape nothing on a resume, whose state replaces them;
    # another model (arch, classes) gets the model check's own message (load_state_dict);
    # any other model setting (srcnn's residual, its filters) changes what is computed.
    diff = [d for d in ckpt.config_differences(saved, run_config) if not d.startswith(INIT_ONLY)]
    model_only = all(d.startswith(MODEL_CHECKED) for d in diff)
    if diff and not model_only:
        shown = "; ".join(diff[:8]) + (f"; and {len(diff) - 8} more" if len(diff) > 8 else "")
        raise CheckpointError(
            f"checkpoint {path} belongs to a run with a different configuration "
            f"(checkpoint -> this run: {shown}). Resume with the same settings, or start "
            f"a new run: resume=null (or another name=)."
        )
