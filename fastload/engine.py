"""fit / train_one_epoch / evaluate: the training loop, read top to bottom.

    fit = set-up -> data (fastload/pipeline.py) -> state (fastload/train_state.py) -> resume
          -> epochs (train, evaluate, record, checkpoint)

The loop never knows which loader, backend or storage it runs on, nor which workload: it
calls the task's step object (fastload/tasks/; the benchmarks pass their own) on each batch.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from fastload import agreement, dist, run_folder
from fastload import checkpoint as ckpt
from fastload.added_keys import check_added_keys
from fastload.atomic import temp_path
from fastload.autotune import settings as tune_settings
from fastload.autotune import tune
from fastload.data.transforms import check_transforms
from fastload.ema import ModelEma
from fastload.ema import check_options as check_ema_options
from fastload.errors import CheckpointError, ConfigError, FastloadError, alike
from fastload.host import code_version, global_rank, hostname, size_text
from fastload.loaders import checks as loader_checks
from fastload.loaders.workers import check_num_workers, dead_worker_error
from fastload.optim import check_options as check_optim_options
from fastload.pipeline import (
    DataPath,
    build_backend,
    build_data,
    build_loader,
    build_plan,
    check_storage_options,
    prepare_data,
)
from fastload.preflight import preflight
from fastload.storage.packing import check_pack_numbers
from fastload.telemetry.report import (
    AMOUNTS,
    ProgressBar,
    format_summary_table,
    over_seconds,
    steady_epochs,
    whole_epochs,
)
from fastload.telemetry.sampler import ResourceSampler
from fastload.telemetry.sinks import MetricsFiles, NullSink, write_json_atomic
from fastload.telemetry.timer import StepTimer
from fastload.telemetry.wandb_sink import check_login as check_logger_login
from fastload.telemetry.wandb_sink import check_options as check_logger_options
from fastload.train_checks import (
    LossWatch,
    SkipBudget,
    TrainingDiverged,
    checked_share,
    diverged_message,
    weights_finite,
)
from fastload.train_state import INIT_ONLY, TrainState, check_same_run, model_config

log = logging.getLogger("fastload")


class TrainingInterrupted(FastloadError):
    """SIGTERM/SIGINT arrived; a checkpoint was written and the run stopped cleanly."""

    def __init__(self, message: str, signum: int = signal.SIGTERM):
        super().__init__(message)
        self.exit_code = 128 + int(signum)


class GracefulStop:
    """Turns SIGTERM/SIGINT into a flag the loop checks between steps (preemptible clusters
    send SIGTERM, then SIGKILL after a grace period). A second Ctrl-C stops at once."""

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        log.warning(
            "received %s: finishing this step, then writing a checkpoint",
            signal.Signals(signum).name,
        )

    def __enter__(self):
        for s in (signal.SIGTERM, signal.SIGINT):
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self._previous.items():
            signal.signal(s, h)


def amp_dtype(precision: str, device: torch.device, input_dtype: str = "fp32"):
    """trainer.precision's autocast dtype on `device` (None: fp32, no autocast). A model
    input of loader.input_dtype bf16/fp16 needs autocast: without it the first convolution
    fails on the dtype after the data is ready, so that is refused here."""
    if precision == "auto":
        amp = None
        if device.type == "cuda":
            amp = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    else:
        dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
        if precision not in dtypes:
            raise ConfigError(f"trainer.precision={precision!r}: use auto, fp32, bf16 or fp16.")
        if precision == "fp16" and device.type != "cuda":
            raise ConfigError("trainer.precision=fp16 needs CUDA; on CPU use bf16 or fp32.")
        amp = dtypes[precision]
    if amp is None and input_dtype != "fp32":
        raise ConfigError(
            f"loader.input_dtype={input_dtype} needs autocast, but trainer.precision="
            f"{precision} trains in fp32 on {device.type}: the model's fp32 weights cannot "
            f"take a {input_dtype} input. Set trainer.precision=bf16 (or fp16 on a GPU) too, "
            f"or loader.input_dtype=fp32."
        )
    return amp


@dataclass(frozen=True)
class EpochSpan:
    epoch: int
    first_step: int  # > 0 when resuming mid-epoch
    max_steps: int


@dataclass
class EpochResult:
    steps: int  # the epoch's steps done (span.first_step included)
    timing: object  # this rank's StepTimer result
    metrics: dict  # train_*, skipped_corrupt and the backend's counters, over all ranks
    skipped_files: list[str]  # undecodable samples skipped, on every rank
    trained: int  # samples trained on, all ranks
    nonfinite: tuple[int, float] | None  # this rank's first non-finite (step, loss)
    diverged: bool  # a non-finite loss on any rank


def train_one_epoch(step, loader, ctx, span: EpochSpan, *, stopper, timer, progress, watch,
                    budget, hooks=None, after_step=None) -> EpochResult:  # fmt: skip
    """Steps span.first_step .. span.max_steps of one epoch; `hooks[k]()` runs just before
    step k (the evaluation loader's warm start), `after_step(k, files)` after it, with this
    rank's files skipped so far (checkpoints inside the epoch). It ends early, on every rank
    at the same step, on a signal, a non-finite loss (`watch`) or too many skipped samples
    (`budget`)."""
    totals = None  # the step's sums (loss sum, ..., count), on the device: no host sync
    skipped, counts, steps, hooks = 0, {}, span.first_step, hooks or {}
    skipped_files: list[str] = []
    bar = ProgressBar(span.max_steps, enabled=progress and ctx.is_main, desc=f"epoch {span.epoch}")
    bar.update(n=steps) if steps else None
    step.train_mode()
    step.begin(span.max_steps - span.first_step)
    watch.start(span.first_step)
    timer.start()
    since_check = 0
    for batch in timer.iter(loader):
        if steps >= span.max_steps:
            break
        if steps in hooks:
            with timer.data_work():
                hooks[steps]()
        skipped += batch["skipped"]
        skipped_files += batch.get("skipped_files", ())
        for k, v in batch.get("counts", {}).items():  # the backend's counters, e.g. fallbacks
            counts[k] = counts.get(k, 0) + v
        if batch["image"] is not None:
            sums = step.train(batch)
            watch.add(sums)
            totals = sums if totals is None else totals + sums
            timer.add_samples(len(batch["target"]))
        else:  # every sample skipped as corrupt: under DDP the rank still joins the step
            step.train_empty(batch.get("skipped_files", ()), getattr(loader, "spare_batch", None))
        step.after_step()
        steps += 1
        if after_step is not None:
            after_step(steps, skipped_files)
        bar.update(images_per_s=timer.images_per_s, data_wait_share=timer.data_wait_share)
        # Stop only between updates (a checkpoint then holds no half-accumulated group), and
        # under DDP every STOP_CHECK_STEPS steps: the ranks must agree, which is a collective
        # and a host sync. Every rank has the same steps, so they check at the same ones.
        since_check += 1
        if step.settled and (not ctx.distributed or since_check >= STOP_CHECK_STEPS
                             or steps >= span.max_steps):  # fmt: skip
            since_check = 0
            if stop_agreed(stopper, ctx, watch, budget.exceeded_early(skipped)):
                break
    step.finish()  # the data ended inside a group (fewer batches than planned): its update
    bar.close()
    timing = timer.stop()
    keys = counter_keys(counts, ctx)
    n = step.train_sums
    sums = totals.tolist() if totals is not None else [0.0] * n
    nonfinite = watch.first_bad(wait=True)
    overflow = step.scaler_skips() if hasattr(step, "scaler_skips") else None
    extra = [skipped, timing.samples, float(nonfinite is not None)]
    reduced = dist.all_reduce(sums + extra + [counts.get(k, 0) for k in keys], ctx)
    measured = step.train_metrics(reduced[:n])
    metrics = {
        # no sample trained (an epoch continued with nothing left): nothing measured, not 0
        **(measured if reduced[n + 1] else dict.fromkeys(measured)),
        "skipped_corrupt": int(reduced[n]),
        **{k: int(v) for k, v in zip(keys, reduced[n + 3 :], strict=True)},
    }
    if overflow is not None:  # fp16: steps that trained nothing, counted, not hidden
        # every rank skips the same updates (the gradients were reduced before the scaler
        # looked at them), so the ranks' counts are one count, not a sum
        metrics["scaler_skipped_steps"] = int(dist.all_reduce([overflow], ctx, op="max")[0])
    return EpochResult(steps, timing, metrics, dist.gather_lists(skipped_files, ctx),
                       int(reduced[n + 1]), nonfinite, reduced[n + 2] > 0)  # fmt: skip


STOP_CHECK_STEPS = 10


def counter_keys(counts: dict, ctx) -> list[str]:
    """The backend counters' names over every rank, in one order. Only decoded samples
    carry them: a rank whose every sample of the epoch (or of what was left of it) was
    skipped as corrupt has none, and the one all-reduce of their values, one length per
    rank, then failed or mixed one counter's sum into another's. One gather per epoch."""
    return sorted(set(dist.gather_lists(sorted(counts), ctx)))


def stop_agreed(stopper, ctx, watch, over_budget: bool) -> bool:
    """Whether every rank stops now: a signal, a non-finite loss or too many skipped samples
    on any rank (a collective under DDP)."""
    flags = [float(stopper.signum or 0), float(watch.first_bad() is not None), float(over_budget)]
    agreed = dist.all_reduce(flags, ctx, op="max")
    if agreed[0] > 0:
        stopper.signum = stopper.signum or int(agreed[0])
    return max(agreed) > 0


def signal_agreed(stopper, ctx) -> bool:
    """Whether any rank got SIGTERM/SIGINT (a collective under DDP); then every rank's
    stopper holds it."""
    agreed = int(dist.all_reduce([float(stopper.signum or 0)], ctx, op="max")[0])
    stopper.signum = stopper.signum or agreed or None
    return stopper.signum is not None


def evaluate(step, loader, ctx, ema=None) -> tuple[dict, int, int, list[str]]:
    """The val_* metrics (with trainer.ema, the EMA's too, as ema_val_*: the same batches,
    read once), and the samples skipped as undecodable and those evaluated (all ranks), with
    the skipped ones' files."""
    evaluators = {"": step.evaluator()}
    if ema is not None:
        ema.sync(ctx)
        evaluators["ema_"] = step.evaluator(ema.model)
    step.eval_mode()
    skipped, seen, files = 0, 0, []
    with torch.no_grad():
        for batch in loader:
            skipped += batch["skipped"]
            files += batch.get("skipped_files", ())
            if batch["image"] is not None:
                for evaluator in evaluators.values():
                    evaluator.add(batch)
                seen += len(batch["target"])
    skipped, seen = dist.all_reduce([skipped, seen], ctx)
    metrics = {}
    for prefix, evaluator in evaluators.items():
        metrics.update({prefix + k: v for k, v in evaluator.result(ctx).items()})
    return metrics, int(skipped), int(seen), dist.gather_lists(files, ctx)


def reduce_timing(timing, resources, ctx) -> dict:
    """Epoch wall = slowest rank (checkpoints written inside the epoch left out, as
    checkpoint_s); images/s = all ranks' samples / that wall; data wait =
    mean over ranks; GPU util = mean of each rank's own GPU; CPU % = mean over the ranks
    whose sampler measured it (null when none did: an epoch shorter than its interval)."""
    nan = float("nan")
    gpu = [resources.get("gpu_util_mean"), resources.get("gpu_util_p10")]
    gpu = [nan if v is None else float(v) for v in gpu]
    cpu = resources.get("cpu_percent")
    cpu = [0.0, 0.0] if cpu is None else [float(cpu), 1.0]  # (value, measured)
    s = dist.all_reduce([timing.data_wait_s, timing.compute_s, timing.samples, *gpu, *cpu], ctx)
    mem = [resources.get("peak_pss_mib") or 0.0, resources.get("peak_rss_sum_mib") or 0.0]
    m = dist.all_reduce([timing.wall_s, *mem, timing.outside_s], ctx, op="max")
    w = ctx.world_size
    return {
        "epoch_time_s": m[0],
        "train_images": int(s[2]),
        "images_per_s": s[2] / m[0] if m[0] > 0 else 0.0,
        "data_wait_s": s[0] / w,
        "data_wait_share": (s[0] / w) / m[0] if m[0] > 0 else 0.0,
        "compute_s": s[1] / w,
        "gpu_util_mean": None if math.isnan(s[3]) else s[3] / w,
        "gpu_util_p10": None if math.isnan(s[4]) else s[4] / w,
        "cpu_percent": s[5] / s[6] if s[6] else None,
        "peak_pss_mib": m[1] or None,  # one rank's process tree, the largest rank's
        "peak_rss_sum_mib": m[2] or None,
        # trainer.checkpoint_every_steps: writing them, left out of epoch_time_s
        "checkpoint_s": m[3],
    }


def find_resume(cfg) -> tuple[Path, dict] | None:
    """The checkpoint to continue, verified. resume=<file>: that one. resume=auto: the newest
    intact checkpoint of a run with this name (damaged ones are skipped, saying so). Either is
    refused while the run that writes it is still going (fastload/run_folder.py)."""
    if cfg.resume in (None, "", "null"):
        return None
    if cfg.resume != "auto":
        path = ckpt.in_run_folder(Path(cfg.resume))  # a run folder: its last.pt
        payload = ckpt.load(path)
        ckpt.refuse_weights(path, payload)
    else:
        found = None
        for path in ckpt.candidates(Path(cfg.output_root), cfg.name):
            try:
                found = (path, ckpt.load(path))
                break
            except CheckpointError as exc:
                if global_rank() == 0:  # every rank reads the same files
                    log.warning("resume=auto: skipping %s: %s", path, exc.user_message)
        if found is None:
            log.info("resume=auto: no intact checkpoint under %s/%s/, starting fresh",
                     cfg.output_root, cfg.name)  # fmt: skip
            return None
        path, payload = found
        log.info("resume=auto: resuming from %s, the newest intact checkpoint", path)
    run_folder.check_not_held(path)
    return path, payload


def keep_results(run_dir: Path, found: tuple[Path, dict] | None) -> None:
    """Refuse to train in a folder holding another run's results (hydra.run.dir= naming a
    finished run's folder): the run would replace its metrics.jsonl, summary and best
    weights with its own. Resuming a checkpoint of that folder continues the run there, and
    a torchrun or SLURM restart continues its own launch."""
    held = run_folder.results_in(run_dir)
    if not held or run_folder.restarted():
        return
    resumed = found[0].absolute() if found is not None else None
    if resumed is not None and run_dir.absolute() in resumed.parents:
        return
    what = f"resume= continues {found[0]}, whose history" if found else "a fresh run here"
    raise ConfigError(
        f"the run directory {run_dir} holds a run's results ({', '.join(sorted(held))}): "
        f"{what} would replace them. Continue that run with "
        f"resume={run_dir / 'checkpoints' / 'last.pt'}, or pass another hydra.run.dir= (or "
        f"none: every run gets its own folder under output_root/name/)."
    )


def same_checkpoint(found: tuple[Path, dict] | None, cfg, ctx) -> None:
    """Every rank found the same checkpoint (or none): a rank that resumed another state, or
    started fresh beside ranks that resume, would train with its own schedule and optimizer
    and drift from the others unseen. Only rank 0 writes checkpoints, so an output_root that
    is not shared (a node-local folder) is what makes them differ."""
    mine = str(found[0]) if found is not None else None
    chosen = dist.broadcast_object(mine, ctx)

    def check() -> None:
        if mine != chosen:
            raise CheckpointError(
                f"resume={cfg.resume}: rank 0 continues {chosen or 'nothing (a fresh start)'}, "
                f"but rank {ctx.rank} found {mine or 'no checkpoint'} under "
                f"output_root={cfg.output_root}: every rank must read the same checkpoints. "
                f"Put output_root on a file system all nodes share."
            )

    dist.agreed(ctx, "checking that every rank resumes the same checkpoint", check)


def nothing_left(found: tuple[Path, dict] | None, cfg) -> bool:
    """Whether the checkpoint to resume is of a run that trained all trainer.epochs."""
    if found is None:
        return False
    path, payload = found
    check_same_run(payload, ckpt.run_config(cfg), path)  # another experiment: its keys first
    return payload.get("epoch", 0) >= cfg.trainer.epochs and not payload.get("step_in_epoch")


def missing_keys(node, prefix: str = "") -> list[str]:
    """The `???` keys of a config (not the interpolations that point at them, which
    OmegaConf.missing_keys would trip over)."""
    out = []
    for key in node.keys():
        if OmegaConf.is_missing(node, key):
            out.append(f"{prefix}{key}")
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_interpolation():
            out += missing_keys(child, f"{prefix}{key}.")
    return out


def check_required(cfg: DictConfig) -> None:
    """`???` values (e.g. dataset=imagenet's root) fail with the option's name, not a trace."""
    missing = sorted(k for k in missing_keys(cfg) if not k.startswith("hydra"))
    if missing:
        example = " ".join(f"{k}=..." for k in missing)
        raise ConfigError(
            f"{', '.join(missing)} must be set for this configuration: add {example} to the "
            f"command (e.g. dataset.root=/data/imagenet)."
        )


TRAINER_MINIMUMS = {
    "batch_size": (1, "images per rank per step"),
    "epochs": (1, "epochs to train"),
    "eval_every": (1, "evaluate every N epochs"),
    "checkpoint_every": (0, "write a checkpoint every N epochs; 0: never"),
    "checkpoint_every_steps": (0, "also write one every N steps inside an epoch; 0: never"),
    "grad_accum_steps": (1, "batches whose gradients make one optimizer update"),
}


def check_trainer(cfg: DictConfig) -> None:
    """Whole numbers where the loop needs them, refused before anything starts."""
    t = cfg.trainer
    for key, (low, meaning) in TRAINER_MINIMUMS.items():
        value = t[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"trainer.{key}={value!r}: use a whole number >= {low} ({meaning}).")
    check_ema_options(t.get("ema"))
    cap = t.max_steps_per_epoch
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ConfigError(
            f"trainer.max_steps_per_epoch={cap!r}: use null (whole epochs) or a whole number >= 1."
        )


# Options that take one of a few words. A switch read by its truth (`if value:`, bool())
# took any word for true (trainer.compile=maybe compiled the model, storage.cold_cache=off
# evicted the page cache), and trainer.device for cuda only the word cuda:
# trainer.device=gpu trained on the CPU without a word. An option absent from the
# config (another storage, backend or loader) is not checked.
SWITCH = (True, False)
CHOICES = {
    "trainer.device": ("auto", "cpu", "cuda"),
    "trainer.channels_last": ("auto", True, False),
    "trainer.compile": SWITCH,
    "trainer.progress": SWITCH,
    "trainer.keep_best": SWITCH,
    "loader.pin_memory": ("auto", True, False),
    "loader.persistent_workers": SWITCH,
    "loader.cross_epoch": SWITCH,
    "loader.drop_last": SWITCH,
    "loader.reuse_batch_memory": SWITCH,
    "loader.auto.cache": SWITCH,
    "dataset.skip_corrupt": SWITCH,
    "storage.cold_cache": SWITCH,
    "storage.verify": SWITCH,
    "storage.auto_pack": SWITCH,
    "storage.skip_corrupt": SWITCH,
    "storage.cleanup": SWITCH,
    "storage.progress": SWITCH,
    "backend.draft": SWITCH,
    "backend.dct_scale": SWITCH,
    "backend.fastdct": SWITCH,
    "backend.fastupsample": SWITCH,
    "backend.fancy_upsampling": SWITCH,
    "backend.preallocate": SWITCH,
    "model.zero_init_residual": SWITCH,
    "model.residual": SWITCH,
    "optim.no_weight_decay_on_bn_and_bias": SWITCH,
    "optim.optimizer.nesterov": SWITCH,
    "doctor.preflight": SWITCH,
}


def check_choices(cfg: DictConfig) -> None:
    """ConfigError naming an option of CHOICES set to another value, and the values."""
    absent = object()
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key, default=absent)
        if value is absent:
            continue  # a config without the option (another loader or dataset group)
        if not any(value is a if isinstance(a, bool) else value == a for a in allowed):
            words = ", ".join(str(a).lower() for a in allowed)
            hint = (
                " (one GPU per rank: pick them with CUDA_VISIBLE_DEVICES)"
                if "device" in key
                else ""
            )
            raise ConfigError(f"{key}={value!r}: use one of {words}{hint}.")


