"""OmegaConf resolvers used by conf/config.yaml; importing this module registers them."""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, read_write

from fastload.host import global_rank, local_rank
from fastload.run_folder import STAMP


def run_id() -> str:
    """A run-directory name that every rank of one launch agrees on (hydra#2070: `${now:}`
    differs per rank and gives one run directory each).

    - FASTLOAD_RUN_ID, when set, wins (schedulers can pass their job id).
    - Multi-node torchrun: the rendezvous id (`--rdzv-id`), the same on every node; with
      static rendezvous (no id) the launch's time as its first process wrote it into the
      launch's TCP store (fastload/run_folder.py).
    - Single-node torchrun: the start time of the torchrun agent, our common parent.
    - Otherwise: now.
    """
    if os.environ.get("FASTLOAD_RUN_ID"):
        return os.environ["FASTLOAD_RUN_ID"]
    if "TORCHELASTIC_RUN_ID" in os.environ:  # launched by torchrun
        rdzv = os.environ["TORCHELASTIC_RUN_ID"]
        if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1 and rdzv not in ("", "none"):
            return f"torchrun-{rdzv}"
        from fastload.run_folder import static_launch_stamp

        stamp = static_launch_stamp()
        if stamp is not None:
            return f"torchrun-{stamp}"
        import psutil

        started = psutil.Process(os.getppid()).create_time()
        return datetime.datetime.fromtimestamp(started).strftime(STAMP)
    if "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    return datetime.datetime.now().strftime(STAMP)


def rank0_only(value):
    """`value` on global rank 0, None elsewhere (Hydra skips writing .hydra/ for None)."""
    return value if global_rank() == 0 else None


def rank0_or(on_rank0, elsewhere):
    """`on_rank0` on global rank 0, `elsewhere` on the other ranks."""
    return on_rank0 if global_rank() == 0 else elsewhere


def log_level() -> str:
    """INFO on each node's local rank 0, which also says what its node does (staging,
    packing, fetching shards); WARNING on the other ranks, whose INFO lines would repeat."""
    return "INFO" if local_rank() == 0 else "WARNING"


def log_file(job_name: str) -> str:
    """The run's log file: train.log on rank 0, train.rank<N>.log on rank N, made at its
    first line (so a rank that logs nothing leaves none). Every rank appending to one file
    repeated lines and interleaved them, and appends from several nodes onto NFS are not
    atomic."""
    rank = global_rank()
    return f"{job_name}.log" if rank == 0 else f"{job_name}.rank{rank}.log"


def conf_dir() -> Path:
    """The conf/ folder that train.py composes: beside the fastload package in a checkout or
    the Docker image's /app, else ./conf."""
    for candidate in (Path(__file__).resolve().parents[1] / "conf", Path.cwd() / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(
        "cannot find conf/config.yaml beside the fastload package or in the current folder; "
        "run from the repository root (where train.py is)."
    )


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("fastload_run_id"):
        OmegaConf.register_new_resolver("fastload_run_id", run_id, use_cache=True)
    if not OmegaConf.has_resolver("fastload_rank0_only"):
        OmegaConf.register_new_resolver("fastload_rank0_only", rank0_only)
    if not OmegaConf.has_resolver("fastload_rank0_or"):
        OmegaConf.register_new_resolver("fastload_rank0_or", rank0_or)
    if not OmegaConf.has_resolver("fastload_log_level"):
        OmegaConf.register_new_resolver("fastload_log_level", log_level)
    if not OmegaConf.has_resolver("fastload_log_file"):
        OmegaConf.register_new_resolver("fastload_log_file", log_file)


register_resolvers()


class CheckRunDir(Callback):
    """Hydra creates the run directory before the job starts; an unwritable output_root
    would end in a stack of mkdir tracebacks. Check first and say what to change."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        # The dir interpolates ${hydra:runtime.choices...}, which needs HydraConfig set; Hydra
        # sets it only later, in run_job, from this same config.
        HydraConfig.instance().set_config(config)
        wanted = Path(config.hydra.run.dir).absolute()
        self._check(str(wanted))
        # Claim it for this launch (fastload/run_folder.py); run_job then uses what this sets.
        chosen = self._claim(wanted, config.hydra.run)
        with read_write(config.hydra.run):
            config.hydra.run.dir = str(chosen)
        HydraConfig.instance().set_config(config)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        """A sweep's folder is claimed as a run's is: two sweeps launched in the same second
        would otherwise run their jobs in the same <sweep>/<N>/ folders."""
        HydraConfig.instance().set_config(config)
        wanted = Path(config.hydra.sweep.dir).absolute()
        self._check(str(wanted))
        chosen = self._claim(wanted, config.hydra.sweep)
        if chosen == wanted:
            return
        with read_write(config.hydra):
            config.hydra.sweep.dir = str(chosen)
            # the launcher composes each job's config again from these overrides (Hydra's
            # load_sweep_config): without one the jobs would go back to the unclaimed name
            quoted = str(chosen).replace("\\", "\\\\").replace("'", "\\'")
            config.hydra.overrides.hydra.append(f"hydra.sweep.dir='{quoted}'")
        HydraConfig.instance().set_config(config)

    @staticmethod
    def _claim(wanted: Path, node) -> Path:
        """The folder this launch writes (fastload/run_folder.py); a user error exits 2."""
        from fastload import run_folder
        from fastload.errors import FastloadError

        named_by_us = "fastload_run_id" in str(node._get_node("dir")._value())
        try:
            return run_folder.claim(wanted, named_by_us)
        except FastloadError as exc:
            print(f"error: {exc.user_message}", file=sys.stderr)
            sys.exit(2)

    @staticmethod
    def _check(run_dir: str) -> None:
        path = Path(run_dir).absolute()
        existing = next(p for p in (path, *path.parents) if p.exists())
        if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
            try:
                path.mkdir(parents=True, exist_ok=True)
                return
            except OSError:
                pass
        print(
            f"error: cannot create the run directory {path} ({existing} is "
            f"{'not writable' if existing.is_dir() else 'a file, not a folder'}). "
            f"Set output_root=<a writable folder> (or hydra.run.dir=...).",
            file=sys.stderr,
        )
        sys.exit(2)
