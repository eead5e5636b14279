"""torchrun / SLURM environment, the process group, and rank-0 helpers.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT for every
process; Hydra's submitit launcher on SLURM gives SLURM_PROCID/NTASKS/LOCALID instead, which
we map onto the same names. One process per GPU; a plain `python train.py` is world size 1.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastload.checkpoint import rng_state
from fastload.errors import ConfigError, FastloadError
from fastload.host import gpus_suffice
from fastload.telemetry.sampler import torch_device_identity

log = logging.getLogger(__name__)

# How long a collective waits for the other ranks before it fails.
PG_TIMEOUT = datetime.timedelta(minutes=30)


def _from_slurm() -> None:
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    if int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(slurm_tasks_on_this_node()))
    if "MASTER_ADDR" not in os.environ:
        nodes = subprocess.run(
            ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        os.environ["MASTER_ADDR"] = nodes[0]
    os.environ.setdefault("MASTER_PORT", str(29500 + int(os.environ["SLURM_JOB_ID"]) % 1000))


def slurm_tasks_on_this_node() -> int:
    """The tasks SLURM runs on this node: SLURM_NTASKS_PER_NODE exists only with
    --ntasks-per-node; otherwise the step's (or job's) per-node list, e.g. "4(x2),3" (4 on
    nodes 0 and 1, 3 on node 2), at this node's index SLURM_NODEID."""
    env = os.environ
    if env.get("SLURM_NTASKS_PER_NODE"):
        return int(env["SLURM_NTASKS_PER_NODE"])
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return 1
    counts = []
    for part in spec.split(","):
        tasks, _, times = part.partition("(x")
        counts += [int(tasks)] * int(times.rstrip(")") or 1)
    node = int(env.get("SLURM_NODEID", "0"))
    return counts[node] if node < len(counts) else counts[-1]


def local_world_size_from_env() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def check_gpus_for_ranks(local_ranks: int) -> None:
    """One GPU per local rank, or one clear error before any process group exists (NCCL
    would otherwise fail with "Duplicate GPU detected" and a wall of tracebacks)."""
    gpu_index(0, local_ranks)


def gpu_index(local_rank: int, local_ranks: int) -> int:
    """The index, among the GPUs this process sees, of its rank's GPU: its local rank where
    it sees one per local rank (torchrun; srun --gpus-per-node); 0 where a Slurm task sees a
    single GPU of its own (srun --gpus-per-task=1 or --gpu-bind give each task another
    CUDA_VISIBLE_DEVICES; `check_distinct_gpus` then makes sure no two tasks of a node got
    the same one); else one clear error."""
    gpus = torch.cuda.device_count()
    if gpus_suffice(local_ranks, gpus):
        return local_rank if local_ranks <= gpus else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    raise ConfigError(
        f"{local_ranks} ranks on this node but {gpus} GPU(s) visible{where}: each rank "
        f"needs its own GPU. Start one rank per GPU (torchrun --nproc_per_node={gpus}; under "
        f"Slurm --ntasks-per-node={gpus}, or --gpus-per-task=1), or run the ranks on the CPU "
        f"with trainer.device=cpu."
    )


def check_distinct_gpus(store, host: str, local_rank: int, local_ranks: int, uuid: str) -> None:
    """Every rank of a node publishes its GPU's UUID in the rendezvous store and reads its
    node's others': two ranks on one GPU (Slurm tasks bound to the same device) are one
    clear error on each of them, before NCCL fails at its first collective."""
    node = f"{host}/{os.environ.get('GROUP_RANK') or os.environ.get('SLURM_NODEID') or 0}"
    store.set(f"{node}/{local_rank}", uuid)
    keys = [f"{node}/{i}" for i in range(local_ranks)]
    try:  # the rendezvous is done: every rank of the node is here within seconds
        store.wait(keys, datetime.timedelta(seconds=60))
    except Exception as exc:  # a local rank count the launcher got wrong: no check, no stop
        log.debug("not checking for shared GPUs: %s", exc)
        return
    owners: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        owners.setdefault(store.get(key).decode(), []).append(i)
    shared = owners.get(uuid, [])
    if len(shared) > 1:
        ranks = ", ".join(map(str, shared))
        raise ConfigError(
            f"local ranks {ranks} on {host} all run on GPU {uuid}: each rank needs its own "
            f"GPU. Under Slurm give every task its own (srun --gpus-per-task=1 or --gpu-bind; "
            f"or --gpus-per-node=N with --ntasks-per-node=N, each task seeing them all), or "
            f"run the ranks on the CPU with trainer.device=cpu."
        )


@dataclass
class DistContext:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0