def check_loader(cfg: DictConfig) -> None:
    """The loader's options its constructor checks (fastload/loaders/checks.py), refused
    before any data work (dataset generation, staging, packing), with the same words."""
    loader = cfg.loader
    if "num_workers" in loader:  # loader=auto picks them itself
        check_num_workers(loader.num_workers)
    loader_checks.check_options(loader.get("timeout", 0), loader.get("prefetch_factor", 2))
    loader_checks.resolve_balanced_tail(loader.get("balanced_tail", "auto"), on_cuda=False)
    loader_checks.resolve_pin_cap(loader.get("pin_memory_max_mb", "auto"), local_world_size=1)
    if "max_prefetch" in loader:  # loader=bg, prefetch+bg
        loader_checks.check_max_prefetch(loader.max_prefetch)


# Storage options that take a whole number or null (their ranges: the storage's constructor).
STORAGE_WHOLE_OR_NULL = {
    "max_side": "the longer side of re-encoded images, or null: the source bytes unchanged",
    "size": "the longer side of stored pixels, or null: full resolution",
}


# The pack options a packed storage's constructor checks (check_pack_numbers), by key.
PACK_NUMBERS = ("max_side", "quality", "size", "shard_mb", "shard_samples")


def check_storage_numbers(cfg: DictConfig) -> None:
    """A word for a storage size (storage.max_side=abc) failed in the packing, after the
    dataset was generated: refused up front, as are the pack options out of range
    (storage.quality=abc, storage.shard_mb=abc) in the words the storage uses."""
    for key, meaning in STORAGE_WHOLE_OR_NULL.items():
        value = cfg.storage.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"storage.{key}={value!r}: use a whole number or null ({meaning}).")
    given = {key: cfg.storage[key] for key in PACK_NUMBERS if key in cfg.storage}
    if given:
        check_pack_numbers(**given)


