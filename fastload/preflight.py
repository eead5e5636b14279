"""The pre-flight check: what this machine and this config will hit, each with its exact fix.

    python -m fastload.doctor env [train.py overrides]

Every run does it too (fastload/engine.py `fit`, before any data work; `doctor.preflight=false`
turns it off): a fatal result stops the run with the failures and their fixes (exit 2), a
warning is logged and the run goes on. Nothing that merely might be slow is fatal.

The checks read the machine once into `Facts` (/dev/shm, the open-file limit, the cores in
the affinity mask, CPU flags, RAM, the dataset's file system, GPU / driver / NVML, which
decoders import) and judge the config against them; tests pass their own `Facts` (a 64 MiB
/dev/shm, a low ulimit, a CPU without AVX2) instead of needing root or a container. Nothing is
read from the dataset. The decoder modules the backend uses (its decoder module, PIL, and
those its `needs` judge: DecodeBackend.also_imports) are imported for real, once per process
(an installed module whose import fails, such as an OpenCV without its libGL, is not
importable; the run imports them anyway); the others are only looked up, so a backend=pil run
or `doctor env` does not pay seconds for torchvision's or OpenCV's import. After that the
whole check takes well under 0.5 s.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import os
import platform
import resource
import sys
import time
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from fastload.errors import ConfigError
from fastload.host import (
    MB,
    SHM,
    auto_num_workers,
    fs_type,
    gpus_suffice,
    shm_bytes,
    total_ram,
    usable_cores,
)
from fastload.storage.base import DATASET_FS

log = logging.getLogger("fastload")

OK, WARN, FATAL = "ok", "warn", "fatal"
NOFILE_FLOOR = 1024  # below this, torch's file_descriptor sharing runs out with a few workers
PIN_RAM_SHARE = 0.5  # pinned memory above half the RAM starves the page cache and the workers

DECODER_MODULES = ("simplejpeg", "PIL", "accimage", "cv2", "torchvision")
MISSING = "not installed"  # Facts.decoders' word for a module that is not there
# ... and for one that is there but was not imported: the backend does not use it
NOT_IMPORTED = "installed, not imported"


@dataclass(frozen=True)
class Check:
    """One line of the report: `fix` is what to do when status is warn or fatal."""

    name: str
    status: str  # ok | warn | fatal
    message: str
    fix: str = ""

    def line(self) -> str:
        text = f"[{self.status.upper():5}] {self.name}: {self.message}"
        return text + (f"\n        fix: {self.fix}" if self.fix and self.status != OK else "")


@dataclass
class Facts:
    """What the checks know about the machine; `gather()` reads it, tests replace fields."""

    shm: tuple[int, int] | None  # (total, free) bytes of /dev/shm; None: no /dev/shm
    nofile: tuple[int, int]  # RLIMIT_NOFILE (soft, hard); RLIM_INFINITY as a large number
    usable_cores: int  # in this process's affinity mask (cpuset, taskset)
    cpu_count: int  # the machine's
    cpu_flags: frozenset[str] | None  # /proc/cpuinfo flags; None: unknown
    arch: str  # platform.machine()
    ram_total: int
    dataset_fs: str  # file system type of dataset.root; "" when the root is not there yet
    gpus: list[str] = field(default_factory=list)  # CUDA device names
    nvml: str | None = None  # "driver <version>", or None
    nvml_error: str = ""
    # module -> "" when it imports, else why not ("not installed", or the import's error),
    # or NOT_IMPORTED: installed, and not imported as this run's backend does not use it
    decoders: dict = field(default_factory=dict)
    pillow: str = "pillow"  # pillow | pillow-simd (the loaded PIL)
    # backend=turbo's region decoders (fastload/decode/roi.py KINDS): kind -> "" when it loads,
    # else why not; None: unknown
    roi_decode: dict | None = None


def cpu_flags() -> frozenset[str] | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


@functools.cache
def nvml_driver() -> tuple[str | None, str]:
    """("driver <version>", "") when NVML answers, else (None, why); asked once per process
    (an NVML start and shutdown each time otherwise)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # no package, no libnvidia-ml, no driver
        return None, f"{type(exc).__name__}: {exc}"
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        version = version.decode() if isinstance(version, bytes) else version
        return f"driver {version}", ""
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def import_errors(modules) -> dict[str, str]:
    """Each module: "" when `import` of it succeeds here, else why not: "not installed", or
    the import's error as it reads (an installed OpenCV whose libGL is missing raises
    ImportError: libGL.so.1: cannot open shared object file)."""
    out = {}
    for name in modules:
        try:
            if importlib.util.find_spec(name) is None:
                out[name] = MISSING
                continue
            importlib.import_module(name)
            out[name] = ""
        except Exception as exc:  # ImportError, and what a broken binary module raises
            out[name] = f"{type(exc).__name__}: {exc}".strip()
    return out


