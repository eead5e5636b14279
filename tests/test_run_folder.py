"""Run folders no two launches share; a checkpoint its live run still writes is not resumed;
resuming a finished run trains nothing and leaves no new folder."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    REPO,
    TRAIN_FORKS,
    compose_config,
    in_other_pid_namespace,
    make_image_folder,
    run_train,
    tiny_overrides,
)
from omegaconf import OmegaConf
from test_train import assert_clean_failure, read_jsonl

from fastload import run_folder
from fastload.errors import CheckpointError, ConfigError

CLAIM = """
import sys, time
from pathlib import Path
from fastload import run_folder
start, path, named_by_us = float(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1"
time.sleep(max(0.0, start - time.time()))  # both processes claim at the same instant
print(run_folder.claim(path, named_by_us), flush=True)
time.sleep(float(sys.argv[4]))
"""


def claimer(path, named_by_us: bool, start: float, hold_s: float = 0.0) -> subprocess.Popen:
    args = [sys.executable, "-c", CLAIM, str(start), str(path), str(int(named_by_us)), str(hold_s)]
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, text=True)


def test_two_launches_landing_on_one_folder_name_get_one_folder_each(tmp_path):
    """The default name is a timestamp to the second: two launches in one second claim it
    at once; one keeps it, the other writes `<name>-1`."""
    path = tmp_path / "x" / "2026-11-24_12-00-00"
    start = time.time() + 1.5
    procs = [claimer(path, True, start) for _ in range(2)]
    got = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert got == [str(path), f"{path}-1"]
    owners = {json.dumps(run_folder.owner(g), sort_keys=True) for g in map(type(path), got)}
    assert len(owners) == 2  # each folder names its own launch


def test_launches_in_two_containers_of_one_host_name_and_pid_get_a_folder_each(tmp_path):
    """`docker run --network host` twice: one host name, each container numbering its own
    pids (train.py often pid 1 in both): the same pid in another PID namespace is another
    launch, which must not write into this one's folder."""
    path = tmp_path / "x" / "2026-11-24_12-00-00"
    args = (str(time.time()), str(path), "1", "60")
    other = in_other_pid_namespace(CLAIM, *args, pid=os.getpid())
    try:
        assert other.stdout.readline().strip() == str(path)
        assert run_folder.claim(path, named_by_us=True) == path.with_name(f"{path.name}-1")
    finally:
        other.kill()
        other.wait()
    theirs, mine = run_folder.owner(path), run_folder.launch_identity()
    assert theirs["pid"] == mine["pid"] and theirs["host"] == mine["host"]
    assert theirs["launch"] != mine["launch"] and not run_folder.alive(theirs)


def test_a_claims_temporary_file_is_named_by_pid_namespace_too(tmp_path, monkeypatch):
    """Two containers of one host name, each train.py pid 1, claiming one folder in the
    same second wrote the same temporary file: one published the other's identity, or
    failed with a traceback when the other removed it first."""
    from fastload.host import process_space

    linked = []
    real_link = os.link
    monkeypatch.setattr(run_folder.os, "link", lambda a, b: linked.append(a) or real_link(a, b))
    assert run_folder.claim(tmp_path / "run", named_by_us=True) == tmp_path / "run"
    assert [Path(p).name for p in linked] == [
        f"{run_folder.MARKER}.tmp-{process_space()}-{os.getpid()}"
    ]


def test_a_launch_keeps_its_folder_and_a_named_folder_is_not_shared_with_a_live_run(tmp_path):
    path = tmp_path / "run"
    me = run_folder.launch_identity()
    assert run_folder.claim(path, named_by_us=True) == path
    assert run_folder.claim(path, named_by_us=True) == path  # another rank of this launch
    holder = claimer(tmp_path / "named", False, 0.0, hold_s=60)
    try:
        assert holder.stdout.readline().strip() == str(tmp_path / "named")
        with pytest.raises(ConfigError, match=f"pid {holder.pid} on {me['host']}"):
            run_folder.claim(tmp_path / "named", named_by_us=False)
    finally:
        holder.kill()
        holder.wait()
    # its owner gone, a folder named on the command line is taken over (a run continued there)
    assert run_folder.claim(tmp_path / "named", named_by_us=False) == tmp_path / "named"
    assert run_folder.owner(tmp_path / "named") == me


def test_a_reused_launch_id_does_not_write_over_the_earlier_runs_results(tmp_path, monkeypatch):
    """A multi-node launch is named by its --rdzv-id (or FASTLOAD_RUN_ID): a second launch
    that reuses the id gets `<name>-1` once the first one's folder holds results, and all
    its ranks agree on it; a torchrun restart of the launch goes on in its own folder."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    path = tmp_path / "x" / "torchrun-job7"
    assert run_folder.claim(path, named_by_us=True) == path
    (path / "train.rank1.log").write_text("")  # a rank's log is not a result...
    assert run_folder.claim(path, named_by_us=True) == path  # ...: another rank, same launch
    (path / "metrics.jsonl").write_text('{"epoch": 0}\n')  # the first launch trained
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert run_folder.claim(path, named_by_us=True) == path  # its restart continues there
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # a new launch, the id reused
    second = path.with_name("torchrun-job7-1")
    assert run_folder.claim(path, named_by_us=True) == second  # its first rank
    assert run_folder.claim(path, named_by_us=True) == second  # and every other
    assert (path / "metrics.jsonl").read_text() == '{"epoch": 0}\n'
    assert run_folder.claim(path, named_by_us=False) == path  # hydra.run.dir=: as asked


def test_a_sweep_whose_folder_another_live_launch_holds_runs_its_jobs_in_its_own(
    tiny_folder, tmp_path
):
    """Two `train.py -m` launches in one second: the second's sweep folder is `<stamp>-1`,
    and every job of it runs there (Hydra composes each job's config again)."""
    out = tmp_path / "out"
    stamp = out / "multirun" / "sweep7"
    holder = claimer(stamp, True, 0.0, hold_s=120)  # the first launch, still running
    try:
        assert holder.stdout.readline().strip() == str(stamp)
        args = tiny_overrides(tiny_folder, tmp_path / "unused", "trainer.epochs=1")
        args = [a for a in args if not a.startswith(("hydra.run.dir=", "output_root="))]
        got = run_train(["-m", *args, f"output_root={out}", "seed=0,1"],
                        env={"FASTLOAD_RUN_ID": "sweep7"})  # fmt: skip
        # a job of the live sweep: resuming its checkpoint is refused, as a live run's
        with pytest.raises(CheckpointError, match=f"pid {holder.pid}"):
            run_folder.check_not_held(stamp / "0" / "checkpoints" / "last.pt")
    finally:
        holder.kill()
        holder.wait()
    assert got.returncode == 0, got.stderr[-3000:]
    own = stamp.with_name("sweep7-1")
    assert sorted(p.name for p in stamp.iterdir()) == [run_folder.MARKER]  # not written in
    for job in ("0", "1"):
        assert len(read_jsonl(own / job / "metrics.jsonl")) == 1
    assert run_folder.owner(own)["launch"] == "env:sweep7"


def test_concurrent_runs_of_one_name_write_separate_folders(tiny_folder, tmp_path):
    """`python train.py name=x` twice at once: each run its own folder, its own rows."""
    args = tiny_overrides(tiny_folder, tmp_path / "unused", "name=x", "trainer.epochs=2")
    args = [a for a in args if not a.startswith("hydra.run.dir=")]  # the default run id
    args = [*args, f"output_root={tmp_path / 'out'}"]
    logs = [(tmp_path / f"out{k}.txt", tmp_path / f"err{k}.txt") for k in range(2)]
    env = {**os.environ, "WANDB_SILENT": "true"}
    with contextlib.ExitStack() as stack:
        procs = []
        for out, err in logs:  # started together, each the way run_train starts one
            files = [stack.enter_context(open(p, "w")) for p in (out, err)]  # noqa: SIM115
            cmd = [sys.executable, str(REPO / "train.py"), *args]
            procs.append(TRAIN_FORKS.popen(cmd, env, REPO, *files))
        for p, (_, err) in zip(procs, logs, strict=True):
            assert p.wait(timeout=300) == 0, err.read_text()[-3000:]
    folders = sorted((tmp_path / "out" / "x").iterdir())
    assert len(folders) == 2
    for folder in folders:
        assert [r["epoch"] for r in read_jsonl(folder / "metrics.jsonl")] == [0, 1]
        assert json.loads((folder / "summary.json").read_text())["run_dir"] == str(folder)


def test_resuming_a_checkpoint_its_live_run_writes_is_refused_then_a_finished_run_is_said(
    tmp_path,
):
    root = make_image_folder(tmp_path / "d")
    name = "synthetic-resnet18-turbo-disk-baseline"
    first = tmp_path / "out" / name / "first"
    out = run_train(tiny_overrides(root, first, "trainer.epochs=1"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert (first / "checkpoints" / "last.pt").is_file()

    # the first run's folder, claimed again by a live process (as if it were still training)
    holder = claimer(first, False, 0.0, hold_s=120)
    try:
        holder.stdout.readline()
        second = tmp_path / "out" / name / "second"
        out = run_train(tiny_overrides(root, second, "trainer.epochs=1", "resume=auto"))
        assert_clean_failure(out, f"pid {holder.pid}", str(first), "still running")
    finally:
        holder.kill()
        holder.wait()

    # the holder gone: the run it held had trained all its epochs; nothing is made
    third = tmp_path / "out" / name / "third"
    out = run_train(tiny_overrides(root, third, "trainer.epochs=1", "resume=auto"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "nothing left to train" in out.stdout and "resume=null" in out.stdout
    assert "best top-1" not in out.stdout  # no old table reprinted
    assert not third.exists()

    # a fresh run given the finished run's folder (hydra.run.dir=): refused, nothing replaced
    kept = {f: (first / f).read_bytes() for f in ("metrics.jsonl", "summary.json")}
    out = run_train(tiny_overrides(root, first, "trainer.epochs=1"))
    assert_clean_failure(out, f"the run directory {first} holds a run's results",
                         f"resume={first / 'checkpoints' / 'last.pt'}")  # fmt: skip
    assert out.returncode == 2
    assert {f: (first / f).read_bytes() for f in kept} == kept


def test_a_folder_with_results_is_trained_in_only_by_the_run_that_continues_it(
    tmp_path, monkeypatch
):
    from fastload.engine import keep_results

    folder = tmp_path / "run"
    keep_results(folder, None)  # not there yet: a fresh run's own
    (folder / ".hydra").mkdir(parents=True)
    (folder / "train.log").write_text("")
    keep_results(folder, None)  # what a launch writes before training is no result
    (folder / "metrics.jsonl").write_text('{"epoch": 0}\n')
    with pytest.raises(ConfigError, match="a fresh run here would replace them"):
        keep_results(folder, None)
    elsewhere = tmp_path / "other" / "checkpoints" / "last.pt"
    with pytest.raises(ConfigError, match=f"resume= continues {elsewhere}, whose history"):
        keep_results(folder, (elsewhere, {}))
    keep_results(folder, (folder / "checkpoints" / "last.pt", {}))  # the run continued there
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    keep_results(folder, None)  # a restart of the launch that wrote them


@pytest.mark.parametrize("rank, local", [("0", "0"), ("3", "1"), ("2", "0")])
def test_each_rank_logs_to_its_own_file_and_other_ranks_warnings_only(monkeypatch, tmp_path, rank,
                                                                       local):  # fmt: skip
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", local)  # rank 2, local 0: the second node's first rank
    # hydra.job.name: what train.py runs as (compose says "app")
    args = tiny_overrides(tmp_path, tmp_path / "run", "hydra.job.name=train")
    cfg = compose_config(args, run_dir=tmp_path / "run")
    spec = OmegaConf.to_container(cfg.hydra.job_logging, resolve=True)
    handler = spec["handlers"]["file"]
    assert spec["root"]["level"] == ("INFO" if local == "0" else "WARNING")
    if rank == "0":
        assert handler["delay"] is False
        assert handler["filename"] == f"{tmp_path / 'run'}/train.log"
    else:
        assert handler["delay"] is True
        assert handler["filename"] == f"{tmp_path / 'run'}/train.rank{rank}.log"
    # a rank that never writes leaves no file (the handler as Hydra builds it from the spec)
    handler = logging.FileHandler(handler["filename"], delay=handler["delay"])
    run = tmp_path / "run"
    assert (run / "train.log").is_file() == (rank == "0")
    handler.emit(logging.makeLogRecord({"msg": "a rank's own warning", "levelno": 30}))
    handler.close()
    assert [p.name for p in run.glob("train*.log")] == [Path(handler.baseFilename).name]
    assert run_folder.RANK_LOG.fullmatch("train.rank3.log") and not run_folder.RANK_LOG.fullmatch(
        "train.log"
    )


def test_an_output_root_that_is_a_file_is_said_to_be_one(tmp_path, capsys):
    from fastload.config import CheckRunDir

    taken = tmp_path / "outputs"
    taken.write_text("not a folder")
    with pytest.raises(SystemExit) as stop:
        CheckRunDir._check(str(taken / "name" / "run"))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and f"({taken} is a file, not a folder)" in err