def check_writable(run_dir: Path) -> None:
    probe = run_dir / f".write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"cannot write to the run directory {run_dir} ({exc.strerror}); set "
            f"output_root=<a writable folder> (or hydra.run.dir=...)."
        ) from None


def optimizer_copies(optimizer) -> int:
    """Tensors of a parameter's size an optimizer keeps for it once stepping (in last.pt).
    `optimizer`: one, or the config's factory of one (a functools.partial: optim.optimizer)."""
    if isinstance(optimizer, functools.partial):
        name, group = optimizer.func.__name__.lower(), optimizer.keywords
    else:
        name, group = type(optimizer).__name__.lower(), optimizer.param_groups[0]
    if "sgd" in name:
        return 1 if group.get("momentum") else 0
    return 3 if group.get("amsgrad") else 2  # Adam's two moments (and AMSGrad's maximum)


def check_checkpoint_room(run_dir: Path, cfg: DictConfig, state: TrainState) -> None:
    """Refuse a run whose checkpoints do not fit where they go, before it trains an epoch
    to lose at the first write; warn when the second copy an atomic replace writes beside
    the last one does not fit."""
    t = cfg.trainer
    if not (t.checkpoint_every > 0 or t.checkpoint_every_steps > 0):
        return
    weights = ckpt.tensor_bytes(state.model.state_dict())
    params = sum(p.numel() * p.element_size() for p in state.model.parameters())
    copies = 1 + (state.ema is not None)
    last = weights * copies + params * optimizer_copies(state.optimizer)
    best = weights * copies if t.get("keep_best", True) else 0
    need, free = last + best, shutil.disk_usage(run_dir).free
    what = f"last.pt ~{size_text(last)}" + (f", best weights ~{size_text(best)}" if best else "")
    if free < need:
        raise CheckpointError(
            f"{run_dir} has {size_text(free)} free, but this run's checkpoints need about "
            f"{size_text(need)} ({what}): the first one would fail after training up to it. "
            f"Free some space there, set output_root=<a folder with room>, or "
            f"trainer.checkpoint_every=0 (no checkpoints)."
        )
    if free < need + last:
        log.warning("%s free under %s: enough for this run's checkpoints (%s), not for the "
                    "new last.pt written beside the old one before it replaces it",
                    size_text(free), run_dir, what)  # fmt: skip