@functools.cache
def decoder_imports(modules: tuple[str, ...] = DECODER_MODULES) -> dict[str, str]:
    """`import_errors` of `modules` (the decoder modules a backend uses), once per process;
    each other decoder module MISSING or NOT_IMPORTED, as `find_spec` finds it (or "" when
    something here imported it already)."""
    found = import_errors(modules)
    for name in DECODER_MODULES:
        if name not in found:
            if name in sys.modules:
                found[name] = ""
            else:
                found[name] = NOT_IMPORTED if importlib.util.find_spec(name) else MISSING
    return {name: found[name] for name in DECODER_MODULES}


def used_decoders(cfg: DictConfig | None) -> tuple[str, ...]:
    """The decoder modules the config's backend uses: PIL (every backend's fallback), its
    decoder module and its `also_imports`; every one for a backend that does not import here
    (or without a config)."""
    backend = backend_class(cfg) if cfg is not None and "backend" in cfg else None
    if backend is None:
        return DECODER_MODULES
    used = {"PIL", getattr(backend, "decoder_module", ""), *getattr(backend, "also_imports", ())}
    return tuple(m for m in DECODER_MODULES if m in used)


def gather(cfg: DictConfig | None = None) -> Facts:
    """The machine as this process sees it (the backend's decoders imported once per
    process)."""
    import torch

    from fastload.decode.pil import pillow_flavour

    root = str(cfg.dataset.root) if cfg is not None and "root" in cfg.dataset else ""
    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    nvml, why = nvml_driver() if gpus or os.path.exists("/dev/nvidiactl") else (None, "")
    return Facts(
        shm=shm_bytes(),
        nofile=resource.getrlimit(resource.RLIMIT_NOFILE),
        usable_cores=usable_cores(),
        cpu_count=os.cpu_count() or 1,
        cpu_flags=cpu_flags(),
        arch=platform.machine(),
        ram_total=total_ram(),
        dataset_fs=fs_type(root) if root and os.path.exists(root) else "",
        gpus=gpus,
        nvml=nvml,
        nvml_error=why,
        decoders=decoder_imports(used_decoders(cfg)),
        pillow=pillow_flavour(),
        roi_decode=roi_decode_status(),
    )


def roi_decode_status() -> dict[str, str]:
    """Each region decoder: "" when it loads (backend=turbo decodes crop regions with it),
    else why not, with the fix."""
    from fastload.decode import roi_decoders

    return roi_decoders.status()


# -- what the config asks for ------------------------------------------------------------------


@dataclass
class Ask:
    """The parts of the config the checks judge, resolved against the machine's facts."""

    workers: int  # per rank (for loader=auto: the most the tuner may pick)
    prefetch: int
    batch_bytes: int | None  # one collated training batch; None: unknown (not a fixed crop)
    ranks: int  # local ranks on this node
    pin: bool
    pin_cap_mb: float | None
    backend: str
    decoder_module: str
    on_cuda: bool
    auto: bool  # loader=auto


