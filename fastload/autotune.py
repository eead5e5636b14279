"""loader=auto: pick num_workers, prefetch_factor, pin_memory and the backend at the start of a
run with a bounded probe on the real dataset and model, and cache the choice.

    python train.py loader=auto                        # probe (30 s of trials), or the cached choice
    python train.py loader=auto loader.auto.budget_s=10 loader.auto.backends=[]

A trial builds the real training loader (fastload/pipeline.py) with one candidate setting and
runs a warm-up batch plus `loader.auto.batches` batches through it; after each batch a stand-in
for the model's step waits the step's time with the GIL released (as a GPU step does), so a
trial's images/s is the end-to-end rate, not the loader's alone. The step's time is measured
once on a throwaway copy of the model (eager, not compiled, never DDP: the real model is not
touched), or given as `loader.auto.step_ms`. The search is coordinate-wise and stops at the
budget (`loader.auto.budget_s`: the trials' wall-clock time; measuring the model's step once
adds to it, and a trial begun within it finishes the batch it waits for): worker counts from usable cores / local ranks downwards (stopping once they fall well
behind), then prefetch factors at the best count, then pinning (CUDA), then the other
backends. Rates within 3 % of the best count as equal and the cheaper setting wins (fewer
workers, less prefetch, no pinning, the configured backend).

GPU decode (`loader.auto.gpu_decode`): on a CUDA run where the best trial so far still waits
for data (>= GPU_DECODE_WAIT of its time: the workers cannot keep up), one more trial runs
backend=nvjpeg with loader=prefetch's prep thread. Its decode and crop take GPU time from the
model, which the stand-in step (a sleep, the GPU idle) would hide: that time is measured on
the dataset's own JPEGs (fastload/decode/nvjpeg.py: device_ms_per_image, synchronised) and
added to the trial's step, so the GPU path wins only where it pays for itself. Chosen, it
brings loader=prefetch with it (the decode then runs beside the step, not between steps).

The choice is cached as JSON under $FASTLOAD_CACHE/autotune/ (default ~/.cache/fastload), keyed
by a hash of the host name, the affinity mask, the GPU, the local ranks, the dataset (root,
image count, the split folder's mtime) and the config minus the tuned keys: a changed batch
size, model, storage, ... probes again. Under DDP rank 0 probes while the others wait, and all
ranks use its choice; the probe then sees one rank's load, not the node's.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from fastload import dist
from fastload.errors import ConfigError
from fastload.host import hostname, usable_cores

log = logging.getLogger("fastload")

TUNED = ("num_workers", "prefetch_factor", "pin_memory")
CPU_BACKENDS = ("turbo", "pil")
TIE = 0.03  # rates within 3 % are equal: the cheaper setting wins
GPU_BACKEND = "nvjpeg"
# The best CPU trial waiting for data this share of its time or more: the workers cannot keep
# up, so loader.auto.gpu_decode=auto tries the GPU decode (a GPU step hides a few % of wait).
GPU_DECODE_WAIT = 0.10
PREP_THREAD_LOADER = "fastload.loaders.cuda_prefetch.CudaPrefetchLoader"


def cache_dir() -> Path:
    return Path(os.environ.get("FASTLOAD_CACHE", os.path.expanduser("~/.cache/fastload")))


def settings(cfg: DictConfig) -> dict:
    """loader.auto, checked: a bad value names the option and what it takes."""
    auto = OmegaConf.to_container(cfg.loader.auto, resolve=True)
    budget = auto.get("budget_s")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
        raise ConfigError(f"loader.auto.budget_s={budget!r}: use seconds > 0 (default 30).")
    batches = auto.get("batches")
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 2:
        raise ConfigError(f"loader.auto.batches={batches!r}: use a whole number >= 2.")
    workers = auto.get("workers")
    if workers != "auto" and not (
        isinstance(workers, list)
        and workers
        and all(isinstance(w, int) and w >= 0 for w in workers)
    ):
        raise ConfigError(
            f"loader.auto.workers={workers!r}: use auto or a list of worker counts >= 0, "
            f"e.g. loader.auto.workers=[4,8,12]."
        )
    factors = auto.get("prefetch_factors") or [2]
    if not all(isinstance(f, int) and f >= 1 for f in factors):
        raise ConfigError(f"loader.auto.prefetch_factors={factors!r}: use whole numbers >= 1.")
    step = auto.get("step_ms")
    if step is not None and (not isinstance(step, (int, float)) or step < 0):
        raise ConfigError(f"loader.auto.step_ms={step!r}: use null (measure) or ms >= 0.")
    backends = auto.get("backends")
    if backends != "available" and not isinstance(backends, list):
        raise ConfigError(
            f"loader.auto.backends={backends!r}: use available, [] (keep backend=) or a list "
            f"of conf/backend names, e.g. [turbo,pil]."
        )
    pins = auto.get("pin_memory")
    if not (isinstance(pins, list) and all(isinstance(v, bool) for v in pins)):
        raise ConfigError(
            f"loader.auto.pin_memory={pins!r}: use a list of true / false, the settings tried "
            f"on CUDA (e.g. [true,false]; [] keeps loader.pin_memory)."
        )
    gpu = auto.setdefault("gpu_decode", "auto")
    if not (gpu == "auto" or isinstance(gpu, bool)):
        raise ConfigError(
            f"loader.auto.gpu_decode={gpu!r}: use auto (try backend=nvjpeg on CUDA when the "
            f"workers cannot keep up), true (always on CUDA) or false."
        )
    return {**auto, "prefetch_factors": factors}


def worker_candidates(auto: dict, local_ranks: int, cores: int | None = None) -> list[int]:
    """Most first: usable cores / local ranks, halved down to 1, then 0 (or the given list)."""
    if auto["workers"] != "auto":
        return sorted(set(auto["workers"]), reverse=True)
    top = max(1, (cores if cores is not None else usable_cores()) // max(1, local_ranks))
    out, n = [top], top // 2
    while n >= 1:
        out.append(n)
        n //= 2
    return sorted(set(out), reverse=True) + [0]


def backend_names(cfg: DictConfig, auto: dict, current: str) -> list[str]:
    if auto["backends"] == "available":
        return [current] + [b for b in CPU_BACKENDS if b != current]
    return [current] + [b for b in auto["backends"] if b != current]


# -- the cache ---------------------------------------------------------------------------------


def cache_key(cfg: DictConfig, ctx, reader) -> tuple[str, dict]:
    """(hash, what it hashes): the machine, the dataset, the config minus the tuned keys."""
    import torch

    loader = OmegaConf.to_container(cfg.loader, resolve=True)
    for k in TUNED:
        loader.pop(k, None)
    loader["auto"] = {k: v for k, v in loader["auto"].items() if k not in ("budget_s", "cache")}
    trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
    trainer = {
        k: trainer[k] for k in ("batch_size", "precision", "channels_last", "compile", "device")
    }
    root = str(reader.store_root())
    try:
        mtime = os.stat(root).st_mtime_ns
    except OSError:
        mtime = None
    fields = {
        "host": hostname(),
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "gpu": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else None,
        "local_ranks": ctx.local_world_size,
        "dataset": {"root": root, "images": len(reader), "mtime_ns": mtime},
        "config": {
            "dataset": OmegaConf.to_container(cfg.dataset, resolve=True),
            "storage": OmegaConf.to_container(cfg.storage, resolve=True),
            "backend": OmegaConf.to_container(cfg.backend, resolve=True),
            "model": OmegaConf.to_container(cfg.model, resolve=True),
            "loader": loader,
            "trainer": trainer,
        },
    }
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20], fields


# -- the probe ---------------------------------------------------------------------------------


@dataclass
class Trial:
    num_workers: int
    prefetch_factor: int
    pin_memory: bool
    backend: str
    img_s: float = 0.0
    data_wait: float = 0.0  # share of the trial's time spent waiting for batches
    batches: int = 0
    gpu_ms: float = 0.0  # GPU decode time per batch added to the step (a device decoder)

    def setting(self) -> dict:
        return {k: getattr(self, k) for k in (*TUNED, "backend")}

    def text(self) -> str:
        charged = f" ({self.gpu_ms:.1f} ms of GPU decode per batch charged to the step)"
        return (
            f"num_workers={self.num_workers} prefetch_factor={self.prefetch_factor} "
            f"pin_memory={str(self.pin_memory).lower()} backend={self.backend}"
            + (charged if self.gpu_ms else "")
        )

    def cost(self, configured: str) -> tuple:
        """What a setting costs (cores, memory, a change of decoder): the tie-break."""
        return (self.num_workers, self.prefetch_factor, self.pin_memory, self.backend != configured)


@dataclass
class Probe:
    cfg: DictConfig
    plan: object  # the run's data plan (fastload/pipeline.py); trials change its loader
    ctx: object
    model: object
    channels_last: bool
    amp: object
    auto: dict
    deadline: float  # the trials' end (loader.auto.budget_s; the step's measurement adds to it)
    step_s: float | None = None
    measure_s: float = 0.0  # seconds measuring the model's step (outside the budget)
    trials: list = field(default_factory=list)
    backends: dict = field(default_factory=dict)  # name -> built backend
    gpu_ms: dict = field(default_factory=dict)  # backend name -> its device time per batch

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()

    def trial_plan(self, t: Trial, backend):
        """The run's plan with the trial's loader options and backend, one short epoch."""
        plan = self.plan.with_loader(
            num_workers=t.num_workers, prefetch_factor=t.prefetch_factor, pin_memory=t.pin_memory
        )
        plan = with_prep_thread(plan, backend)
        return plan.replace(backend=backend, epochs=1, max_steps_per_epoch=self.auto["batches"] + 1)

    def device_time(self, name: str, backend) -> float | None:
        """ms of GPU time per batch a device-decoding backend takes from the model (measured
        once), 0 for a host backend, None when it cannot be timed here."""
        if getattr(backend, "device_decoder", None) is None:
            return 0.0
        if name not in self.gpu_ms:
            from fastload.decode.nvjpeg import device_ms_per_image

            ms = device_ms_per_image(self.plan.reader("train"), self.plan.task, backend,
                                     self.ctx.device)  # fmt: skip
            self.gpu_ms[name] = None if ms is None else ms * self.plan.batch_size
        return self.gpu_ms[name]

    @property
    def current_backend(self) -> str:
        return getattr(self.plan.backend, "name", "configured")

    def backend_for(self, name: str):
        if name == self.current_backend:
            return self.plan.backend
        if name not in self.backends:
            from hydra.utils import instantiate

            self.backends[name] = instantiate(backend_config(name))
        return self.backends[name]

    def run(self, t: Trial) -> Trial | None:
        """One trial; None when it could not start (a backend that is not installed) or
        the budget ran out before two timed batches."""
        from fastload.pipeline import build_loader

        try:
            backend = self.backend_for(t.backend)
            gpu_ms = self.device_time(t.backend, backend)
            if gpu_ms is None:
                raise ConfigError("its GPU decode could not be timed on this dataset")
            t.gpu_ms = gpu_ms
            plan = self.trial_plan(t, backend)
            loader = build_loader(
                plan, "train", device=self.ctx.device, channels_last=self.channels_last,
                rank=self.ctx.rank, world_size=self.ctx.world_size,
            )  # fmt: skip
        except Exception as exc:  # e.g. a backend whose decoder is not installed here
            log.info("loader=auto: skipping %s (%s)", t.text(), exc)
            return None
        try:
            timed(self, loader, t)
        finally:
            loader.close()
        if t.batches < 2:
            return None
        self.trials.append(t)
        log.info(
            "loader=auto trial %d: %s: %.0f img/s end to end (data wait %.0f %%)",
            len(self.trials), t.text(), t.img_s, 100 * t.data_wait,
        )  # fmt: skip
        return t


def timed(probe: Probe, loader, t: Trial) -> None:
    """Fill in the trial's rate: a warm-up batch (worker start-up; the model's step is
    measured on the first trial's, which then starts again), then batches each followed by the step's stand-in
    (fastload/measure.py), until the batches or the budget run out."""
    from fastload.measure import SleepStep, feed

    loader.set_epoch(0)
    it = iter(loader)
    batch = next(it, None)
    if batch is None:
        return
    if probe.step_s is None:
        m0 = time.perf_counter()
        probe.step_s = measure_step(probe, batch)
        # the budget is the trials': the one-off measurement moves the deadline on
        probe.measure_s = time.perf_counter() - m0
        probe.deadline += probe.measure_s
        # this trial's workers built batches meanwhile, a head start no other trial has (its
        # rate came out ~40 % high): it starts again, its new workers warmed up the same way
        it.close()
        loader.set_epoch(0)
        it = iter(loader)
        if next(it, None) is None:
            return
    # A device decoder's GPU time comes out of the model's: the stand-in step (the GPU idle)
    # would hide it, so it is added to the step.
    got = feed(it, SleepStep(1000 * probe.step_s + t.gpu_ms), max_batches=probe.auto["batches"],
               budget_s=probe.remaining(), loader=loader)  # fmt: skip
    t.batches, t.img_s, t.data_wait = got.batches, got.images_per_s, got.data_wait_share


def measure_step(probe: Probe, batch) -> float:
    """Seconds of one training step on a throwaway copy of the model (eager, no DDP)."""
    if probe.auto.get("step_ms") is not None:
        return probe.auto["step_ms"] / 1000
    import torch

    from fastload.dist import DistContext
    from fastload.measure import step_times
    from fastload.train_state import TrainState

    cfg = probe.cfg.copy()
    with open_dict(cfg):
        cfg.trainer.compile = False
    state = TrainState.create(cfg, probe.ctx.device, 1, 1000, amp=probe.amp,
                              channels_last=probe.channels_last,
                              model=copy.deepcopy(probe.model))  # fmt: skip
    step = probe.plan.task.step(state, cfg, DistContext(device=probe.ctx.device), probe.amp)
    step.train_mode()
    sync = torch.cuda.synchronize if probe.ctx.device.type == "cuda" else (lambda: None)
    seconds = statistics.fmean(step_times(step, batch, steps=3, warmup=1, sync=sync))
    log.info("loader=auto: the model's step takes %.1f ms (eager, measured once)", 1000 * seconds)
    return seconds


def backend_config(name: str) -> DictConfig:
    from fastload.config import conf_dir

    path = conf_dir() / "backend" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"loader.auto.backends: no conf/backend/{name}.yaml")
    return OmegaConf.load(path)


def best(trials: list[Trial]) -> Trial:
    """The fastest trial; among those within TIE of it the cheapest (the first trial's
    backend is the configured one)."""
    top = max(t.img_s for t in trials)
    equal = [t for t in trials if t.img_s >= top * (1 - TIE)]
    return min(equal, key=lambda t: t.cost(trials[0].backend))


def search(p: Probe) -> Trial | None:
    """Workers, then prefetch, then pinning (CUDA), then backends: each at the best so far."""
    cfg, auto = p.cfg, p.auto
    pin0 = (
        p.ctx.device.type == "cuda"
        if cfg.loader.pin_memory == "auto"
        else bool(cfg.loader.pin_memory)
    )
    base = Trial(0, auto["prefetch_factors"][0], pin0, p.current_backend)
    for n in worker_candidates(auto, p.ctx.local_world_size):
        if p.remaining() <= 0:
            break
        done = p.run(Trial(n, base.prefetch_factor, pin0, base.backend))
        behind = done and len(p.trials) > 1 and done.img_s < 0.75 * best(p.trials).img_s
        if behind and auto["workers"] == "auto":
            break  # fewer workers only get slower from here (a given list is tried in full)
    if not p.trials:
        return None
    chosen = best(p.trials)
    rounds = (
        [("prefetch_factor", f) for f in auto["prefetch_factors"]] if chosen.num_workers else []
    )
    if p.ctx.device.type == "cuda":
        rounds += [("pin_memory", v) for v in auto["pin_memory"]]
    current = p.current_backend
    rounds += [("backend", b) for b in backend_names(cfg, auto, current)]
    for key, value in rounds:
        chosen = best(p.trials)
        if getattr(chosen, key) == value or p.remaining() <= 0:
            continue
        p.run(Trial(**{**chosen.setting(), key: value}))
    if wants_gpu_decode(p) and p.remaining() > 0:
        chosen = best(p.trials)
        log.info(
            "loader=auto: the best trial still waits for data %.0f %% of its time: trying "
            "backend=%s (GPU decode, its GPU time charged to the step)",
            100 * chosen.data_wait, GPU_BACKEND,
        )  # fmt: skip
        p.run(Trial(**{**chosen.setting(), "backend": GPU_BACKEND}))
    return best(p.trials)


def wants_gpu_decode(p: Probe) -> bool:
    """loader.auto.gpu_decode on this run: auto tries the GPU decode on CUDA when the best
    trial so far waits for data >= GPU_DECODE_WAIT of its time; true always on CUDA."""
    mode = p.auto.get("gpu_decode", "auto")
    if mode is False or p.ctx.device.type != "cuda" or p.plan.normalize_on != "device":
        return False
    if mode == "auto" and p.auto.get("backends") == []:
        return False  # backends=[] keeps backend= as configured; gpu_decode=true still tries
    if any(t.backend == GPU_BACKEND for t in p.trials):
        return False  # configured, or already tried
    return mode is True or best(p.trials).data_wait >= GPU_DECODE_WAIT


def with_prep_thread(plan, backend):
    """A device-decoding backend runs with loader=prefetch's prep thread (its decode call
    waits for the GPU's queued work: between steps it would stall every step's launches);
    the plan as it is otherwise."""
    from hydra.utils import get_class

    if getattr(backend, "device_decoder", None) is None:
        return plan
    if get_class(plan.loader["_target_"]).normalizes_on_device:
        return plan
    return plan.with_loader(_target_=PREP_THREAD_LOADER)


# -- the entry point: fit calls it before building the data path --------------------------------


def tune(plan, cfg: DictConfig, ctx, model, *, channels_last: bool, amp,
         resumed_backend: str | None = None):  # fmt: skip
    """The run's data plan (fastload/pipeline.py): as it is unless loader=auto, else with the
    tuned loader options and backend (the cached ones when this machine, dataset and config
    were probed before). The config is not changed: the run records the plan's options.
    `resumed_backend`: the backend the checkpoint this run resumes was trained with, kept
    whatever the probe prefers here (another node may prefer another), since decoders differ
    in their pixels and a run continues on the same ones."""
    if "auto" not in cfg.loader:
        return plan
    auto = settings(cfg)

    def probe() -> dict | None:
        import torch

        cuda = [ctx.device] if ctx.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):  # a probe leaves the run's RNGs as they were
            return choose(plan, cfg, ctx, model, auto, channels_last, amp)

    # rank 0 probes; an error there stops every rank instead of leaving them in the broadcast.
    # The others wait without the process group's deadline: loader.auto.budget_s may be set
    # past its 30 minutes.
    choice = dist.agreed(ctx, "probing loader=auto", probe if ctx.is_main else None,
                         waiting="waiting for rank 0's loader=auto probe")  # fmt: skip
    choice = dist.broadcast_object(choice, ctx)
    if resumed_backend is not None:
        chosen = (choice or {}).get("backend", getattr(plan.backend, "name", None))
        if chosen != resumed_backend:
            if ctx.is_main:
                log.warning(
                    "loader=auto: backend=%s would be faster here, but the checkpoint this run "
                    "resumes was trained with backend=%s (decoders differ in their pixels): "
                    "keeping it", chosen, resumed_backend,
                )  # fmt: skip
            keep = {k: plan.loader[k] for k in TUNED} if choice is None else choice
            choice = {**keep, "backend": resumed_backend}
    return apply(plan, cfg, choice)


def choose(plan, cfg, ctx, model, auto, channels_last, amp) -> dict | None:
    reader = plan.reader("train")
    key, fields = cache_key(cfg, ctx, reader)
    path = cache_dir() / "autotune" / f"{key}.json"
    if auto["cache"] and path.is_file():
        try:
            saved = json.loads(path.read_text())
            log.info(
                "loader=auto: cache hit %s (probed %s): %s; delete the file or set "
                "loader.auto.cache=false to probe again",
                path, saved["date"], Trial(**saved["choice"]).text(),
            )  # fmt: skip
            return saved["choice"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("loader=auto: ignoring the unreadable cache %s (%s)", path, exc)
    t0 = time.perf_counter()
    probe = Probe(cfg, plan, ctx, model, channels_last, amp, auto,
                  deadline=t0 + auto["budget_s"])  # fmt: skip
    log.info("loader=auto: probing: trials for up to %g s (loader.auto.budget_s), plus the "
             "one-off measurement of the model's step", auto["budget_s"])  # fmt: skip
    chosen = search(probe)
    if chosen is None:
        log.warning("loader=auto: no trial finished within %g s of trials (the probe took %.1f s, "
                    "%.1f s of it measuring the model's step): using loader.num_workers=auto "
                    "(raise loader.auto.budget_s)", auto["budget_s"],
                    time.perf_counter() - t0, probe.measure_s)  # fmt: skip
        return None
    first = probe.trials[0]
    log.info(
        "loader=auto: chose %s: %.0f img/s end to end (the first trial: %.0f), %d trials in "
        "%.1f s (%.1f s of it measuring the model's step); cached in %s",
        chosen.text(), chosen.img_s, first.img_s, len(probe.trials),
        time.perf_counter() - t0, probe.measure_s, path,
    )  # fmt: skip
    write_cache(path, fields, chosen, probe)
    return chosen.setting()


def write_cache(path: Path, fields: dict, chosen: Trial, probe: Probe) -> None:
    payload = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "choice": chosen.setting(),
        "step_ms": 1000 * (probe.step_s or 0.0),
        "trials": [
            {**t.setting(), "img_s": t.img_s, "data_wait": t.data_wait, "gpu_ms": t.gpu_ms}
            for t in probe.trials
        ],
        "key": fields,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        os.replace(tmp, path)  # a reader sees the old file or the whole new one
    except OSError as exc:
        log.warning(
            "loader=auto: cannot write the cache %s (%s): the next run probes again", path, exc
        )


def apply(plan, cfg: DictConfig, choice: dict | None):
    """The plan with the chosen loader options (and backend, when another won)."""
    if choice is None:
        return plan
    plan = plan.with_loader(**{k: choice[k] for k in TUNED})
    swapped = choice["backend"] != getattr(plan.backend, "name", None)
    if swapped:
        from hydra.utils import instantiate

        plan = plan.replace(backend=instantiate(backend_config(choice["backend"])))
    # A device decoder, chosen or configured and kept, runs as its trial ran: in the prep thread.
    threaded = with_prep_thread(plan, plan.backend)
    if swapped:  # a combination that cannot work is refused here too
        from fastload.pipeline import normalize_on

        normalize_on(cfg, threaded.backend, loader_target=threaded.loader["_target_"])
    if threaded is not plan:
        log.info("loader=auto: backend=%s runs with loader=prefetch (its decode in a prep "
                 "thread, beside the step)", choice["backend"])  # fmt: skip
    return threaded