BEST_FILE = {"model": ckpt.BEST, "ema": ckpt.BEST_EMA}
PENDING = ckpt.PENDING


class RunRecord:
    """What rank 0 writes: metrics.jsonl, summary.json, checkpoints and the logger sink."""

    def __init__(self, cfg: DictConfig, ctx, run_dir: Path, history: list, task, plan=None):
        self.ctx, self.run_dir, self.task = ctx, run_dir, task
        # both 0: never (debug=fast)
        self.checkpoints = (
            cfg.trainer.checkpoint_every > 0 or cfg.trainer.checkpoint_every_steps > 0
        )
        self.keep_best = self.checkpoints and cfg.trainer.get("keep_best", True)
        self.run_identity = {"model_config": model_config(cfg), "run_config": ckpt.run_config(cfg)}
        self.files = self.sink = None
        if ctx.is_main:
            self.files = MetricsFiles(run_dir)
            self.files.rewrite_epochs(history)  # a resumed run's directory has the history
            self.sink = instantiate(cfg.logger) if cfg.logger else NullSink()
            config = OmegaConf.to_container(cfg, resolve=True)
            if (
                plan is not None
            ):  # what the loader runs with (num_workers resolved, loader=auto's choice)
                config["resolved"] = {
                    "loader": plan.loader,
                    "backend": getattr(plan.backend, "name", None),
                }
            self.sink.start(config=config, run_dir=run_dir)
            for row in history:  # a resumed run's logger holds every epoch, as metrics.jsonl
                self.sink.log(row, step=row["epoch"])

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / "checkpoints" / ckpt.LAST

    def save(self, state: TrainState) -> None:
        """Every rank calls it (the RNG states are gathered); rank 0 writes."""
        if not self.checkpoints:
            return
        rngs = dist.gather_rng(self.ctx)
        if self.ctx.is_main:
            ckpt.save_atomic(state.state_dict(rngs), self.checkpoint_path)
            for name in BEST_FILE.values():  # the new bests this checkpoint now holds
                pending = self.checkpoint_path.with_name(name + PENDING)
                if pending.is_file():
                    os.replace(pending, pending.with_name(name))

    def save_best(self, model, of: str, epoch: int, value: float) -> None:
        """trainer.keep_best: the weights of an evaluation that beat the best so far, as
        checkpoints/best.pt (the EMA's: best_ema.pt); rank 0 writes. Written as
        best.pt.pending, renamed to best.pt by the next checkpoint (`save`): best.pt is then
        always of an evaluation that last.pt's history holds, also when the run is killed in
        between (trainer.checkpoint_every > 1 leaves epochs between them) and resumes in its
        own folder (a torchrun restart), where the pending file's evaluation is redone."""
        if not (self.keep_best and self.ctx.is_main):
            return
        payload = ckpt.weights_payload(model, of, epoch, self.task.metric, value, self.run_identity)
        ckpt.save_atomic(payload, self.checkpoint_path.with_name(BEST_FILE[of] + PENDING))

    def carry_skipped(self, resumed: Path, history: list) -> None:
        """A run resumed from another folder: that folder's skipped_files.txt lines of the
        epochs the resumed history holds, carried over (the same folder keeps its own)."""
        if self.ctx.is_main and resumed.parent.parent.absolute() != self.run_dir.absolute():
            self.files.keep_skipped(history, resumed.parent.parent / self.files.skipped_path.name)

    def stopped(self, exit_code: int) -> None:
        """A run stopped by a signal (its checkpoint written): the logger is closed with the
        process's exit code (W&B shows the run as failed, not finished), so that its record
        of the epochs so far is complete (an offline W&B run, its sync command)."""
        if self.ctx.is_main:
            sync = self.sink.finish(None, exit_code=exit_code)
            if sync:
                log.info("W&B (offline) of the epochs so far: %s", sync)

    def carry_best(self, resumed: Path, history: list) -> None:
        """A resumed run's best weights so far are in the folder of the run it continues:
        copied here (or, in the same folder, kept), when the evaluation they are of is in the
        resumed history (not one of an attempt that ended before its next checkpoint: a
        pending best of such an attempt in this folder is removed)."""
        if not (self.keep_best and self.ctx.is_main):
            return
        for of, name in BEST_FILE.items():
            target = self.checkpoint_path.with_name(name)
            pending = resumed.with_name(name + PENDING)
            if pending.is_file():  # killed after a new best, before or just after last.pt
                if self.in_history(pending, of, history):
                    self.copy_best(pending, target, move=pending.parent == target.parent)
                    continue
                if pending.parent == target.parent:
                    log.info("removing %s: its evaluation is not in the checkpoint resumed "
                             "from; this run redoes it", pending)  # fmt: skip
                    pending.unlink()
            source = resumed.with_name(name)
            if not source.is_file() or target.exists() or source.parent == target.parent:
                continue
            if not self.in_history(source, of, history):
                log.info("not carrying %s over: it is of an evaluation the resumed checkpoint "
                         "does not hold; this run writes its own", source)  # fmt: skip
                continue
            self.copy_best(source, target)

    @staticmethod
    def in_history(path: Path, of: str, history: list) -> bool:
        """Whether the best-weights file at `path` is of an evaluation in `history`."""
        try:
            best = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            key = ("ema_" if of == "ema" else "") + best["metric"]
            return any(r["epoch"] == best["epoch"] and r.get(key) == best["value"]
                       for r in history)  # fmt: skip
        except Exception:  # noqa: BLE001 - unreadable: this run writes its own
            return False

    @staticmethod
    def copy_best(source: Path, target: Path, move: bool = False) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        if move:
            os.replace(source, target)
            return
        tmp = temp_path(target)
        try:
            shutil.copyfile(source, tmp)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)

    def skipped(self, epoch: int, files: list[str]) -> None:
        """What dataset.skip_corrupt left out: the count and the first few on the console,
        every one in the run directory's skipped_files.txt."""
        if not (self.ctx.is_main and files):
            return
        self.files.append_skipped(epoch, files)
        listing = self.files.skipped_path
        shown = ", ".join(files[:3]) + (" ..." if len(files) > 3 else "")
        log.warning(
            "epoch %d: skipped %d image(s) that cannot be decoded (dataset.skip_corrupt=true): "
            "%s; all of them in %s",
            epoch,
            len(files),
            shown,
            listing,
        )

    def epoch(self, row: dict) -> None:
        if self.ctx.is_main:
            self.files.append_epoch(row)
            self.sink.log(row, step=row["epoch"])
            floats = ", ".join(f"{k}={v:.4g}" for k, v in row.items() if isinstance(v, float))
            log.info("epoch %d: %s", row["epoch"], floats)

    def finish(self, state: TrainState) -> dict:
        summary = summarize(state.history, self.run_dir, state.best_metric, self.task)
        if state.ema is not None:
            summary["best_ema_metric"] = state.best_ema_metric
            summary["best_ema_" + self.task.metric.removeprefix("val_")] = state.best_ema_metric
        if self.ctx.is_main:
            # written before the logger closes: a W&B close that hangs, fails or is cut short
            # by Ctrl-C leaves the summary of a run that trained every epoch
            summary["wandb_sync"] = summary["wandb_error"] = None
            summary["wandb_dir"] = getattr(self.sink, "sync_dir", None)
            self.files.write_summary(summary)
            try:
                summary["wandb_sync"] = self.sink.finish(summary)  # within a deadline
            except KeyboardInterrupt:
                log.warning("Ctrl-C while W&B closed its run: its record may lack the last "
                            "rows; metrics.jsonl and summary.json hold every epoch")  # fmt: skip
                summary["wandb_error"] = "closing the run was interrupted (Ctrl-C)"
            if getattr(self.sink, "error", None):
                summary["wandb_error"] = self.sink.error
            self.files.write_summary(summary)
            print(format_summary_table(summary), flush=True)
        return summary