def ask(cfg: DictConfig, facts: Facts, ranks: int) -> Ask:
    loader, ranks = cfg.loader, max(1, int(ranks))
    auto = "auto" in loader
    workers = loader.num_workers
    if workers == "auto" or auto:
        workers = auto_num_workers(facts.usable_cores, ranks)
    workers = int(workers) if str(workers).lstrip("-").isdigit() else 0
    prefetch = int(loader.prefetch_factor or 2) if workers > 0 else 0
    if auto:
        prefetch = max([prefetch, *loader.auto.get("prefetch_factors", [])])
    size = cfg.dataset.get("train_transform", {}).get("size")
    per_pixel = 4 if loader.get("normalize_on") == "cpu" else 1
    batch = cfg.trainer.batch_size * 3 * size * size * per_pixel if isinstance(size, int) else None
    device = cfg.trainer.device
    on_cuda = device == "cuda" or (device == "auto" and bool(facts.gpus))
    pin = on_cuda if loader.pin_memory == "auto" else bool(loader.pin_memory)
    cap = loader.get("pin_memory_max_mb")
    if cap == "auto":
        cap = facts.ram_total * 0.25 / ranks / MB
    backend = backend_class(cfg)
    name = getattr(backend, "name", "custom") if backend is not None else "custom"
    module = getattr(backend, "decoder_module", "") if backend is not None else ""
    return Ask(workers, prefetch, batch, ranks, pin, cap, name, module, on_cuda, auto)


def backend_class(cfg: DictConfig):
    """The backend's class, which states what it needs (fastload/decode/base.py:
    `DecodeBackend.needs`); importing it imports no decoder. None when it does not import."""
    from hydra.utils import get_class

    try:
        return get_class(cfg.backend._target_)
    except Exception:  # a custom backend whose module is not importable here
        return None


def backend_needs(cfg: DictConfig, facts: Facts, a: Ask, check: str) -> list:
    """The lines the backend adds under `check` (its `needs`), worst first."""
    backend = backend_class(cfg)
    if backend is None or not hasattr(backend, "needs"):
        return []
    options = OmegaConf.to_container(cfg.backend, resolve=True)
    needs = [n for n in backend.needs(options, facts, a.on_cuda) if n.check == check]
    return sorted(needs, key=lambda n: n.status != FATAL)


# -- the checks ---------------------------------------------------------------------------------

SHM_GROW = (
    "Docker: docker run --shm-size={size} (or --ipc=host to share the host's /dev/shm); "
    "Kubernetes: mount an emptyDir with medium: Memory (sizeLimit: {size}) at /dev/shm"
)
SHM_FIX = SHM_GROW + "; or lower loader.num_workers, loader.prefetch_factor or trainer.batch_size."
# when the staged copy is what does not fit: fewer workers or smaller batches cannot help
SHM_STAGE_FIX = (
    SHM_GROW + "; or stage elsewhere: storage.target_dir=<a larger tmpfs>, or read the dataset "
    "where it is: storage=disk (or a pack: storage=shards)."
)


