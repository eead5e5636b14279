"""Run folders that no two launches share, and that say which launch writes them.

A run folder is `output_root/name/<run id>`, the run id a timestamp to the second (or the
torchrun / SLURM / FASTLOAD_RUN_ID id that every rank of a launch agrees on). Two launches of
the same command in the same second would land in one folder and interleave their
metrics.jsonl, summary and checkpoints. So each launch *claims* its folder: it publishes
`.fastload-run.json` (who: the launch, host, pid) with an atomic link, which only one launch
can win. The ranks of one launch carry the same launch identity and all use the folder; a
different launch that finds the default folder taken uses `<run id>-1`, `-2`, ...; one that
was given the folder explicitly (hydra.run.dir=...) is refused while the owner lives, and
takes it over once the owner is gone (a run continued in the same folder; one holding
results trains only to continue them: fastload/engine.py keep_results).

The same record tells `resume=` who still writes a checkpoint: a run that would resume a
checkpoint its live owner is still writing is refused, naming the owner.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
from pathlib import Path

from fastload.errors import CheckpointError, ConfigError
from fastload.host import hostname, pid_alive, process_space

MARKER = ".fastload-run.json"
LAUNCH_ONLY_FILES = {MARKER, ".hydra", "train.log"}  # what a run folder holds before training
RANK_LOG = re.compile(r"train\.rank\d+\.log")  # a rank > 0's log (fastload/config.py)
STAMP = "%Y-%m-%d_%H-%M-%S"  # a run id's time, to the second (fastload/config.py run_id)
# What a run writes once training (or evaluate=) started: a launch reusing the folder's id
# must not take a folder holding any of them for its own (fastload/engine.py RunRecord).
RESULTS = {"metrics.jsonl", "summary.json", "checkpoints", "evaluation.json",
           "skipped_files.txt", "wandb"}  # fmt: skip


@functools.cache
def static_launch_stamp() -> str | None:
    """The id of a multi-node torchrun launch with static rendezvous (--master-addr/-port,
    no --rdzv-id: TORCHELASTIC_RUN_ID=none), where each node's agent starts at its own time:
    the first process to ask writes the time into the launch's TCP store (torchrun's agent
    store, which every worker of every node reaches and which lasts across restarts), and
    every process reads that one. None for any other launch."""
    env = os.environ
    if (env.get("TORCHELASTIC_RUN_ID", "none") not in ("", "none")
            or int(env.get("GROUP_WORLD_SIZE", "1")) <= 1
            or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"):  # fmt: skip
        return None
    import datetime

    from torch.distributed import TCPStore

    store = TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                     timeout=datetime.timedelta(seconds=120))  # fmt: skip
    now = datetime.datetime.now().strftime(STAMP)
    return store.compare_set("fastload/launch-stamp", "", now).decode()


def launch_identity() -> dict:
    """Who this process writes for: the same for every rank of one launch (and a torchrun
    restart of it), different for another launch. `pid`/`pids_of`: whose life the claim
    lasts (a pid of this host and PID namespace, `host.process_space`: two containers of one
    host name, each its train.py as pid 1, are two launches); `host`: where, for messages."""
    host, env = hostname(), os.environ
    if env.get("FASTLOAD_RUN_ID"):
        return {"launch": f"env:{env['FASTLOAD_RUN_ID']}", "host": host, "pid": None}
    if "TORCHELASTIC_RUN_ID" in env:  # torchrun: its agent is every local rank's parent
        rdzv = env["TORCHELASTIC_RUN_ID"]
        if int(env.get("GROUP_WORLD_SIZE", "1")) > 1 and rdzv not in ("", "none"):
            return {"launch": f"torchrun:{rdzv}", "host": host, "pid": None}  # several nodes
        stamp = static_launch_stamp()
        if stamp is not None:  # several nodes, static rendezvous
            return {"launch": f"torchrun:{stamp}", "host": host, "pid": None}
        return _local_launch("torchrun:", os.getppid())
    if "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return {"launch": f"slurm:{env['SLURM_JOB_ID']}", "host": host, "pid": None}
    return _local_launch("", os.getpid())


def _local_launch(kind: str, pid: int) -> dict:
    space = process_space()
    return {"launch": f"{kind}{space}:{pid}", "host": hostname(), "pid": pid, "pids_of": space}


def owner(folder: Path) -> dict | None:
    """The claim of a run folder, or None (no claim, or an unreadable one)."""
    try:
        data = json.loads((Path(folder) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def alive(who: dict | None) -> bool:
    """Whether the process holding a claim still runs (known only for one of this host and
    PID namespace)."""
    pid = (who or {}).get("pid")
    if not isinstance(pid, int):
        return False
    if "pids_of" in who:
        return who["pids_of"] == process_space() and pid_alive(pid)
    return who.get("host") == hostname() and pid_alive(pid)  # a claim written before pids_of


def describe(who: dict) -> str:
    return f"pid {who.get('pid')} on {who.get('host')}"


def _try_claim(folder: Path, me: dict, take_over: bool) -> dict | None:
    """Publish `me` as the folder's claim; None when done, else the other claim found."""
    folder.mkdir(parents=True, exist_ok=True)
    # named by host, PID namespace and pid: two containers of one host name whose train.py
    # has one pid, claiming at once, would write (and link) each other's file
    tmp = folder / f"{MARKER}.tmp-{process_space()}-{os.getpid()}"
    tmp.write_text(json.dumps(me), encoding="utf-8")
    try:
        if take_over:
            os.replace(tmp, folder / MARKER)
            return None
        os.link(tmp, folder / MARKER)  # atomic, and fails when a claim is there
        return None
    except FileExistsError:
        return owner(folder) or {}
    finally:
        tmp.unlink(missing_ok=True)