def summarize(history: list[dict], run_dir: Path, best: float | None, task) -> dict:
    """The run in one dict (summary.json, the table): steady-state speed, memory, and the
    task's metric: `best_metric` with its name (`metric`, e.g. val_acc1) and the same value
    under best_<name> (best_acc1, best_map, best_psnr)."""

    def mean(key, rows):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    def over_time(key):
        """Over the steady epochs' seconds (telemetry/report.py: over_seconds); rows of runs
        that predate the amounts (train_images, data_wait_s): the mean of their rates."""
        amount = AMOUNTS.get(key)
        if amount and not any(r.get(amount) is not None for r in steady):
            return mean(key, steady)
        return over_seconds(steady, key)

    steady = steady_epochs(history)
    return {
        "epochs": len(history),
        "epoch_time_s_mean": mean("epoch_time_s", whole_epochs(history)),
        "images_per_s": over_time("images_per_s"),
        "data_wait_share": over_time("data_wait_share"),
        "gpu_util_mean": over_time("gpu_util_mean"),
        "peak_pss_mib": max((r["peak_pss_mib"] or 0 for r in history), default=None) or None,
        "peak_rss_sum_mib": max((r["peak_rss_sum_mib"] or 0 for r in history), default=0) or None,
        "metric": task.metric,
        "metric_label": task.metric_label,
        "metric_unit": task.metric_unit,
        "best_metric": best,
        "best_" + task.metric.removeprefix("val_"): best,
        "final_" + task.metric: history[-1].get(task.metric) if history else None,
        "final_train_loss": history[-1].get("train_loss") if history else None,
        "decoder": history[-1].get("decoder") if history else None,
        "world_size": history[-1].get("world_size") if history else None,
        "run_dir": str(run_dir),
        # what made the figures: `python -m fastload.report` says when runs differ in them
        "host": hostname(),
        "commit": code_version(),
    }


class EvalWarmStart:
    """When to start the evaluation loader so that its first batch is ready as training's
    last step ends: lead = (the time its first batch took last evaluation) / (the shortest
    step time measured so far), plus one step; two steps before anything is measured.

    A step time is measured two ways per epoch, and the shorter kept: the epoch's mean step,
    and the steps after the warm start (from the hook to the end of training, the GPU's queue
    included: the timer synchronises). The second is what an epoch holding torch.compile's
    compilation (a minute for ResNet-50, a mean step of a second or more) still measures
    right: with its mean alone the next epoch's lead was two steps, and on an H200 that
    epoch's evaluation took 0.24-0.62 s against 0.10-0.14 s in the epochs after. A lead too
    long costs only the evaluation's batches held early."""

    def __init__(self, timer: StepTimer):
        self.timer = timer  # its outside() time (checkpoints) is not the steps'
        self.first_batch_s: float | None = None
        self.step_s: float | None = None
        # (step, time, timer's outside_s) at the warm start
        self._started: tuple[int, float, float] | None = None

    def at_step(self, span: EpochSpan) -> int:
        lead = 2
        if self.first_batch_s is not None and self.step_s:
            lead = math.ceil(self.first_batch_s / self.step_s) + 1
        return max(span.first_step, span.max_steps - lead)

    def hooks(self, span: EpochSpan, start) -> dict:
        """train_one_epoch's hooks: `start` (the evaluation loader's) before step at_step."""
        at = self.at_step(span)

        def hook():
            start()  # (forking the workers is not a step's time)
            self._started = (at, time.perf_counter(), self.timer.outside_s)

        return {at: hook}

    def trained(self, steps: int, timing) -> None:
        """Training's end, `steps` done (`timing`: the epoch's): the steps after the warm
        start give a step time, less the checkpoints written among them."""
        if self._started is not None and steps > self._started[0]:
            at, t, outside = self._started
            busy = time.perf_counter() - t - (timing.outside_s - outside)
            self._keep(busy / (steps - at))
        self._started = None

    def measured(self, timing, val_loader) -> None:
        if timing.steps:
            self._keep(timing.wall_s / timing.steps)
        if val_loader.first_batch_s is not None:
            self.first_batch_s = val_loader.first_batch_s

    def _keep(self, step_s: float) -> None:
        self.step_s = step_s if self.step_s is None else min(self.step_s, step_s)


