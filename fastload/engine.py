"""fit / train_one_epoch / evaluate / checkpoint. The loop never knows which loader,
backend or storage it runs on: it gets them from the config groups through `instantiate`."""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from fastload import checkpoint as ckpt
from fastload import dist
from fastload.data.dataset import ImageDataset, Normalize
from fastload.data.sampling import EpochSampler, ShardSampler
from fastload.errors import CheckpointError, ConfigError, FastloadError
from fastload.optim import build_optimizer, warmup_cosine
from fastload.storage.base import call_hook
from fastload.telemetry.report import ProgressBar, format_summary_table
from fastload.telemetry.sampler import ResourceSampler
from fastload.telemetry.sinks import MetricsFiles, NullSink
from fastload.telemetry.timer import StepTimer

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


def amp_dtype(precision: str, device: torch.device):
    if precision == "auto":
        if device.type != "cuda":
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    if precision not in dtypes:
        raise ConfigError(f"trainer.precision={precision!r}: use auto, fp32, bf16 or fp16.")
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError("trainer.precision=fp16 needs CUDA; on CPU use bf16 or fp32.")
    return dtypes[precision]


def wrap_ddp(model, cfg, ctx):
    if not ctx.distributed:
        return model
    if cfg.trainer.ddp == "apex":
        try:
            from apex.parallel import DistributedDataParallel as ApexDDP
        except ImportError:
            raise ConfigError(
                "trainer.ddp=apex needs NVIDIA apex, which is not importable here. It is not on "
                "PyPI: use an NVIDIA PyTorch container (it ships apex) or build apex from source "
                "(github.com/NVIDIA/apex); or use trainer.ddp=native."
            ) from None
        return ApexDDP(model)
    if cfg.trainer.ddp != "native":
        raise ConfigError(f"trainer.ddp={cfg.trainer.ddp!r}: use native or apex.")
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def build_loaders(cfg, ctx, channels_last: bool, storage_factory):
    backend = instantiate(cfg.backend)
    normalize = Normalize(cfg.dataset.mean, cfg.dataset.std)
    loader_factory = instantiate(cfg.loader)
    common = dict(
        batch_size=cfg.trainer.batch_size,
        device=ctx.device,
        normalize=normalize,
        channels_last=channels_last,
        seed=cfg.seed,
        rank=ctx.rank,
        local_world_size=ctx.local_world_size,
    )
    loaders, storages = [], []
    for split, key, train in (("train", "train_split", True), ("val", "val_split", False)):
        storage = storage_factory(root=cfg.dataset.root, split=cfg.dataset[key])
        storages.append(storage)
        transform = instantiate(cfg.dataset[f"{split}_transform"])
        data = ImageDataset(
            storage, backend, transform, seed=cfg.seed, skip_corrupt=cfg.dataset.skip_corrupt
        )
        if train:
            sampler = EpochSampler(
                len(data), rank=ctx.rank, world_size=ctx.world_size, shuffle=True, seed=cfg.seed
            )
        else:
            sampler = ShardSampler(len(data), rank=ctx.rank, world_size=ctx.world_size)
        loaders.append(loader_factory(data, sampler, train=train, **common))
    train_loader, val_loader = loaders
    if len(train_loader) == 0:
        per_rank = len(train_loader.sampler)
        raise ConfigError(
            f"trainer.batch_size={cfg.trainer.batch_size} is larger than the {per_rank} training "
            f"images each of the {ctx.world_size} rank(s) gets from {cfg.dataset.root}, and "
            f"loader.drop_last=true leaves no batch. Lower trainer.batch_size (<= {per_rank})."
        )
    return train_loader, val_loader, backend, storages[0]