def shm_size_text(nbytes: float) -> str:
    gb = max(1, -(-int(nbytes * 2) // 2**30))  # 2x headroom, whole GB
    return f"{gb}g"


def staging_bytes(cfg: DictConfig, budget_s: float = 0.15) -> int | None:
    """Bytes storage=tmpfs will copy into /dev/shm, when it stages there and has not yet;
    a walk of the dataset cut off after budget_s (None: not known in time)."""
    target = str(cfg.storage.get("target_dir") or "")
    if not cfg.storage.get("_target_", "").endswith("TmpfsStorage") or not target:
        return 0
    if not os.path.realpath(target).startswith(os.path.realpath(SHM)):
        return 0
    from fastload.storage.tmpfs import MANIFEST, earlier_root, staged_root

    root = str(cfg.dataset.get("root") or "")
    if not root or not os.path.isdir(root):
        return 0
    if any((f(root, target) / MANIFEST).exists() for f in (staged_root, earlier_root)):
        return 0  # staged already (an earlier version's copy is moved, not staged again)
    total, end, stack = 0, time.perf_counter() + budget_s, [root]
    while stack:
        if time.perf_counter() > end:
            return None
        with os.scandir(stack.pop()) as entries:
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                elif e.is_file(follow_symlinks=False):
                    total += e.stat().st_size
    return total


def check_shm(cfg: DictConfig, facts: Facts, a: Ask) -> Check:
    name = "/dev/shm"
    if facts.shm is None:
        if a.workers:
            return Check(name, WARN, f"no {SHM} here; loader.num_workers={a.workers} "
                         "passes batches through shared memory", SHM_FIX.format(size="8g"))  # fmt: skip
        return Check(name, OK, f"no {SHM}; not needed with loader.num_workers=0")
    total, free = facts.shm
    stage = staging_bytes(cfg)
    have = f"{total / MB:,.0f} MiB ({free / MB:,.0f} MiB free)"
    if not a.workers and not stage:
        return Check(name, OK, f"{have}; not used with loader.num_workers=0")
    batches = a.ranks * a.workers * (a.prefetch + 1)
    need = batches * (a.batch_bytes or 0) + (stage or 0)
    parts = []
    if a.batch_bytes:
        parts.append(f"{a.ranks} rank(s) x {a.workers} workers x ({a.prefetch} prefetched + 1) "
                     f"batches of {a.batch_bytes / MB:.1f} MiB")  # fmt: skip
    if stage:
        parts.append(f"{stage / MB:,.0f} MiB of tmpfs staging")
    if stage is None:
        parts.append("the tmpfs staging (size not known in time)")
    want = f"needs about {need / MB:,.0f} MiB: " + " + ".join(parts) if parts else ""
    staging_short = stage and free >= need - stage  # the staged copy is what does not fit
    fix = (SHM_STAGE_FIX if staging_short else SHM_FIX).format(
        size=shm_size_text(max(need, 256 * MB))
    )
    if need and free < need:  # free, not total: other processes' segments take room too
        return Check(name, FATAL, f"{have}, but the run {want}; workers would die with "
                     "'Bus error' or hang", fix)  # fmt: skip
    if total < 256 * MB or (need and free < 2 * need):
        why = "Docker's 64 MiB default?" if total <= 64 * MB else "little headroom"
        return Check(name, WARN, f"{have}; the run {want or 'passes batches through it'} "
                     f"({why})", fix)  # fmt: skip
    return Check(name, OK, f"{have}; the run {want or 'uses little of it'}")


def check_nofile(cfg: DictConfig, facts: Facts, a: Ask) -> Check:
    soft, hard = facts.nofile
    need = max(NOFILE_FLOOR, 256 + a.ranks * a.workers * (a.prefetch + 2) * 8)
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    msg = f"open files: soft limit {soft}, hard limit {hard_text}"
    if soft >= need:
        return Check("ulimit -n", OK, msg)
    target = need if hard == resource.RLIM_INFINITY else min(max(need, 65536), hard)
    fix = (
        f"raise it before starting: `ulimit -n {target}` (the hard limit allows {hard_text}); "
        f"Docker: --ulimit nofile=65536:65536; Slurm/systemd: LimitNOFILE=65536. Workers "
        f"pass every batch as file descriptors and fail with 'Too many open files' or "
        f"'received 0 items of ancdata' when they run out."
    )
    return Check("ulimit -n", WARN, f"{msg}, below the {need} this run may hold", fix)


def check_ram_pin(cfg: DictConfig, facts: Facts, a: Ask) -> Check:
    name = "pinned memory"
    if not a.pin:
        return Check(name, OK, f"pinning off; RAM {facts.ram_total / 2**30:.1f} GiB")
    in_flight = a.workers * a.prefetch + 2
    pinned = (a.batch_bytes or 0) * in_flight
    ram = facts.ram_total
    cap = a.pin_cap_mb
    msg = f"RAM {ram / 2**30:.1f} GiB, cap loader.pin_memory_max_mb=" + (
        "null (none)" if cap is None else f"{cap:,.0f} MiB per rank"
    )
    if a.batch_bytes and cap is not None and pinned > cap * MB:
        return Check(name, FATAL, f"{msg}; about {pinned / MB:,.0f} MiB would be pinned "
                     f"({in_flight} batches of {a.batch_bytes / MB:.1f} MiB) per rank",
                     "Lower loader.prefetch_factor, loader.num_workers or trainer.batch_size, "
                     "raise loader.pin_memory_max_mb if the host has the RAM, or set "
                     "loader.pin_memory=false.")  # fmt: skip
    limit = cap * MB * a.ranks if cap is not None else pinned * a.ranks
    if limit > ram * PIN_RAM_SHARE:
        return Check(name, WARN, f"{msg}: up to {limit / 2**30:.1f} GiB page-locked over "
                     f"{a.ranks} rank(s), more than half the RAM (can freeze the host)",
                     "Set loader.pin_memory_max_mb=auto (a quarter of the RAM shared by the "
                     "ranks) or a smaller number of MiB.")  # fmt: skip
    return Check(name, OK, f"{msg}; about {pinned / MB:,.0f} MiB pinned per rank")


def check_cores(cfg: DictConfig, facts: Facts, a: Ask) -> Check:
    name = "cores"
    mask = f"{facts.usable_cores} usable core(s) (affinity mask; the machine has {facts.cpu_count})"
    use, each = a.workers * a.ranks, auto_num_workers(facts.usable_cores, a.ranks)
    what = f"loader.num_workers={a.workers} x {a.ranks} local rank(s) = {use} workers"
    if a.auto:
        what = f"loader=auto tries up to {a.workers} workers x {a.ranks} local rank(s)"
    if use > facts.usable_cores:
        return Check(name, WARN, f"{mask}; {what}: oversubscribed, workers and the training "
                     "threads take turns on the cores",
                     f"loader.num_workers=auto (= {each} per rank here), or give the job "
                     "more cores (taskset / --cpus / Slurm --cpus-per-task).")  # fmt: skip
    if a.ranks > 1 and each < 2 and a.workers:
        return Check(name, WARN, f"{mask} for {a.ranks} local ranks: one worker each",
                     "Give the job more cores (docker --cpus, Slurm --cpus-per-task), or "
                     "store less work per image: storage=shards storage.kind=raw.")  # fmt: skip
    return Check(name, OK, f"{mask}; {what}")


def check_cpu_flags(cfg: DictConfig, facts: Facts, a: Ask) -> Check:
    """The CPU's AVX2, and what the backend needs of the CPU (its `needs`)."""
    name = "CPU flags"
    for need in backend_needs(cfg, facts, a, name):
        return Check(name, need.status, need.message, need.fix)
    flags = facts.cpu_flags or frozenset()
    return Check(name, OK, f"{facts.arch}, AVX2 {'yes' if 'avx2' in flags else 'no'}")


def check_dataset_fs(cfg: DictConfig, facts: Facts, a: Ask) -> Check:
    """The dataset root's file system, judged by the storage (its `needs`)."""
    name = DATASET_FS
    root = cfg.dataset.get("root")
    if not facts.dataset_fs:
        if cfg.dataset.get("prepare") is not None:
            return Check(name, OK, f"{root} is not there yet (generated on first use)")
        if cfg.storage.get("url"):
            return Check(name, OK, f"{root} is not there (the data comes from storage.url)")
        return Check(name, WARN, f"dataset.root {root} does not exist",
                     "Set dataset.root=<the dataset's folder> (the run stops there), or mount "
                     "it first if it comes later.")  # fmt: skip
    try:
        from hydra.utils import instantiate

        needs = instantiate(cfg.storage).needs(facts.dataset_fs)
    except Exception:  # a storage that cannot be built here says so when the run builds it
        needs = []
    for need in needs:
        return Check(name, need.status, f"{root} is on {need.message}", need.fix)
    return Check(name, OK, f"{root} on {facts.dataset_fs}")


def check_gpu(cfg: DictConfig, facts: Facts, a: Ask) -> Check:
    name = "GPU"
    device = cfg.trainer.device
    if not facts.gpus:
        if device == "cuda":
            return Check(name, FATAL, "trainer.device=cuda, but no CUDA device is visible",
                         "Check `nvidia-smi`, CUDA_VISIBLE_DEVICES, and in Docker "
                         "`--gpus all` (NVIDIA container toolkit); or trainer.device=auto.")  # fmt: skip
        return Check(name, OK, "no CUDA device visible: training on the CPU")
    gpus = ", ".join(sorted(set(facts.gpus)))
    msg = f"{len(facts.gpus)} x {gpus}"
    if device == "cpu":  # the GPUs are not used: neither the rank count nor NVML matters
        return Check(name, OK, f"{msg}, unused: trainer.device=cpu")
    if not gpus_suffice(a.ranks, len(facts.gpus)):  # whether NVML is there or not
        return Check(name, FATAL, f"{msg}, {facts.nvml or 'no NVML'}; {a.ranks} local ranks "
                     f"need one GPU each",
                     f"torchrun --nproc_per_node={len(facts.gpus)} (Slurm: --ntasks-per-node="
                     f"{len(facts.gpus)}, or --gpus-per-task=1), or trainer.device=cpu.")  # fmt: skip
    if facts.nvml is None:
        return Check(name, WARN, f"{msg}; NVML unavailable ({facts.nvml_error or 'no driver'}): "
                     "GPU utilisation will not be recorded",
                     "pip install nvidia-ml-py; in Docker run with --gpus all (the NVIDIA "
                     "container toolkit mounts libnvidia-ml.so).")  # fmt: skip
    return Check(name, OK, f"{msg}, {facts.nvml}, NVML visible")


def check_decoders(cfg: DictConfig, facts: Facts, a: Ask) -> Check:
    """The backend's decoder module is installed, and what else the backend needs (its
    `needs`: a GPU, OpenCV, a region decoder, ...); the OK line says which library decodes."""
    name = "decoders"
    have = [m for m, why in facts.decoders.items() if not why]
    broken = [f"{m} ({why})" for m, why in facts.decoders.items()
              if why and why not in (MISSING, NOT_IMPORTED)]  # fmt: skip
    unused = [m for m, why in facts.decoders.items() if why == NOT_IMPORTED]
    text = f"importable: {', '.join(have) or 'none'}"
    text += f"; installed but failing to import: {'; '.join(broken)}" if broken else ""
    if unused:
        text += f"; installed, not imported (backend={a.backend} does not use them): "
        text += ", ".join(unused)
    text += f"; PIL is {facts.pillow}"
    why = facts.decoders.get(a.decoder_module, "") if a.decoder_module else ""
    if why:
        install = getattr(backend_class(cfg), "install", "")
        what = "is not installed" if why == MISSING else "does not import"
        fix = install if why == MISSING else f"repair or reinstall {a.decoder_module} ({install})"
        return Check(name, FATAL, f"backend={a.backend} needs {a.decoder_module}, which {what} "
                     f"({text})", f"{fix}, or pick another backend "
                     "(backend=turbo | pil).")  # fmt: skip
    for need in backend_needs(cfg, facts, a, name):
        return Check(name, need.status, f"{need.message} ({text})", need.fix)
    backend = backend_class(cfg)
    options = OmegaConf.to_container(cfg.backend, resolve=True)
    libraries = backend.libraries(options, facts) if hasattr(backend, "libraries") else ""
    return Check(name, OK, f"backend={a.backend}; {libraries + '; ' if libraries else ''}{text}")


CHECKS = (check_shm, check_nofile, check_ram_pin, check_cores, check_cpu_flags, check_dataset_fs,
          check_gpu, check_decoders)  # fmt: skip


def run_checks(cfg: DictConfig, facts: Facts | None = None, local_ranks: int = 1) -> list[Check]:
    facts = facts if facts is not None else gather(cfg)
    a = ask(cfg, facts, local_ranks)
    return [check(cfg, facts, a) for check in CHECKS]


def failures_message(results: list[Check]) -> str:
    fatal = [r for r in results if r.status == FATAL]
    lines = [f"{r.name}: {r.message}. Fix: {r.fix}" for r in fatal]
    return (
        f"the pre-flight check found {len(fatal)} problem(s) that would stop the run: "
        + " | ".join(lines)
        + " (python -m fastload.doctor env shows every check; doctor.preflight=false skips it)"
    )


def preflight(cfg: DictConfig, ctx, facts: Facts | None = None) -> list[Check]:
    """At the start of every run, before any data work. Every rank judges its node (so all
    stop together on a fatal result); local rank 0 logs the warnings."""
    if not cfg.get("doctor", {}).get("preflight", True):
        return []
    t0 = time.perf_counter()
    results = run_checks(cfg, facts, ctx.local_world_size)
    if ctx.is_local_main:
        for r in results:
            if r.status == WARN:
                log.warning("pre-flight: %s: %s. Fix: %s", r.name, r.message, r.fix)
        log.debug("pre-flight check took %.3f s", time.perf_counter() - t0)
    if any(r.status == FATAL for r in results):
        raise ConfigError(failures_message(results))
    return results


def replace(facts: Facts, **changes) -> Facts:
    """A copy of `facts` with some fields changed (tests inject a small /dev/shm, ...)."""
    return dataclasses.replace(facts, **changes)