class Epochs:
    """The epoch loop of one run: train, evaluate when due, record, checkpoint; a signal
    stops it with a checkpoint (mid-epoch or after the epoch) and TrainingInterrupted.
    `record` is a RunRecord (bench train passes one that only keeps the rows)."""

    def __init__(self, cfg, ctx, state: TrainState, step, data: DataPath, record, task):
        self.cfg, self.ctx, self.state, self.step, self.task = cfg, ctx, state, step, task
        self.data, self.record = data, record
        self.timer = StepTimer(cuda_sync=ctx.device.type == "cuda")
        self.start_up = True  # the next epoch is this process's first: it carries the start-up
        self.warm = EvalWarmStart(self.timer)
        self.watch = LossWatch(ctx.device)
        epoch_samples = state.steps_per_epoch * cfg.trainer.batch_size * ctx.world_size
        self.budget = SkipBudget(cfg.dataset.max_skipped_share, epoch_samples)

    def run(self) -> None:
        gpu = self.ctx.device.index if self.ctx.device.type == "cuda" else None
        with GracefulStop() as stopper, ResourceSampler(gpu_index=gpu) as sampler:
            for epoch in range(self.state.epoch, self.cfg.trainer.epochs):
                self.one(epoch, stopper, sampler)

    def evaluates(self, epoch: int) -> bool:
        last = epoch + 1 == self.cfg.trainer.epochs
        return last or (epoch + 1) % self.cfg.trainer.eval_every == 0

    def one(self, epoch: int, stopper, sampler) -> None:
        cfg, ctx, state, data = self.cfg, self.ctx, self.state, self.data
        if state.step == 0:
            torch.manual_seed(cfg.seed * 100_003 + epoch * 1_009 + ctx.rank)
        data.train.set_epoch(epoch, skip_batches=state.step, stretches=state.stretches)
        data.before_epoch(ctx)
        sampler.reset()
        span = EpochSpan(epoch, state.step, data.train.batches_in(epoch))
        continued = bool(state.stretches)  # begun on another world size, its plan from 0 here
        if continued and ctx.is_main:
            self.continued(epoch, span)
        hooks = self.warm.hooks(span, data.val.start) if self.evaluates(epoch) else {}
        done = train_one_epoch(
            self.step, data.train, ctx, span, stopper=stopper, timer=self.timer,
            progress=cfg.trainer.progress, watch=self.watch, budget=self.budget, hooks=hooks,
            after_step=self.checkpoint_inside(epoch, span, sampler),
        )  # fmt: skip
        self.warm.trained(done.steps, done.timing)
        steps, timing, metrics = done.steps, done.timing, done.metrics
        lr = state.last_update_lr()  # this epoch's last update's, not the next one's
        if done.diverged or not weights_finite(state.model):  # before evaluating or saving
            raise TrainingDiverged(
                diverged_message(epoch, done.nonfinite, lr, state.scaler.is_enabled(), cfg)
            )
        part = steps < span.max_steps or bool(span.first_step) or continued
        self.budget.check(epoch, "training", metrics["skipped_corrupt"], done.trained,
                          done.skipped_files, part=part)  # fmt: skip
        resources = sampler.snapshot()
        # with a stopped part's; a file once (DistributedSampler's padding repeats samples)
        skipped_files = list(dict.fromkeys(state.epoch_skipped + done.skipped_files))
        if stopper.signum is not None and steps < span.max_steps:
            state.epoch, state.step, state.epoch_skipped = epoch, steps, skipped_files
            self.stop(stopper, f"at epoch {epoch} step {steps}")
        state.epoch, state.step, state.stretches, state.epoch_skipped = epoch + 1, 0, [], []
        row, new_bests = {"epoch": epoch, **metrics, "lr": lr}, []
        if span.first_step or continued:  # resumed inside it: the numbers cover what is left
            row["resumed_at_step"] = span.first_step
        if self.start_up:  # workers, caches, compilation: left out of the steady-state means
            row["start_up_epoch"], self.start_up = True, False
        if self.evaluates(epoch):
            t0 = time.perf_counter()
            val, val_skipped, val_seen, val_files = evaluate(self.step, data.val, ctx, state.ema)
            self.budget.check(epoch, "validation", val_skipped, val_seen, val_files)
            row.update(val, val_skipped_corrupt=val_skipped)
            row["eval_time_s"] = time.perf_counter() - t0
            state.best_metric = self.better(state.best_metric, row, state.model, "model",
                                            epoch, new_bests)  # fmt: skip
            if state.ema is not None:
                state.best_ema_metric = self.better(state.best_ema_metric, row, state.ema.model,
                                                    "ema", epoch, new_bests)  # fmt: skip
            self.warm.measured(timing, data.val)
        row.update(reduce_timing(timing, resources, ctx))
        row.update(world_size=ctx.world_size, **data.epoch_stats(ctx, epoch))
        state.history.append(row)
        self.record.epoch(row)
        self.record.skipped(epoch, skipped_files)
        # after the row: weights that do not fit on the disk lose the epoch's numbers no more
        for model, of, value in new_bests:
            self.record.save_best(model, of, epoch, value)
        last = epoch + 1 == cfg.trainer.epochs
        every = cfg.trainer.checkpoint_every
        saved = bool(every and (last or (epoch + 1) % every == 0))
        saved = saved or bool(cfg.trainer.checkpoint_every_steps)
        if saved:
            self.record.save(state)
        # A signal that came after the epoch's last stop check: agreed here, or one rank
        # would stop (and gather for its checkpoint) while the others train on.
        if not last and signal_agreed(stopper, ctx):
            self.stop(stopper, f"after epoch {epoch}", saved=saved)

    def better(self, best: float | None, row: dict, model, of: str, epoch: int,
               new_bests: list) -> float | None:  # fmt: skip
        """The best value of the task's metric (of the model or of its EMA) after this
        evaluation; when it is a new best, (model, of, value) goes to `new_bests`, whose
        weights are kept once the epoch's row is written (RunRecord.save_best)."""
        value = row[("ema_" if of == "ema" else "") + self.task.metric]
        new = self.task.best(best, value)
        if new != best and new == value:
            new_bests.append((model, of, value))
        return new

    def continued(self, epoch: int, span: EpochSpan) -> None:
        """Say how an epoch begun at another world size goes on (fastload/data/elastic.py)."""
        runs = ", ".join(f"{steps} step(s) on {w} rank(s)" for w, steps in self.state.stretches)
        left = self.data.train.left_out
        log.info(
            "epoch %d was trained for %s; it goes on with the samples it had left: %d step(s) "
            "on %d rank(s)%s",
            epoch, runs, span.max_steps, self.ctx.world_size,
            f"; {left} sample(s) left out (too few to give every rank 2 in a last step)"
            if left else "",
        )  # fmt: skip

    def checkpoint_inside(self, epoch: int, span: EpochSpan, sampler):
        """trainer.checkpoint_every_steps=N: a checkpoint after every N-th step of the epoch
        (a SIGKILL or a lost node, which gives no time for one, then loses fewer than N), or
        at the end of the gradient-accumulation group that step is inside of."""
        every = self.cfg.trainer.checkpoint_every_steps
        if not every:
            return None
        due, before = False, list(self.state.epoch_skipped)  # a stopped part's, if resumed

        def after_step(steps: int, skipped_files: list[str]) -> None:
            nonlocal due
            due = due or steps % every == 0
            if due and self.step.settled and steps < span.max_steps:
                due = False
                if not self.healthy():  # the stop check ends the run; last.pt stays as it was
                    return
                # the files skipped so far, on every rank: a restart from this checkpoint
                # lists them with the ones of the part it trains
                files = dist.gather_lists(skipped_files, self.ctx)
                self.state.epoch_skipped = list(dict.fromkeys(before + files))
                self.state.epoch, self.state.step = epoch, steps
                # the epoch's timing and GPU utilisation are of training, not of I/O
                with self.timer.outside(), sampler.paused():
                    self.record.save(self.state)
                    dist.barrier(self.ctx)  # the other ranks wait for rank 0's write here

        return after_step

    def healthy(self) -> bool:
        """Whether every rank's losses so far and weights are finite: asked before a checkpoint
        inside an epoch, since the stop check that notices a non-finite loss may come up to
        STOP_CHECK_STEPS steps later, and a checkpoint of broken weights would replace the
        last good one (and be the one resume=auto picks). One host sync per checkpoint."""
        bad = self.watch.first_bad(wait=True) is not None or not weights_finite(self.state.model)
        return dist.all_reduce([float(bad)], self.ctx, op="max")[0] == 0

    def stop(self, stopper, where: str, saved: bool = False) -> None:
        if not saved:
            self.record.save(self.state)
        dist.barrier(self.ctx)
        if not self.record.checkpoints:
            then = "no checkpoint was written (trainer.checkpoint_every=0)."
        else:
            then = (
                f"checkpoint {self.record.checkpoint_path}. Continue with the same command "
                f"plus resume=auto (or resume=<that file>)."
            )
        raise TrainingInterrupted(
            f"stopped by {signal.Signals(stopper.signum).name} {where}; {then}", stopper.signum
        )