def train_one_epoch(
    model,
    loader,
    optimizer,
    scheduler,
    scaler,
    criterion,
    ctx,
    *,
    epoch,
    amp,
    timer,
    max_steps,
    first_step,
    stopper,
    progress,
):
    model.train()
    totals = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss sum, correct, count
    skipped = 0
    counts: dict[str, int] = {}  # the backend's per-sample counters, e.g. decode fallbacks
    steps = first_step
    bar = ProgressBar(total=max_steps, enabled=progress and ctx.is_main, desc=f"epoch {epoch}")
    bar.update(n=first_step) if first_step else None
    timer.start()
    for batch in timer.iter(loader):
        if steps >= max_steps:
            break
        skipped += batch["skipped"]
        for k, v in batch.get("counts", {}).items():
            counts[k] = counts.get(k, 0) + v
        x, y = batch["image"], batch["target"]
        if x is not None:
            with torch.autocast(ctx.device.type, dtype=amp, enabled=amp is not None):
                out = model(x)
                loss = criterion(out, y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            # Accumulate on the device: no host sync per step.
            totals += torch.stack(
                [
                    loss.detach().double() * len(y),
                    (out.argmax(1) == y).sum().double(),
                    torch.tensor(len(y), dtype=torch.float64, device=ctx.device),
                ]
            )
            timer.add_samples(len(y))
        scheduler.step()
        steps += 1
        bar.update(images_per_s=timer.images_per_s, data_wait_share=timer.data_wait_share)
        # Under DDP the ranks must agree to stop at the same step: a small collective every
        # 10 steps instead of every step (each one is a host sync on the GPU).
        if not ctx.distributed or steps % 10 == 0 or steps >= max_steps:
            agreed = dist.all_reduce([float(stopper.signum or 0)], ctx, op="max")[0]
            if agreed > 0:
                stopper.signum = stopper.signum or int(agreed)
                break
    bar.close()
    timing = timer.stop()
    keys = sorted(counts)  # every batch of a backend carries the same keys, on every rank
    reduced = dist.all_reduce(totals.tolist() + [skipped] + [counts[k] for k in keys], ctx)
    loss_sum, correct, count, skipped = reduced[:4]
    return (
        steps,
        timing,
        {
            "train_loss": loss_sum / max(count, 1),
            "train_acc1": 100.0 * correct / max(count, 1),
            "skipped_corrupt": int(skipped),
            **{k: int(v) for k, v in zip(keys, reduced[4:], strict=True)},
        },
    )


@torch.no_grad()
def evaluate(model, loader, criterion, ctx, amp) -> dict:
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=ctx.device)  # loss, top1, top5, count
    for batch in loader:
        x, y = batch["image"], batch["target"]
        if x is None:
            continue
        with torch.autocast(ctx.device.type, dtype=amp, enabled=amp is not None):
            out = model(x)
        loss = criterion(out.float(), y)
        top5 = out.topk(min(5, out.shape[1]), dim=1).indices
        totals += torch.stack(
            [
                loss.double() * len(y),
                (top5[:, 0] == y).sum().double(),
                (top5 == y[:, None]).any(1).sum().double(),
                torch.tensor(len(y), dtype=torch.float64, device=ctx.device),
            ]
        )
    loss, top1, top5, n = dist.all_reduce(totals.tolist(), ctx)
    n = max(n, 1)
    return {"val_loss": loss / n, "val_acc1": 100 * top1 / n, "val_acc5": 100 * top5 / n}


def reduce_timing(timing, resources, ctx) -> dict:
    """Epoch wall = slowest rank; images/s = all ranks' samples / that wall; data wait =
    mean over ranks; GPU util = mean of each rank's own GPU."""
    nan = float("nan")
    gpu = [resources.get("gpu_util_mean"), resources.get("gpu_util_p10")]
    gpu = [nan if v is None else float(v) for v in gpu]
    s = dist.all_reduce(
        [
            timing.data_wait_s,
            timing.compute_s,
            timing.samples,
            *gpu,
            resources.get("cpu_percent") or 0.0,
        ],
        ctx,
    )
    m = dist.all_reduce([timing.wall_s, resources.get("peak_rss_mb") or 0.0], ctx, op="max")
    w = ctx.world_size
    return {
        "epoch_time_s": m[0],
        "images_per_s": s[2] / m[0] if m[0] > 0 else 0.0,
        "data_wait_s": s[0] / w,
        "data_wait_share": (s[0] / w) / m[0] if m[0] > 0 else 0.0,
        "compute_s": s[1] / w,
        "gpu_util_mean": None if math.isnan(s[3]) else s[3] / w,
        "gpu_util_p10": None if math.isnan(s[4]) else s[4] / w,
        "cpu_percent": s[5] / w,
        "peak_rss_mb": m[1],
    }


def storage_stats(storage, ctx) -> dict:
    """Bytes the storage read this epoch (all ranks) and the read bandwidth one reader saw."""
    stats = getattr(storage, "epoch_stats", None)
    if stats is None:
        return {}
    s = stats()
    nbytes, seconds = dist.all_reduce([s["read_mb"], s["read_s"]], ctx)
    return {
        "read_mb": nbytes,
        "read_mb_per_s": nbytes / seconds if seconds > 0 else None,
        "cold_cache": s["cold_cache"],
    }


def resolve_resume(cfg, run_dir: Path) -> Path | None:
    if cfg.resume in (None, "", "null"):
        return None
    if cfg.resume == "auto":
        found = ckpt.find_latest(Path(cfg.output_root), cfg.name)
        if found is None:
            log.info(
                "resume=auto: no checkpoint under %s/%s/, starting fresh", cfg.output_root, cfg.name
            )
        return found
    return Path(cfg.resume)


