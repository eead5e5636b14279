"""python -m fastload.doctor pipeline: which stage of the data path starves the GPU, by how much,
and the change that would help most.

    python -m fastload.doctor pipeline                          # the default config
    python -m fastload.doctor pipeline backend=pil loader.num_workers=6 model=resnet50
    python -m fastload.doctor pipeline --step-ms 40 storage=slow_disk
    python -m fastload.doctor pipeline --local-ranks 8 model=resnet50  # an 8-GPU node: one rank

Each stage is timed alone, in this process, on a sample of the real dataset through the real
objects (fastload/pipeline.py builds them, as for training):

    storage read    reader.get(i, "image")                             ms per image, one core
    decode          the backend's decode, its share of the backend's own decode+crop path
    augment         the crop/resize/flip share of that path, plus the dataset's other
                    per-sample work (e.g. dataset.task.item_cost_ms)
    collate         the task's collate over batches of samples
    transfer+prep   device prep of a collated batch (copy, convert, normalise)
    model step      the configured model's training step on a device-resident batch (the
                    ceiling bench train measures), or --step-ms MS: a fixed step
    epoch boundary  the first batch of a new epoch beyond a steady batch interval, amortised
                    over a whole epoch of this dataset
    GPU decode      on a CUDA run with a CPU backend: backend=nvjpeg's device half (decode +
                    crop + resize of a batch of this dataset's JPEGs), offered as a change
                    when decoding bounds the workers, its time charged to the model's step

The worker stages (read, decode, augment, collate) run one after another inside each worker,
so each one alone would allow workers / its cost images/s, and together workers / their sum;
then the loader's host stage is measured with the configured workers (images/s for the
machine), and finally the loader and the step together (what training would see). The bound
is the slowest of: the workers (named after their costliest stage), transfer+prep, the model
step, the epoch boundary. Printed: a table, the verdict and the change that would help most
with its predicted effect; written: JSON and a PNG waterfall (default outputs/doctor/).
Predictions assume the stages overlap (workers, the copy and the step run concurrently), as
they do on a GPU machine; on a CPU-only machine the model step competes for the same cores.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import torch

log = logging.getLogger("fastload")

WORKER_STAGES = ("storage read", "decode", "augment", "collate")


@dataclass
class Setup:
    cfg: object
    ctx: object
    storage: object
    backend: object
    reader: object
    task: object
    channels_last: bool
    workers: int  # the loader's resolved num_workers
    cores: int  # usable cores of one rank (the node's divided by --local-ranks)

    def plan(self, cfg):
        """`cfg` (this setup's, with a few trainer settings changed) as a data plan over the
        storage, backend, task and reader built already."""
        from fastload.pipeline import build_plan

        plan = build_plan(cfg, storage=self.storage, backend=self.backend, task=self.task)
        plan.readers["train"] = self.reader
        return plan


@dataclass
class Report:
    stages: list = field(default_factory=list)  # rows: stage, ms_per_img, per_core, machine
    measured: dict = field(default_factory=dict)
    bound: dict = field(default_factory=dict)
    advice: list = field(default_factory=list)


def parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m fastload.doctor pipeline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--images", type=int, default=64, help="sample size for the per-stage timings")
    p.add_argument("--batches", type=int, default=12, help="batches per loader measurement")
    p.add_argument("--step-ms", type=float, default=None,
                   help="a fixed step of MS ms instead of the model's (e.g. a known GPU step)")  # fmt: skip
    p.add_argument("--model-steps", type=int, default=5, help="timed model steps")
    p.add_argument("--out", default="outputs/doctor", help="folder for pipeline.json / .png")
    p.add_argument("--local-ranks", type=int, default=None,
                   help="the run's ranks per node (default $LOCAL_WORLD_SIZE, else 1): the "
                        "doctor measures and advises one rank's share of the cores")  # fmt: skip
    p.add_argument("override", nargs="*", help="train.py overrides: backend=pil loader=bg ...")
    args = p.parse_intermixed_args(argv)  # overrides before and after options alike
    from fastload.dist import local_world_size_from_env

    if args.local_ranks is None:  # not `or`: --local-ranks 0 is refused, not the default
        args.local_ranks = local_world_size_from_env()
    if args.local_ranks < 1:
        p.error(f"--local-ranks {args.local_ranks}: use a whole number >= 1")
    for opt in ("images", "batches", "model_steps"):
        if getattr(args, opt) < 1:
            p.error(f"--{opt.replace('_', '-')} {getattr(args, opt)}: use a whole number >= 1")
    if args.step_ms is not None and not args.step_ms >= 0:  # nan is not >= 0 either
        p.error(f"--step-ms {args.step_ms}: use milliseconds >= 0")
    from fastload.bench.common import check_output

    check_output(p, "--out", args.out, folder=True)  # before the measurement, not after
    return args


def setup(args) -> Setup:
    """The config as train.py composes it, the storage prepared, the training split opened."""
    from fastload.bench.common import compose, one_device
    from fastload.host import usable_cores
    from fastload.pipeline import (
        SPLIT_KEYS,
        build_backend,
        build_layout,
        loader_options,
        prepare_data,
    )
    from fastload.tasks.base import build_task

    cfg = compose([*args.override, "logger=none", "trainer.progress=false"])
    ctx, channels_last = one_device(cfg)
    storage = prepare_data(cfg, ctx)
    backend = build_backend(cfg)
    reader = storage.open(build_layout(cfg), cfg.dataset[SPLIT_KEYS["train"]])
    # One rank's share of the node, as training resolves it: num_workers=auto and the cores
    # a rank's workers have are the node's divided by its ranks.
    ranks = getattr(args, "local_ranks", 1)
    workers = loader_options(cfg, ranks)["num_workers"]
    return Setup(cfg, ctx, storage, backend, reader, build_task(cfg), channels_last, workers,
                 max(1, usable_cores() // ranks))  # fmt: skip


def timed(fn, *a) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*a)
    return time.perf_counter() - t0, out


def sample_costs(s: Setup, n: int) -> dict:
    """Per-image milliseconds of each worker stage, on `n` images spread over the split."""
    from fastload.data.dataset import sample_rng

    dataset = s.task.dataset("train", s.reader, s.backend, None)
    idx = np.linspace(0, len(s.reader) - 1, min(n, len(s.reader))).astype(int).tolist()
    s.reader.before_epoch()  # cold_cache storages evict first: the read an epoch pays
    reads, datas = [], []
    for i in idx:
        dt, data = timed(s.reader.get, i, "image")
        reads.append(dt)
        datas.append(data)
    transform = getattr(dataset, "transform", None)
    fused, dec, aug = [], [], []
    for i, data in zip(idx, datas, strict=True):
        if transform is not None:
            fused.append(timed(s.backend.load, data, transform, sample_rng(0, 0, i))[0])
        dt, pixels = timed(s.backend.decode_rgb, data)
        dec.append(dt)
        if transform is not None:
            aug.append(timed(s.backend.load_pixels, pixels, transform, sample_rng(0, 0, i))[0])
        s.backend.pop_counts()
    getitem, samples = [], []
    for i in idx:
        dt, sample = timed(dataset.__getitem__, (0, i))
        getitem.append(dt)
        samples.append(sample)
    return costs_ms(s, reads, fused or dec, dec, aug, getitem, samples)


def costs_ms(s: Setup, reads, fused, dec, aug, getitem, samples) -> dict:
    """Split the backend's own decode+crop path between decode and augment in the proportion
    measured separately; what __getitem__ does beyond read + that path counts as augment."""
    from fastload.data.batch import collate as default_collate

    mean = statistics.fmean
    read, path = 1000 * mean(reads), 1000 * mean(fused)
    d, a = mean(dec), mean(aug) if aug else 0.0
    decode = path * d / (d + a) if d + a > 0 else path
    other = max(0.0, 1000 * mean(getitem) - read - path)
    bs = s.cfg.trainer.batch_size
    collate_fn = s.task.collate or default_collate
    chunks = [samples[i : i + bs] for i in range(0, len(samples), bs)]
    t = sum(timed(collate_fn, c)[0] for c in chunks)
    return {
        "storage read": read,
        "decode": decode,
        "augment": path - decode + other,
        "collate": 1000 * t / len(samples),
        "extra per-sample work (ms)": other,
        "decode alone, full size (ms)": 1000 * d,
    }


def loader_stages(s: Setup, batches: int) -> dict:
    """The loader's host stage with the configured workers (steady images/s over `batches`
    batches), the first batch of the next epoch beyond a steady batch interval, and one
    collated batch for the device stages."""
    from omegaconf import open_dict

    from fastload.measure import host_epoch
    from fastload.pipeline import build_loader

    cfg = s.cfg.copy()
    with open_dict(cfg):
        cfg.trainer.epochs, cfg.trainer.max_steps_per_epoch = 3, batches
    loader = build_loader(s.plan(cfg), "train", device=s.ctx.device,
                          channels_last=s.channels_last)  # fmt: skip
    try:
        first = host_epoch(loader, 0)
        loader.set_epoch(1)
        t0 = time.perf_counter()
        stream = loader.host_batches()
        batch = next(stream)
        latency = time.perf_counter() - t0
        for _ in stream:
            pass
    finally:
        loader.close()
    rate = first["steady_img_s"] or first["epoch_img_s"]
    interval = cfg.trainer.batch_size / rate
    return {
        "host_img_s": rate,
        "host_epoch_img_s": first["epoch_img_s"],
        "boundary_first_batch_s": latency,
        "boundary_extra_s": max(0.0, latency - interval),
        "batch": batch,
        "device_prep": loader.device_prep,
        "pin_memory": loader.pin_memory,
        "workers": loader.num_workers,
    }


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_stage(s: Setup, prep, batch, reps: int = 5) -> tuple[float, dict]:
    """Seconds per batch of device prep (copy, convert, normalise), and one device batch."""
    out = prep(batch)
    sync(s.ctx.device)
    t0 = time.perf_counter()
    for _ in range(reps):
        out = prep(batch)
    sync(s.ctx.device)
    return (time.perf_counter() - t0) / reps, out


def make_step(s: Setup, step_ms: float | None):
    """The configured model's step (a throwaway TrainState), or bench train's fixed step."""
    from fastload.engine import amp_dtype
    from fastload.measure import SleepStep
    from fastload.train_state import TrainState

    if step_ms is not None:
        return SleepStep(step_ms, s.ctx.device)
    amp = amp_dtype(s.cfg.trainer.precision, s.ctx.device, s.cfg.loader.input_dtype)
    state = TrainState.create(s.cfg, s.ctx.device, 1, 1000, amp=amp,
                              channels_last=s.channels_last)  # fmt: skip
    return s.task.step(state, s.cfg, s.ctx, amp)


def model_stage(s: Setup, step, batch, steps: int) -> float:
    """Seconds per training step on a resident batch: the median of `steps` steps after two
    warm-up steps (robust to a busy machine's outliers)."""
    from fastload.measure import step_times

    step.train_mode()
    times = step_times(step, batch, steps=steps, warmup=2, sync=lambda: sync(s.ctx.device))
    return statistics.median(times)


def together(s: Setup, step, batches: int, step_s: float, budget_s: float = 15.0) -> float:
    """Images/s of the loader feeding the step, as training runs them (after the first
    batch); fewer batches when the step is slow (a real model on a CPU)."""
    from omegaconf import open_dict

    from fastload.measure import feed
    from fastload.pipeline import build_loader

    batches = max(2, min(batches, int(budget_s / max(step_s, 1e-6))))
    cfg = s.cfg.copy()
    with open_dict(cfg):
        cfg.trainer.epochs, cfg.trainer.max_steps_per_epoch = 1, batches + 1
    loader = build_loader(s.plan(cfg), "train", device=s.ctx.device,
                          channels_last=s.channels_last)  # fmt: skip
    loader.set_epoch(0)
    try:
        got = feed(loader, step, warmup=1, sync=lambda: sync(s.ctx.device))
    finally:
        loader.close()
    return got.images_per_s if got.images else float("nan")


def stage_rows(s: Setup, costs: dict, loader: dict, prep_s: float, step_s: float) -> list:
    """Per stage: ms per image, images/s per core, images/s for the machine."""
    bs = s.cfg.trainer.batch_size
    usable = max(1, min(s.workers, s.cores))  # a worker beyond the cores adds nothing
    rows = []
    for name in WORKER_STAGES:
        ms = costs[name]
        rows.append(row(name, ms, 1000 / ms if ms else None, usable * 1000 / ms if ms else None))
    total = sum(costs[n] for n in WORKER_STAGES)
    rows.append(row("workers together (predicted)", total, 1000 / total, usable * 1000 / total))
    rows.append(row("workers together (measured)", None, None, loader["host_img_s"]))
    rows.append(row("transfer + device prep", 1000 * prep_s / bs, None, bs / prep_s))
    rows.append(row("model step", 1000 * step_s / bs, None, bs / step_s if step_s else None))
    epoch_images = epoch_length(s) * bs
    extra = loader["boundary_extra_s"]
    rows.append(row("epoch boundary (amortised)", 1000 * extra / max(1, epoch_images), None,
                    epoch_images / extra if extra > 1e-4 else None))  # fmt: skip
    return rows


def row(stage, ms, per_core, machine) -> dict:
    return {"stage": stage, "ms_per_img": ms, "img_s_per_core": per_core, "img_s_machine": machine}


def epoch_length(s: Setup) -> int:
    steps = len(s.reader) // s.cfg.trainer.batch_size
    cap = s.cfg.trainer.max_steps_per_epoch
    return max(1, min(steps, cap) if cap else steps)


def alternatives(s: Setup, n: int = 16) -> dict:
    """The backend's decode+crop path of the other importable CPU backends on the same images
    (ms per image), and the mean longer side of the source images."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from fastload.config import conf_dir
    from fastload.data.dataset import sample_rng

    dataset = s.task.dataset("train", s.reader, s.backend, None)
    transform = getattr(dataset, "transform", None)
    idx = np.linspace(0, len(s.reader) - 1, min(n, len(s.reader))).astype(int).tolist()
    datas = [s.reader.get(i, "image") for i in idx]
    sides = [max(s.backend.decode_rgb(d).shape[:2]) for d in datas]
    s.backend.pop_counts()
    out = {"mean_side": statistics.fmean(sides), "backends": {}}
    if transform is None:
        return out
    for name in ("turbo", "pil"):
        if name == getattr(s.backend, "name", None):
            continue
        try:
            backend = instantiate(OmegaConf.load(conf_dir() / "backend" / f"{name}.yaml"))
            for d in datas[:3]:  # warm-up: lazy imports, first-call set-up
                backend.load(d, transform, sample_rng(0, 0, 0))
        except Exception:  # not importable here: not a candidate
            continue
        t = sum(timed(backend.load, d, transform, sample_rng(0, 0, i))[0]
                for i, d in zip(idx, datas, strict=True))  # fmt: skip
        out["backends"][name] = 1000 * t / len(datas)
    return out


def device_decode_ms(s: Setup, device, n: int = 64, reps: int = 3) -> float | None:
    """backend=nvjpeg's device half on `device`, ms per image, on this dataset's JPEGs
    (fastload/decode/nvjpeg.py: device_ms_per_image)."""
    from fastload.decode.nvjpeg import device_ms_per_image

    return device_ms_per_image(s.reader, s.task, s.backend, device, n=n, reps=reps)


def verdict(s: Setup, rows: list, costs: dict, alt: dict, loader: dict) -> tuple[dict, list]:
    """The bound (stage, img/s, what it is against the model's appetite) and the advice,
    the change predicted to help most first."""
    by = {r["stage"]: r for r in rows}
    model = by["model step"]["img_s_machine"] or float("inf")
    cands = {
        "workers": loader["host_img_s"],
        "transfer + device prep": by["transfer + device prep"]["img_s_machine"],
        "model step": model,
        "epoch boundary": by["epoch boundary (amortised)"]["img_s_machine"] or float("inf"),
    }
    if s.workers == 0:  # the main thread loads, then steps: in series, not overlapped
        cands["workers"] = 1 / (1 / loader["host_img_s"] + 1 / model)
    order = sorted(cands, key=cands.get)
    where, rate = order[0], cands[order[0]]
    nxt = cands[order[1]]
    stage = where
    if where == "workers":
        stage = max(WORKER_STAGES, key=costs.get)
        stage = "storage" if stage == "storage read" else stage
    elif where == "model step":
        stage = "model"
    elif where == "epoch boundary":
        stage = "boundary"
    elif where.startswith("transfer"):
        stage = "transfer"
    bound = {"stage": stage, "img_s": rate, "model_img_s": model, "next_img_s": nxt,
             "vs_model": rate / model if model != float("inf") else None,
             "workers": s.workers, "cores": s.cores}  # fmt: skip
    bound["message"] = bound_message(bound, costs)
    return bound, advice(s, bound, costs, alt, loader, nxt)


def bound_message(b: dict, costs: dict) -> str:
    w = f"{b['workers']} worker{'s' if b['workers'] != 1 else ''}"
    eats = f"the model eats {b['model_img_s']:,.0f}" if b["model_img_s"] != float("inf") else ""
    if b["stage"] == "model":
        return (f"the model step bounds you at {b['img_s']:,.0f} img/s; the data path could "
                f"deliver {b['next_img_s']:,.0f}: nothing to fix in the data path")  # fmt: skip
    if b["stage"] in ("storage", "decode", "augment", "collate"):
        key = "storage read" if b["stage"] == "storage" else b["stage"]
        share = costs[key] / sum(costs[n] for n in WORKER_STAGES)
        return (f"{b['stage']} bounds you at {b['img_s']:,.0f} img/s with {w} ({share:.0%} of "
                f"each worker's time per image); {eats} ({b['vs_model']:.2f} of it)")  # fmt: skip
    return f"{b['stage']} bounds you at {b['img_s']:,.0f} img/s; {eats}"


def advice(s: Setup, b: dict, costs: dict, alt: dict, loader: dict, nxt: float) -> list:
    """[(change, predicted img/s, why)], best first. Predictions replace the bounding
    stage's cost and cap at the next bound; only changes predicted above the bound are
    offered, and where none is, one line says what was weighed (`nothing_faster`)."""
    usable = max(1, min(s.workers, s.cores))
    total = sum(costs[n] for n in WORKER_STAGES)
    host = loader["host_img_s"] / (usable * 1000 / total)  # measured / predicted workers

    def workers_at(ms_total, n=usable):
        return min(nxt, host * n * 1000 / ms_total)

    out, cfg, stage = [], s.cfg, b["stage"]
    idle = s.cores > usable
    if stage in ("storage", "decode", "augment", "collate") and idle:
        out.append((f"loader.num_workers={s.cores}", workers_at(total, s.cores),
                    f"{s.cores - usable} usable core(s) idle"))  # fmt: skip
    if stage == "storage":
        kind = str(cfg.storage._target_).rsplit(".", 1)[-1]
        fix = "storage=shards" if kind == "TmpfsStorage" else "storage=tmpfs"
        why = f"read costs {costs['storage read']:.1f} ms per image"
        out.append((fix, workers_at(total - costs["storage read"]), why + " (from RAM: ~0)"))
        out.append(("storage=shards", workers_at(total - costs["storage read"]),
                    "large sequential files instead of one open/read per image"))  # fmt: skip
    if stage in ("decode", "augment"):  # the backend's path does both
        path = costs["decode"] + costs["augment"] - costs["extra per-sample work (ms)"]
        for name, ms in alt["backends"].items():
            out.append((f"backend={name}", workers_at(total - path + ms),
                        f"its decode+crop measured {ms:.2f} ms vs {path:.2f}"))  # fmt: skip
    gpu_ms = alt.get("gpu_decode_ms")
    if stage in ("decode", "augment") and gpu_ms:
        # The workers only read headers then; the GPU decodes, taking its time from the model's
        # (predicted as if the decode did not overlap the step, as measured on an H100).
        model_ms = 1000 / b["model_img_s"] if b["model_img_s"] != float("inf") else 0.0
        batch = int(cfg.trainer.batch_size)
        out.append(("backend=nvjpeg loader=prefetch", min(nxt, 1000 / (model_ms + gpu_ms)),
                    f"GPU decode + crop measured {gpu_ms:.3f} ms per image here "
                    f"({gpu_ms * batch:.0f} ms per batch of {batch}), taken from the "
                    f"model's {model_ms * batch:.0f} ms step"))  # fmt: skip
    if stage == "decode":
        side = alt["mean_side"]
        if side > 256:
            scaled = total - costs["decode"] * (1 - (256 / side) ** 2)
            out.append(("storage=shards storage.max_side=256", workers_at(scaled),
                        f"decode scales with pixels: images are ~{side:.0f} px, roughly"))  # fmt: skip
    if stage == "augment":
        extra = costs["extra per-sample work (ms)"]
        item = cfg.dataset.get("task", {}).get("item_cost_ms") or 0
        if item:
            out.append(("dataset.task.item_cost_ms=0", workers_at(total - extra),
                        f"an injected {item} ms busy loop per image"))  # fmt: skip
        out.append(("storage=shards storage.kind=raw", workers_at(total - costs["decode"]),
                    "decoded pixels stored: no decode, crops from small images"))  # fmt: skip
    if stage == "collate" and not cfg.loader.get("reuse_batch_memory", True):
        out.append(("loader.reuse_batch_memory=true", nxt, "reused shared-memory batch slots"))
    if stage == "transfer":
        if not loader["pin_memory"] and s.ctx.device.type == "cuda":
            out.append(("loader.pin_memory=true", nxt, "asynchronous copies from pinned memory"))
        out.append(("loader=prefetch", nxt, "copy and convert on a side stream, overlapped"))
    if stage == "boundary":
        out.append(("loader.cross_epoch=true loader.persistent_workers=true", nxt,
                    f"the next epoch's first batch took {loader['boundary_first_batch_s']:.2f} s"))  # fmt: skip
    if stage == "model":
        return [("(nothing in the data path)", b["img_s"],
                 "the model's levers: trainer.compile=true, bf16, channels_last")]  # fmt: skip
    # A change predicted at or below the current bound would not help: left out.
    faster = [a for a in out if a[1] > b["img_s"]]
    return sorted(faster, key=lambda a: -a[1]) or [nothing_faster(s, b, costs, alt, out)]


def nothing_faster(s: Setup, b: dict, costs: dict, alt: dict, slower: list) -> tuple:
    """The advice when no change is predicted above the bound: the current backend is the
    fastest of those measured (decode or augment bound), or which changes were weighed."""
    if b["stage"] in ("decode", "augment") and alt["backends"]:
        path = costs["decode"] + costs["augment"] - costs["extra per-sample work (ms)"]
        others = ", ".join(f"backend={n} {ms:.2f} ms" for n, ms in alt["backends"].items())
        name = getattr(s.backend, "name", "the configured one")
        return (f"(keep backend={name})", b["img_s"], f"the fastest decode+crop of those "
                f"measured: {path:.2f} ms per image here vs {others}")  # fmt: skip
    weighed = ", ".join(a[0] for a in slower) or "no change"
    return ("(no change predicted faster)", b["img_s"],
            f"weighed: {weighed}; none is predicted above {b['img_s']:,.0f} img/s")  # fmt: skip


@contextlib.contextmanager
def one_core():
    """The per-core timings run as a worker does: one torch thread, no OpenCV thread pool
    (fastload/loaders/workers.py: worker_init)."""
    import sys

    threads = torch.get_num_threads()
    cv2 = sys.modules.get("cv2")
    cv2_threads = cv2.getNumThreads() if cv2 is not None else None
    torch.set_num_threads(1)
    if cv2 is not None:
        cv2.setNumThreads(0)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if cv2 is not None:
            cv2.setNumThreads(cv2_threads)


def run(args) -> tuple[Setup, Report]:
    s = setup(args)
    rep = Report()
    log.info("doctor: timing each worker stage on %d images", args.images)
    with one_core():
        costs = sample_costs(s, args.images)
        alt = alternatives(s)
    loader = loader_stages(s, args.batches)
    prep_s, device_batch = device_stage(s, loader["device_prep"], loader["batch"])
    step = make_step(s, args.step_ms)
    step_s = model_stage(s, step, device_batch, args.model_steps)
    if s.ctx.device.type == "cuda" and getattr(s.backend, "name", None) != "nvjpeg":
        alt["gpu_decode_ms"] = device_decode_ms(s, s.ctx.device)
    rep.stages = stage_rows(s, costs, loader, prep_s, step_s)
    rep.bound, rep.advice = verdict(s, rep.stages, costs, alt, loader)
    rep.measured = {
        "together_img_s": together(s, step, args.batches, step_s),
        "host_epoch_img_s": loader["host_epoch_img_s"],
        "boundary_first_batch_s": loader["boundary_first_batch_s"],
        "costs_ms": costs,
        "alternatives": alt,
        "workers": s.workers,
        "usable_cores": s.cores,
        "device": str(s.ctx.device),
        "decoder": s.backend.info().get("decoder"),
        "step": f"fixed {args.step_ms:g} ms" if args.step_ms is not None else "model",
    }
    return s, rep


def main(argv: list[str] | None = None) -> int:
    import json
    from pathlib import Path

    from fastload.bench.common import format_table, machine, os_reason
    from fastload.doctor.charts import waterfall
    from fastload.errors import OutputError

    args = parse(argv or [])
    threads = torch.get_num_threads()
    if args.step_ms is not None:
        torch.set_num_threads(1)  # as bench train: a GPU box's training thread does no math
    try:
        s, rep = run(args)
    finally:
        torch.set_num_threads(threads)
    m = rep.measured
    print(f"\ndoctor pipeline: batch {s.cfg.trainer.batch_size}, {s.workers} worker(s) on "
          f"{s.cores} usable core(s), device {m['device']}, {m['decoder']}, step {m['step']}, "
          f"{len(s.reader)} training images")  # fmt: skip
    print(format_table(rep.stages, list(rep.stages[0])))
    print(f"loader + step together (measured): {m['together_img_s']:,.0f} img/s")
    print(f"\nbound: {rep.bound['message']}")
    for i, (change, rate, why) in enumerate(rep.advice):
        head = "best change" if i == 0 else "then"
        print(f"{head}: {change}  -> about {rate:,.0f} img/s ({why})")
    out = Path(args.out)
    payload = {"suite": "doctor-pipeline", "machine": machine(), "overrides": args.override,
               "stages": rep.stages, "measured": m, "bound": rep.bound,
               "advice": [dict(zip(("change", "img_s", "why"), a, strict=True))
                          for a in rep.advice]}  # fmt: skip
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "pipeline.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
        waterfall(rep, out / "pipeline.png")
    except OSError as exc:
        raise OutputError(f"cannot write the results to {out}: {os_reason(exc)}") from None
    print(f"wrote {out / 'pipeline.json'} and {out / 'pipeline.png'}")
    return 0