def evaluate_weights(cfg, ctx, path: Path, payload: dict, state: TrainState, step, val_loader,
                     run_dir: Path) -> dict:  # fmt: skip
    """evaluate=<file>: that file's weights (best.pt, best_ema.pt, or a checkpoint's model and
    EMA) on the validation split, no training (the torchvision references' --test-only): the
    val_* entries printed and written to evaluation.json in the run directory."""
    ema = None
    try:
        state.model.load_state_dict(payload["model"])
        if payload.get("ema") is not None:  # a checkpoint of a run with trainer.ema
            ema = ModelEma(state.model, decay=0.0)  # evaluated only, never updated
            ema.load_state_dict(payload["ema"])
    except (RuntimeError, KeyError) as exc:
        raise CheckpointError(f"{path} does not fit this run's model: {exc}") from None
    t0 = time.perf_counter()
    val, skipped, seen, files = evaluate(step, val_loader, ctx, ema)
    # the epoch of metrics.jsonl's row the weights are of (a checkpoint names the one to run
    # next; one written inside an epoch, the steps of it they trained too)
    epoch_of, inside = payload.get("epoch"), payload.get("step_in_epoch") or 0
    if payload.get("kind") != ckpt.WEIGHTS and epoch_of is not None and not inside:
        epoch_of -= 1
    SkipBudget(cfg.dataset.max_skipped_share, seen).check(max(epoch_of or 0, 0), "validation",
                                                         skipped, seen, files)  # fmt: skip
    seconds = time.perf_counter() - t0
    row = {"weights": str(path), "of": payload.get("of", "model"), "epoch": epoch_of,
           **({"step_in_epoch": inside} if inside else {}), **val,
           "val_images": seen, "val_skipped_corrupt": skipped, "eval_time_s": seconds,
           "images_per_s": seen / seconds if seconds > 0 else 0.0}  # fmt: skip
    if ctx.is_main:
        write_json_atomic(run_dir / "evaluation.json", row)  # never half-written
        width = max(map(len, row))
        print("\n".join(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}"
                        for k, v in row.items()), flush=True)  # fmt: skip
    return row


def finished_already(path: Path, run_dir: Path, cfg, ctx) -> dict:
    """resume= names a run that trained all its epochs: say so and keep no new folder."""
    if ctx.is_main:
        removed = run_folder.remove_if_unused(run_dir)
        print(
            f"nothing left to train: {path} is the checkpoint of a run that finished all "
            f"{cfg.trainer.epochs} epochs (its results: {path.parent.parent}). Start a new run "
            f"with resume=null (or another name=)"
            + ("." if removed else f"; {run_dir} was kept (it holds other files)."),
            flush=True,
        )
    return {"nothing_left": True, "checkpoint": str(path)}


def check_config(cfg: DictConfig) -> None:
    """The checks of the config alone that every run makes before any work (dataset
    generation, staging, packing): `???` values, the trainer's, the switches' and words'
    (CHOICES), loader=auto's, the optimiser's (optim=apex_sgd: apex importable), the
    storage's keys and sizes, the loader's, the transforms', skip-share and logger's
    (logger=wandb) options."""
    check_added_keys(cfg)  # +trainer.lr_typo=0.5, as Hydra's own error suggests: unread
    check_required(cfg)
    check_trainer(cfg)
    check_choices(cfg)
    if "auto" in cfg.loader:
        tune_settings(cfg)  # loader=auto's probe settings
    check_optim_options(cfg.optim)
    check_storage_options(cfg)  # e.g. a variant='s storage keys with another storage=
    check_storage_numbers(cfg)
    check_loader(cfg)
    check_transforms(cfg.dataset)
    checked_share(cfg.dataset.max_skipped_share)
    check_logger_options(cfg.get("logger"))
    dist.ddp_class(cfg)  # trainer.ddp=apex where apex is missing: said by a single process too


def fit(cfg: DictConfig) -> dict:
    try:
        check_config(cfg)
    except ConfigError as exc:  # the config alone: a node's ranks got one command line
        raise alike(exc) from None
    ctx = dist.setup(cfg.trainer.device, cfg.trainer.dist_backend)
    run_dir = Path(HydraConfig.get().runtime.output_dir)

    def check_run_dir() -> dict:
        if ctx.is_main:
            check_writable(run_dir)
            ckpt.remove_dead_temps(Path(cfg.output_root), cfg.name)
        return agreement.run_record(cfg)

    # the run's first collective: every rank also shares its config and code, compared with
    # rank 0's before any work
    ranks = dist.gathered(ctx, "checking the run directory", check_run_dir)
    agreement.check_runs_alike(cfg, ctx, ranks)
    if cfg.get("evaluate"):
        return evaluate_only(cfg, ctx, run_dir)
    # logger.mode=online without a W&B login: said now, not after the data work (rank 0 logs)
    login = (lambda: check_logger_login(cfg.get("logger"))) if ctx.is_main else None
    dist.agreed(ctx, "checking the W&B login", login)
    found = dist.agreed(ctx, "finding the checkpoint to resume", lambda: find_resume(cfg))
    same_checkpoint(found, cfg, ctx)
    dist.agreed(ctx, "checking the run directory's results",
                (lambda: keep_results(run_dir, found)) if ctx.is_main else None)  # fmt: skip
    if nothing_left(found, cfg):
        return finished_already(found[0], run_dir, cfg, ctx)

    def room_for_checkpoints(model) -> None:  # before the data work: staging, packing
        planned = SimpleNamespace(
            model=model,
            optimizer=instantiate(cfg.optim).optimizer,
            ema=(cfg.trainer.get("ema") or {}).get("decay"),
        )
        dist.agreed(ctx, "checking the room for checkpoints",
                    (lambda: check_checkpoint_room(run_dir, cfg, planned)) if ctx.is_main else None)  # fmt: skip

    plan, model, channels_last, amp = set_up(
        cfg, ctx, splits=("train", "val"), check_model=room_for_checkpoints
    )
    try:
        summary = train_prepared(cfg, ctx, run_dir, found, plan, model, channels_last, amp)
    finally:
        if ctx.is_local_main:  # e.g. storage.cleanup=true removes a tmpfs staging, also when
            # the run fails before or while training
            plan.storage.finish(plan.layout, list(plan.splits.values()))
    dist.barrier(ctx)
    return summary


