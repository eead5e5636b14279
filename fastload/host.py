"""Facts about this host that the loaders, the storage and the benchmarks all need: usable
cores, memory, /dev/shm, file system types. The ground floor of the package: it imports
nothing from fastload, so anything may import it."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

MB = 2**20
SHM = "/dev/shm"
SHM_FIX = (
    "Give the container more shared memory (docker run --shm-size=8g, or in Kubernetes mount "
    "an emptyDir with medium: Memory at /dev/shm), or lower loader.num_workers / "
    "loader.prefetch_factor."
)


@dataclasses.dataclass(frozen=True)
class Need:
    """A line a backend or a storage adds to the pre-flight (fastload/preflight.py) under one
    of its checks (`check`: "CPU flags", "decoders", "dataset file system"): warn or fatal,
    what is wrong and the fix."""

    check: str
    status: str  # "warn" | "fatal"
    message: str
    fix: str = ""


def global_rank() -> int:
    """This process's rank in the job, from the launcher's environment (torchrun's RANK,
    SLURM's SLURM_PROCID), before any process group exists; 0 outside one."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def local_rank() -> int:
    """This process's rank on its node (torchrun's LOCAL_RANK, SLURM's SLURM_LOCALID)."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))


def gpus_suffice(local_ranks: int, gpus: int) -> bool:
    """Whether `gpus` visible GPUs give each of a node's `local_ranks` ranks its own: one per
    local rank, or a single one where this process is one of several srun tasks, not
    torchrun's (whose ranks share one CUDA_VISIBLE_DEVICES): srun --gpus-per-task=1 or
    --gpu-bind give each task a GPU of its own (fastload.dist checks that they differ)."""
    if local_ranks <= gpus:
        return True
    env = os.environ
    return (
        gpus == 1
        and "SLURM_PROCID" in env
        and int(env.get("SLURM_NTASKS", "1")) > 1
        and "TORCHELASTIC_RUN_ID" not in env
    )


def usable_cores() -> int:
    """Cores this process may run on (cpuset / taskset aware, unlike os.cpu_count())."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def auto_num_workers(cores: int, local_ranks: int) -> int:
    """loader.num_workers=auto: the usable cores shared out over this node's ranks, >= 1.
    One rule for the loader (fastload/loaders/workers.py) and the pre-flight's estimate."""
    return max(1, cores // max(1, local_ranks))


def hostname() -> str:
    return socket.gethostname()


def process_space() -> str:
    """Where a pid names one process: the host name and, on Linux, the PID namespace. Two
    containers of one host name (`docker run --network host`, or the same `--hostname`)
    sharing a volume number their processes apart, so a pid seen in a file written by the
    other container says nothing about whether its writer lives here."""
    try:
        ns = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return hostname()
    return f"{hostname()}~{ns.removeprefix('pid:[').removesuffix(']')}"


def code_version() -> str | None:
    """`git describe --always --dirty` of the checkout fastload runs from ("-dirty": with
    uncommitted changes, whose figures are not the commit's); None outside git."""
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=Path(__file__).parent,
                              capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def total_ram() -> int:
    """Bytes of physical memory."""
    import psutil

    return int(psutil.virtual_memory().total)


def available_ram() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def shm_bytes() -> tuple[int, int] | None:
    """(total, free) bytes of /dev/shm, where worker batches travel; None where absent."""
    try:
        usage = shutil.disk_usage(SHM)
    except OSError:
        return None
    return usage.total, usage.free


def memory_limit_available() -> int | None:
    """Bytes the container may still allocate (cgroup v2 or v1), or None without a limit."""
    for limit_f, usage_f in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            limit = Path(limit_f).read_text().strip()
            usage = int(Path(usage_f).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 1 << 60:
            return None
        return int(limit) - usage
    return None


NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph")
NETWORK_FS += ("glusterfs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.goofys", "9p")
NETWORK_FS += ("fuse.rclone", "fuse.blobfuse", "fuse.mountpoint-s3", "fuse.juicefs")


def is_network_fs(kind: str) -> bool:
    """Whether a file system type (`fs_type`) is a network or FUSE one: every small read a
    round trip."""
    return kind in NETWORK_FS or kind.startswith("fuse.")


def fs_type(path: str | os.PathLike) -> str:
    """The file system type of the mount holding `path` (longest /proc/mounts prefix)."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def size_text(n: float) -> str:
    """Bytes as a short binary-unit string: '812.0 MiB', '3.25 GiB'."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def spawn_pool(workers: int):
    """A spawn multiprocessing Pool whose children ignore Ctrl-C from birth. Ctrl-C reaches
    every process of the terminal's group; the parent handles it (one line, exit 130) and
    stops the pool. An initializer that ignores SIGINT comes too late: a child still
    importing the main module dies of it with a traceback, which a 16-core box showed when
    train.py imported torch at its top. So the parent blocks SIGINT while the pool starts:
    a signal mask survives fork and exec and Python leaves it alone, so the children (and the
    pool's threads) never take SIGINT, while the parent's own Ctrl-C stays pending and is
    raised the moment the mask is restored. (Ignoring it instead, SIG_IGN, did the same for
    the children but threw away a Ctrl-C that came during those milliseconds: the parent
    went on generating.) The resource tracker is started first because starting it
    unblocks SIGINT. Every child imports the main module and the task's module: keep both
    free of torch at their top (train.py, fastload.pack, fastload.storage.*,
    fastload.data.synthetic*), or each child pays seconds and some hundred MiB before its
    first task."""
    import multiprocessing
    import signal
    import threading
    from multiprocessing import resource_tracker

    ctx = multiprocessing.get_context("spawn")
    if threading.current_thread() is not threading.main_thread():
        return ctx.Pool(workers)  # a Ctrl-C is the main thread's to take
    resource_tracker.ensure_running()  # it unblocks SIGINT when it starts
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return ctx.Pool(workers)  # its processes and threads start here, SIGINT blocked
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a pending Ctrl-C lands here


class Terminated(KeyboardInterrupt):
    """SIGTERM taken as Ctrl-C is (`sigterm_interrupts`): what is half-written is removed on
    the way out; train.py says so in one line and exits 143 (128 + SIGTERM)."""

    signum = signal.SIGTERM


@contextlib.contextmanager
def sigterm_interrupts():
    """`with sigterm_interrupts():` a SIGTERM inside the block raises `Terminated`, a
    KeyboardInterrupt, where the run has no step of its own to stop at (staging, packing,
    generating the data): without it SIGTERM (Slurm, torchrun, `kill`) ended the process at
    once, with no word, and left a partial copy in RAM. Only the main thread may swap signal
    handlers; elsewhere the block runs unchanged."""
    import threading

    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield
        return

    def terminate(signum, frame):
        raise Terminated

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def ctrl_c_after():
    """`with ctrl_c_after():` a Ctrl-C that lands inside the block takes effect when the block
    ends, whatever the block did with it. Some compiled modules run Python code while they
    initialise and turn any exception raised there into their own ImportError (pybind11's
    "initialization failed"), which a caller takes for "not installed": a Ctrl-C during
    nvImageCodec's import in the pre-flight was lost that way, and the run went on to
    generate the dataset. Inside the block SIGINT only sets a flag; at its end the previous
    handler gets the signal again (KeyboardInterrupt, or the training loop's graceful stop).
    Only the main thread may swap signal handlers; elsewhere the block runs unchanged."""
    import signal
    import threading

    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield  # None: a handler installed from C, which cannot be put back
        return
    caught = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:  # also when the block failed: the Ctrl-C comes first
            signal.raise_signal(signal.SIGINT)