def setup(device: str = "auto", backend: str = "auto") -> DistContext:
    _from_slurm()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError(
            "trainer.device=cuda but no CUDA device is visible; use trainer.device=auto."
        )
    if use_cuda:
        torch.cuda.set_device(gpu_index(local_rank, local_world_size_from_env()))
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    ctx = DistContext(
        rank=int(os.environ.get("RANK", "0")),
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world_size_from_env(),
        device=dev,
    )
    if ctx.distributed and not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if use_cuda else "gloo"
        timeout = PG_TIMEOUT
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        uuid = torch_device_identity(dev.index)[0] if use_cuda else None
        if uuid is not None:
            gpus = dist.PrefixStore(f"{attempt_prefix()}gpus/", store)
            check_distinct_gpus(gpus, socket.gethostname(), local_rank, ctx.local_world_size,
                                uuid)  # fmt: skip
        dist.init_process_group(
            backend=backend,
            store=dist.PrefixStore(attempt_prefix(), store),
            rank=rank,
            world_size=world,
            timeout=timeout,
            device_id=dev if use_cuda else None,
        )
    return ctx


def attempt_prefix() -> str:
    """The store keys of this launch attempt. torchrun's agent shares one TCP store with its
    workers and keeps it across `--max-restarts` restarts, and the addresses a process group
    publishes there stay from the attempt before: a restarted group can read its dead ranks'
    addresses and fail to connect (gloo: "connectFullMesh failed ... Connection refused").
    Each attempt (TORCHELASTIC_RESTART_COUNT) so keeps its own keys."""
    return f"fastload/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


class RankLost(FastloadError):
    """Another rank of the run died, or its node went away, during a collective."""


# gloo's and NCCL's words for a peer that is gone
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "NCCL communicator was aborted")  # fmt: skip


def lost_rank_error(exc: BaseException, ctx: DistContext) -> RankLost | None:
    """The clear error for a collective that failed because another rank is gone (torch
    names only a socket); None for any other error."""
    text = str(exc).strip()
    if not ctx.distributed or not any(words in text for words in PEER_GONE):
        return None
    first = text.splitlines()[0][:200]  # not empty: it holds one of PEER_GONE
    return RankLost(
        f"rank {ctx.rank} lost another rank of the run during a collective: its process died "
        f"or its node went away (its own log says why; here: {first}). Continue from the "
        f"run's newest checkpoint with the same command plus resume=auto (on any number of "
        f"ranks); under torchrun --max-restarts=K that happens by itself, and "
        f"trainer.checkpoint_every_steps=N bounds what such a failure costs to N steps."
    )


class RankFailed(FastloadError):
    """Another rank stopped with an error in a phase every rank finishes together."""


def agreed(ctx: DistContext, what: str, work=None, waiting: str | None = None):
    """`work()` on this rank (None: nothing), then every rank learns whether any rank
    failed: one that raised raises its own error, the others a RankFailed naming it, so no
    rank waits out the process group's timeout (30 minutes) at the next collective for a
    rank that is gone. Also a barrier. Returns what `work` returned.

    `waiting`: the work may take longer than that timeout (data preparation: copying a
    dataset of hundreds of GB). The ranks then first wait for one another in the process
    group's store, without a deadline (`wait_for_ranks`); a rank with no work logs
    `waiting`."""
    error, result = None, None
    phase = next(_phases) if waiting is not None and ctx.distributed else None
    beat = Heartbeat(phase_store(phase)) if phase is not None and work is not None else None
    try:
        result = work() if work is not None else None
    except Exception as exc:  # raised below, once the other ranks know
        error = exc
    finally:
        if beat is not None:
            beat.stop()
    if phase is not None:
        wait_for_ranks(ctx, phase_store(phase), what, waiting if work is None else None)
    failed = int(all_reduce([float(ctx.rank + 1 if error else 0)], ctx, op="max")[0])
    if error is not None:
        raise error
    if failed:
        raise rank_failed(failed - 1, ctx, what)
    return result


def rank_failed(failed: int, ctx: DistContext, what: str) -> RankFailed:
    return RankFailed(
        f"rank {failed} stopped with an error while {what}; rank {ctx.rank} stops too. "
        f"The error is in that rank's output (rank 0: train.log; rank N: train.rank<N>.log)."
    )


def gathered(ctx: DistContext, what: str, work) -> list:
    """`work()` on every rank, and every rank's result, in rank order, on every rank (one
    all_gather_object): what the ranks compare to agree. As with `agreed`, a rank whose work
    raised raises its own error and the others a RankFailed naming it, so none is left
    waiting at the next collective."""
    error, result = None, None
    try:
        result = work()
    except Exception as exc:  # raised below, once the other ranks know
        error = exc
    if not ctx.distributed:
        if error is not None:
            raise error
        return [result]
    parts: list = [None] * ctx.world_size
    dist.all_gather_object(parts, (error is not None, None if error is not None else result))
    if error is not None:
        raise error
    failed = next((rank for rank, (bad, _) in enumerate(parts) if bad), None)
    if failed is not None:
        raise rank_failed(failed, ctx, what)
    return [part for _, part in parts]


# A slow phase's ranks: those at work add to the phase's "beat" key every BEAT_S seconds; one
# whose count stood still for STALL_S seconds, with ranks not yet done, is taken for gone.
BEAT_S = 5.0
STALL_S = 300.0
_phases = itertools.count()  # every rank runs the same slow phases in the same order