def check_model_matches(state, cfg, path):
    want = {"arch": cfg.model.get("arch"), "num_classes": cfg.model.get("num_classes")}
    have = state.get("model_config", {})
    if have != want:
        raise CheckpointError(
            f"checkpoint {path} was written for model {have}, but this run builds {want}. "
            f"Resume with the same model= and dataset= as that run, or use resume=null."
        )


def check_required(cfg: DictConfig) -> None:
    """`???` values (e.g. dataset=imagenet's root) fail with the option's name, not a trace."""
    missing = sorted(k for k in OmegaConf.missing_keys(cfg) if not k.startswith("hydra"))
    if missing:
        example = " ".join(f"{k}=..." for k in missing)
        raise ConfigError(
            f"{', '.join(missing)} must be set for this configuration: add {example} to the "
            f"command (e.g. dataset.root=/data/imagenet)."
        )


def fit(cfg: DictConfig) -> dict:
    check_required(cfg)
    ctx = dist.setup(cfg.trainer.device, cfg.trainer.dist_backend)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if ctx.is_main:
        check_writable(run_dir)
    torch.manual_seed(cfg.seed)
    if cfg.dataset.prepare is not None and ctx.is_local_main:
        instantiate(cfg.dataset.prepare)  # e.g. generate the synthetic set, once per node
    # A storage may need a once-per-node step too (stage to tmpfs, pack): its optional
    # `prepare` hook runs on the local main rank while the others wait at the barrier.
    storage_factory = instantiate(cfg.storage)
    storage_splits = [cfg.dataset.train_split, cfg.dataset.val_split]
    if ctx.is_local_main:
        call_hook(storage_factory, "prepare", root=cfg.dataset.root, splits=storage_splits)
    dist.barrier(ctx)

    channels_last = (
        ctx.device.type == "cuda"
        if cfg.trainer.channels_last == "auto"
        else bool(cfg.trainer.channels_last)
    )
    amp = amp_dtype(cfg.trainer.precision, ctx.device)
    train_loader, val_loader, backend, train_storage = build_loaders(
        cfg, ctx, channels_last, storage_factory
    )
    steps_per_epoch = len(train_loader)
    if cfg.trainer.max_steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, int(cfg.trainer.max_steps_per_epoch))

    model = instantiate(cfg.model).to(ctx.device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    global_batch = cfg.trainer.batch_size * ctx.world_size
    lr = cfg.optim.base_lr * global_batch / 256
    optimizer = build_optimizer(model, instantiate(cfg.optim), lr, ctx.device)
    total_steps = steps_per_epoch * cfg.trainer.epochs
    warmup = min(total_steps, int(cfg.optim.warmup_epochs * steps_per_epoch))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(total_steps, max(1, warmup), cfg.optim.min_lr_ratio)
    )
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=amp is torch.float16)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg.optim.label_smoothing)

    start_epoch, first_step, best_acc1, history = 0, 0, 0.0, []
    resume_path = resolve_resume(cfg, run_dir)
    if resume_path is not None:
        state = ckpt.load(resume_path)
        check_model_matches(state, cfg, resume_path)
        try:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(
                f"checkpoint {resume_path} does not fit this run: {exc}. Use resume=null."
            ) from None
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        start_epoch, first_step = state["epoch"], state["step_in_epoch"]
        best_acc1, history = state["best_acc1"], state["history"]
        ckpt.set_rng_state(state["rng"])
        log.info("resumed from %s at epoch %d step %d", resume_path, start_epoch, first_step)

    train_model = wrap_ddp(model, cfg, ctx)
    if cfg.trainer.compile:
        train_model = torch.compile(train_model)

    files = sink = None
    if ctx.is_main:
        files = MetricsFiles(run_dir)
        files.rewrite_epochs(history)  # a resumed run's directory carries the whole history
        sink = instantiate(cfg.logger) if cfg.logger else NullSink()
        sink.start(config=OmegaConf.to_container(cfg, resolve=True), run_dir=run_dir)

    def save(epoch, step):
        if not ctx.is_main:
            return None
        path = run_dir / "checkpoints" / ckpt.LAST
        ckpt.save_atomic(
            {
                "format": ckpt.FORMAT,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                "epoch": epoch,
                "step_in_epoch": step,
                "best_acc1": best_acc1,
                "history": history,
                "rng": ckpt.rng_state(),
                "model_config": {
                    "arch": cfg.model.get("arch"),
                    "num_classes": cfg.model.get("num_classes"),
                },
            },
            path,
        )
        return path

    sampler = ResourceSampler(gpu_index=ctx.device.index if ctx.device.type == "cuda" else None)
    sampler.start()
    timer = StepTimer(cuda_sync=ctx.device.type == "cuda")
    decoder = backend.info()
    try:
        with GracefulStop() as stopper:
            for epoch in range(start_epoch, cfg.trainer.epochs):
                if first_step == 0:
                    torch.manual_seed(cfg.seed * 100_003 + epoch * 1_009 + ctx.rank)
                train_loader.set_epoch(epoch, skip_batches=first_step)
                # Optional storage hook: reset read counters, evict the page cache (cold_cache).
                getattr(train_storage, "before_epoch", lambda: None)()
                sampler.reset()
                steps, timing, train_metrics = train_one_epoch(
                    train_model,
                    train_loader,
                    optimizer,
                    scheduler,
                    scaler,
                    criterion,
                    ctx,
                    epoch=epoch,
                    amp=amp,
                    timer=timer,
                    max_steps=steps_per_epoch,
                    first_step=first_step,
                    stopper=stopper,
                    progress=cfg.trainer.progress,
                )
                resources = sampler.snapshot()
                if stopper.signum is not None and steps < steps_per_epoch:
                    path = save(epoch, steps)
                    dist.barrier(ctx)
                    raise TrainingInterrupted(
                        f"stopped by {signal.Signals(stopper.signum).name} at epoch {epoch} step "
                        f"{steps}; checkpoint {path or run_dir / 'checkpoints' / ckpt.LAST}. Continue "
                        f"with the same command plus resume=auto (or resume=<that file>).",
                        stopper.signum,
                    )
                first_step = 0
                last = epoch + 1 == cfg.trainer.epochs
                row = {"epoch": epoch, **train_metrics, "lr": optimizer.param_groups[0]["lr"]}
                if last or (epoch + 1) % cfg.trainer.eval_every == 0:
                    row.update(evaluate(train_model, val_loader, criterion, ctx, amp))
                    best_acc1 = max(best_acc1, row["val_acc1"])
                row.update(reduce_timing(timing, resources, ctx))
                row.update(world_size=ctx.world_size, **decoder)
                row.update(storage_stats(train_storage, ctx))
                history.append(row)
                if ctx.is_main:
                    files.append_epoch(row)
                    sink.log(row, step=epoch)
                    log.info(
                        "epoch %d: %s",
                        epoch,
                        ", ".join(f"{k}={v:.4g}" for k, v in row.items() if isinstance(v, float)),
                    )
                if last or (epoch + 1) % cfg.trainer.checkpoint_every == 0:
                    save(epoch + 1, 0)
                if stopper.signum is not None and not last:
                    dist.barrier(ctx)
                    raise TrainingInterrupted(
                        f"stopped by {signal.Signals(stopper.signum).name} after epoch {epoch}; "
                        f"continue with the same command plus resume=auto.",
                        stopper.signum,
                    )
    finally:
        sampler.stop()
        if ctx.is_local_main:  # e.g. storage.cleanup=true removes a tmpfs staging
            call_hook(storage_factory, "finish", root=cfg.dataset.root, splits=storage_splits)
    summary = summarize(history, run_dir, best_acc1)
    if ctx.is_main:
        summary["wandb_sync"] = sink.finish()
        summary["wandb_dir"] = getattr(sink, "sync_dir", None)
        files.write_summary(summary)
        print(format_summary_table(summary), flush=True)
    dist.barrier(ctx)
    return summary


def summarize(history: list[dict], run_dir: Path, best_acc1: float) -> dict:
    def mean(key, rows):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    steady = history[1:] or history  # the first epoch carries start-up (workers, caches)
    return {
        "epochs": len(history),
        "epoch_time_s_mean": mean("epoch_time_s", history),
        "images_per_s": mean("images_per_s", steady),
        "data_wait_share": mean("data_wait_share", steady),
        "gpu_util_mean": mean("gpu_util_mean", steady),
        "peak_rss_mb": max((r["peak_rss_mb"] for r in history), default=None),
        "best_acc1": best_acc1,
        "final_val_acc1": history[-1].get("val_acc1") if history else None,
        "final_train_loss": history[-1].get("train_loss") if history else None,
        "decoder": history[-1].get("decoder") if history else None,
        "run_dir": str(run_dir),
    }


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
    if shutil.disk_usage(run_dir).free < 100 * 2**20:
        log.warning("less than 100 MB free under %s: checkpoints may not fit", run_dir)