def claim(path: Path, named_by_us: bool, me: dict | None = None) -> Path:
    """The folder this launch writes: `path` when free or already this launch's; else, when
    `named_by_us` (the default `<run id>` name), the first free `<path>-<k>`; else (a folder
    the user named) `path` taken over from a dead owner, or ConfigError naming a live one."""
    me = me or launch_identity()
    for k in range(1000):
        folder = path if k == 0 else path.with_name(f"{path.name}-{k}")
        other = _try_claim(folder, me, take_over=False)
        if other is None:
            return folder
        if other.get("launch") == me["launch"]:
            # Ours by name, but holding results while this launch has trained nothing yet
            # (the ranks of one launch all claim before any trains): an earlier launch that
            # reused the id (a fixed --rdzv-id, FASTLOAD_RUN_ID), whose results stay. A
            # torchrun or SLURM restart of this launch continues in its folder.
            if named_by_us and not restarted() and results_in(folder):
                continue
            return folder
        if named_by_us:
            continue
        if alive(other):
            raise ConfigError(
                f"the run directory {folder} is in use by another run ({describe(other)}): "
                f"two runs writing one folder would mix their metrics and checkpoints. Wait "
                f"for it to finish or stop it, or pass another hydra.run.dir=."
            )
        _try_claim(folder, me, take_over=True)
        return folder
    raise ConfigError(f"{path}: 1000 run directories of this name and second exist already.")


def restarted() -> bool:
    """Whether this process is a restart of its launch (torchrun --max-restarts, a SLURM
    requeue), which goes on in the launch's folder."""
    env = os.environ
    return any(
        int(env.get(k) or 0) > 0 for k in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
    )


def results_in(folder: Path) -> set[str]:
    """The results a run folder holds (what training and evaluate= write), not what ranks
    write while they start (the claim and its temporary files, .hydra/, the logs)."""
    try:
        return {p.name for p in Path(folder).iterdir()} & RESULTS
    except OSError:
        return set()


def check_not_held(checkpoint: Path) -> None:
    """Refuse to resume a checkpoint whose run is still going (it keeps writing it)."""
    folder = Path(checkpoint).absolute().parent.parent  # <run>/checkpoints/last.pt
    who = owner(folder) or owner(folder.parent)  # a sweep's job: its sweep folder's claim
    if who is None or who.get("launch") == launch_identity()["launch"] or not alive(who):
        return
    raise CheckpointError(
        f"resume would continue {checkpoint}, but the run that writes it ({folder}, "
        f"{describe(who)}) is still running: two runs would train from one state and "
        f"overwrite each other's results. Wait for it to finish or stop it (it writes a "
        f"checkpoint on SIGTERM), or start a separate run with another name=."
    )


def remove_if_unused(folder: Path) -> bool:
    """Delete a run folder that holds nothing but what a launch writes before training
    (the claim, Hydra's .hydra/ and log); True when removed. Anything else: kept."""
    folder = Path(folder)
    try:
        names = {p.name for p in folder.iterdir()}
    except OSError:
        return False
    names = {n for n in names if not RANK_LOG.fullmatch(n)}  # another rank's warnings
    if not names <= LAUNCH_ONLY_FILES or owner(folder) != launch_identity():
        return False
    import shutil

    with contextlib.suppress(OSError):
        shutil.rmtree(folder)
    return not folder.exists()