def phase_store(number: int):
    """The process group's store, under keys of its own for the slow phase `number`."""
    from torch.distributed.distributed_c10d import _get_default_store

    return dist.PrefixStore(f"fastload/slow/{number}/", _get_default_store())


class Heartbeat:
    """While this rank works in a slow phase, a thread tells the waiting ranks it is alive."""

    def __init__(self, store):
        self.store = store
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, name="fastload-heartbeat", daemon=True)
        self.thread.start()

    def run(self) -> None:
        try:
            while True:
                self.store.add("beat", 1)
                if self.done.wait(BEAT_S):
                    return
        except Exception as exc:  # the store is gone: the waiting ranks' loop says so
            log.debug("heartbeat stopped: %s", exc)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def polled_until(store, key: str, seconds: float) -> bool:
    """Whether `key` appears in the store within `seconds`, polled: a store.wait that times
    out makes c10d print two warning lines (socket.cpp "waitForInput ... likely a timeout"),
    thousands of them over an hour of staging on a node's waiting ranks."""
    end = time.monotonic() + seconds
    while True:
        if store.check([key]):
            return True
        left = end - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(0.2, left))


def wait_for_ranks(ctx: DistContext, store, what: str, note: str | None) -> None:
    """Wait, without a deadline, until every rank is done with the slow phase `what`. A wait
    longer than a second is logged: `note` (a rank that had no work), or that this rank is
    done and waits for the others; every ten minutes how many ranks are done. Fails when no
    rank is done or beats for STALL_S seconds (a process killed, a node gone) or the store
    goes away."""
    world = ctx.world_size
    if store.add("done", 1) == world:
        store.set("all-done", "1")
    progress = (store.add("done", 0), store.add("beat", 0))
    start = moved = told = time.monotonic()
    while True:
        if polled_until(store, "all-done", 1.0 if told == start else BEAT_S):
            return
        now, seen = time.monotonic(), (store.add("done", 0), store.add("beat", 0))
        if seen[0] >= world:
            return
        if told == start or now - told > 600:
            told = now
            log.info("%s (%d of %d ranks done)", note or f"waiting for the other ranks to "
                     f"finish {what}", seen[0], world)  # fmt: skip
        if seen != progress:
            progress, moved = seen, now
        elif now - moved > STALL_S:
            raise RankLost(
                f"rank {ctx.rank} waited for the other ranks while {what}: {world - seen[0]} "
                f"of {world} ranks are not done and gave no sign of life for {STALL_S:.0f} s "
                f"(a process killed, or its node gone; their own logs say why)."
            )


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def all_reduce(values: list[float], ctx: DistContext, op: str = "sum") -> list[float]:
    """Reduce a few scalars across ranks (one collective for the lot)."""
    if not ctx.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def gather_rng(ctx: DistContext) -> list:
    """Every rank's RNG state (python, numpy, torch, CUDA), in rank order, on every rank:
    what a checkpoint needs to give each rank its own stream back."""
    if not ctx.distributed:
        return [rng_state()]
    parts: list = [None] * ctx.world_size
    dist.all_gather_object(parts, rng_state())
    return parts


def gather_lists(items: list, ctx: DistContext) -> list:
    """Every rank's list, concatenated in rank order, on every rank."""
    if not ctx.distributed:
        return list(items)
    parts: list = [None] * ctx.world_size
    dist.all_gather_object(parts, list(items))
    return [x for part in parts for x in part]


def broadcast_object(obj, ctx: DistContext):
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_tensors(tensors: list, ctx: DistContext) -> None:
    """Rank 0's values of `tensors` on every rank, in place: one collective per dtype."""
    if not ctx.distributed or not tensors:
        return
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        dist.broadcast(flat, src=0)
        for t, part in zip(group, flat.split([t.numel() for t in group]), strict=True):
            t.detach().copy_(part.view_as(t))


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def ddp_class(cfg):
    """trainer.ddp's DistributedDataParallel class; ConfigError for another value, or for
    apex where it is not importable. Checked before any work (engine.check_config), also by
    a single process, which wraps nothing: the same command under torchrun would fail after
    its data work."""
    if cfg.trainer.ddp == "apex":
        try:
            from apex.parallel import DistributedDataParallel as ApexDDP
        except ImportError:
            raise ConfigError(
                "trainer.ddp=apex needs NVIDIA apex, which is not importable here. It is not on "
                "PyPI: use an NVIDIA PyTorch container (it ships apex) or build apex from source "
                "(github.com/NVIDIA/apex); or use trainer.ddp=native."
            ) from None
        return ApexDDP
    if cfg.trainer.ddp != "native":
        raise ConfigError(f"trainer.ddp={cfg.trainer.ddp!r}: use native or apex.")
    return torch.nn.parallel.DistributedDataParallel


def wrap_ddp(model, cfg, ctx):
    if not ctx.distributed:
        return model
    ddp = ddp_class(cfg)
    if cfg.trainer.ddp == "apex":
        return ddp(model)
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return ddp(model, device_ids=ids)