def train_prepared(cfg, ctx, run_dir: Path, found, plan, model, channels_last, amp) -> dict:
    """`fit` once the data is prepared (staged, packed): tune, build the data, train."""
    # loader=auto: a bounded probe (or its cached result) sets workers, prefetch, pinning, backend
    resumed_backend = found[1].get("backend") if found is not None else None
    plan = tune(plan, cfg, ctx, model, channels_last=channels_last, amp=amp,
                resumed_backend=resumed_backend)  # fmt: skip
    built = []

    def build() -> dict:  # and what the ranks compare: each split's samples
        built.append(build_data(plan, ctx, channels_last=channels_last))
        splits = {"train": built[0].train.dataset, "val": built[0].val.dataset}
        return agreement.data_record(splits, plan.layout.root)

    try:
        ranks = dist.gathered(ctx, "building the data", build)
        agreement.check_data_alike(ranks)
        data, mine = built[0], ranks[ctx.rank]["splits"]
        task = plan.task
        state = TrainState.create(
            cfg, ctx.device, ctx.world_size, len(data.train), amp=amp,
            channels_last=channels_last, model=model,
        )  # fmt: skip
        state.data_sizes = {split: s["samples"] for split, s in mine.items()}
        state.data_fingerprints = {split: s["fingerprint"] for split, s in mine.items()}
        state.backend = getattr(plan.backend, "name", None)
        if found is not None:
            state.load_state_dict(found[1], found[0], rank=ctx.rank)
            log.info("resumed from %s at epoch %d step %d", found[0], state.epoch, state.step)
        record = RunRecord(cfg, ctx, run_dir, state.history, task, plan)
        if found is not None:
            record.carry_best(found[0], state.history)
            record.carry_skipped(found[0], state.history)
        try:
            Epochs(cfg, ctx, state, task.step(state, cfg, ctx, amp), data, record, task).run()
        except RuntimeError as exc:  # torch's words for a dead worker or rank name a pid or socket
            raise plain_death(exc, ctx) from None
        except TrainingInterrupted as exc:
            record.stopped(exc.exit_code)
            raise
    finally:
        for data in built:
            data.close()
    return record.finish(state)


def set_up(cfg, ctx, splits: tuple[str, ...], check_model=None):
    """What training and evaluate= start alike: the seed, the checks that stop a run before
    any data work (`check_model(model)`: the caller's, on the model built), the plan, the
    model, the `splits` prepared; -> (plan, model, channels_last, the autocast dtype or
    None)."""
    torch.manual_seed(cfg.seed)
    backend = build_backend(cfg)  # a missing decoder is refused before any data work
    # /dev/shm, ulimit, cores, ...: fatal ones stop here, with the fixes; each rank judges its
    # node, and all stop when any does
    dist.agreed(ctx, "running the pre-flight check", lambda: preflight(cfg, ctx))
    # The data path resolved once (storage, layout, backend, task, normalisation, loader
    # options); everything below takes the plan, not the config.
    plan = build_plan(cfg, local_world_size=ctx.local_world_size, backend=backend)
    model = plan.task.build_model(cfg)  # so is a model made for another task
    if check_model is not None:
        check_model(model)
    amp = amp_dtype(cfg.trainer.precision, ctx.device, cfg.loader.input_dtype)
    prepare_data(cfg, ctx, plan.storage, splits=splits)  # once per node: generate, stage, pack
    channels_last = cfg.trainer.channels_last
    channels_last = ctx.device.type == "cuda" if channels_last == "auto" else bool(channels_last)
    return plan, model, channels_last, amp


def plain_death(exc: RuntimeError, ctx) -> Exception:
    """torch's words for a dead worker or rank name a pid or a socket: ours name the cause
    and the fix. Anything else is re-raised as it is."""
    died = dead_worker_error(exc) or dist.lost_rank_error(exc, ctx)
    if died is None:
        raise exc
    return died


# model options that only set up training (the initial weights, which layers train): the
# weights evaluated replace what they set
TRAINING_ONLY = (*INIT_ONLY, "model.trainable_backbone_layers")


def check_fits(path: Path, weights: dict, model: torch.nn.Module) -> None:
    """evaluate='s weights against the model before any data work (a plain state dict has no
    model config to compare): a CheckpointError saying what differs, in a line, not torch's
    list of every key."""
    own = model.state_dict()
    extra = [k for k in weights if k not in own]
    missing = [k for k in own if k not in weights]
    shapes = [k for k in weights if k in own and tuple(own[k].shape) != tuple(weights[k].shape)]
    if not (extra or missing or shapes):
        return
    parts = []
    if shapes:
        k = shapes[0]
        parts.append(f"{len(shapes)} of other shapes (e.g. {k}: the file's "
                     f"{list(weights[k].shape)}, this model's {list(own[k].shape)})")  # fmt: skip
    if missing:
        parts.append(f"{len(missing)} of this model's entries missing (e.g. {missing[0]})")
    if extra:
        parts.append(f"{len(extra)} not of this model (e.g. {extra[0]})")
    raise CheckpointError(
        f"{path} does not fit this run's model: {'; '.join(parts)}. Pass the model= (and "
        f"dataset.num_classes=) of the weights."
    )


def check_model_options(path: Path, payload: dict, cfg) -> None:
    """A fastload weights file evaluated with the model options it was trained with: an
    option that is no weight (SRCNN's residual, its scale) loads into any model and would
    evaluate other computations than were trained (8.6 against 32.1 dB for residual=false)."""
    saved = payload.get("run_config")
    if saved is None:  # a state dict from elsewhere: nothing to compare with
        return
    diff = [d for d in ckpt.config_differences(saved, ckpt.run_config(cfg))
            if d.startswith("model.") and not d.startswith(TRAINING_ONLY)]  # fmt: skip
    if diff:
        raise CheckpointError(
            f"{path} was trained with other model options than this run builds "
            f"({'; '.join(diff)}; the file's -> this run's): its weights would compute "
            f"something else. Pass the file's values (e.g. {diff[0].split(':')[0]}="
            f"{diff[0].split(': ', 1)[1].split(' -> ')[0]})."
        )


def evaluate_only(cfg, ctx, run_dir: Path) -> dict:
    """evaluate=<file>: the validation split alone is prepared (staged, packed) and loaded;
    no training split, no loader=auto probe (its loader options as the yaml sets them)."""
    if cfg.resume not in (None, "", "null"):
        raise ConfigError(
            f"evaluate={cfg.evaluate} and resume={cfg.resume}: evaluate= evaluates weights "
            f"without training, resume= continues training; set one of them."
        )
    path = Path(cfg.evaluate)
    payload = ckpt.load_weights(path)  # before any data work
    have = payload.get("model_config")
    if have is not None and have != model_config(cfg):
        raise CheckpointError(
            f"{path} holds weights of model {have}, but this run builds {model_config(cfg)}: "
            f"pass the model= and dataset= of the run that wrote it."
        )
    check_model_options(path, payload, cfg)
    plan, model, channels_last, amp = set_up(
        cfg, ctx, splits=("val",), check_model=lambda m: check_fits(path, payload["model"], m)
    )
    val = build_loader(plan, "val", device=ctx.device, channels_last=channels_last,
                       rank=ctx.rank, world_size=ctx.world_size)  # fmt: skip
    plan.task.check(val.dataset.reader, val.dataset.reader)  # dataset.num_classes, at least
    state = TrainState.create(cfg, ctx.device, ctx.world_size, 1, amp=amp,
                              channels_last=channels_last, model=model)  # fmt: skip
    try:
        step = plan.task.step(state, cfg, ctx, amp)
        row = evaluate_weights(cfg, ctx, path, payload, state, step, val, run_dir)
    except RuntimeError as exc:
        raise plain_death(exc, ctx) from None
    finally:
        val.close()
        if ctx.is_local_main:
            plan.storage.finish(plan.layout, [plan.splits["val"]])
    dist.barrier(ctx)
    return row
