"""Shared fixtures: the real Hydra config, composed and shrunk; tiny image folders in tmp;
train.py launched as a user launches it (python, torchrun, two torchrun "nodes"); a local
web server."""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import queue
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict
from PIL import Image
from train_forks import kill_tree as kill_tree_of

import fastload.config  # noqa: F401  (resolvers)

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"


def pytest_configure(config):
    """Under pytest-xdist, each worker (and every train.py it starts: they inherit the
    environment) gets usable cores / workers intra-op threads, not all of them: 16 workers on
    16 cores otherwise ran 16 threads each, and CPU-bound tests ran past their timeouts. An
    OMP_NUM_THREADS set by the caller is kept. torch reads it at its first parallel op; no
    test module has imported torch yet."""
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // workers))


def pytest_collection_modifyitems(config, items):
    """The minutes-long tests (slow, cuda) run first, the rest in their order after: on a
    16-core GPU machine under `-n 16 --dist load`, a slow test collected last ran alone at the
    end while the other workers sat idle."""

    def long(item) -> bool:
        return any(any(item.iter_markers(name=m)) for m in ("slow", "cuda"))

    items.sort(key=lambda item: not long(item))  # stable: the order within each part stays


def make_image_folder(root: Path, classes=("cat", "dog", "eel"), per_split=(6, 3), size=(96, 72)):
    """A tiny ImageFolder tree of JPEGs whose colour depends on the class."""
    rng = np.random.default_rng(0)
    for split, n in zip(("train", "val"), per_split, strict=True):
        for ci, cls in enumerate(classes):
            d = root / split / cls
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                base = np.zeros((size[1], size[0], 3), np.uint8)
                base[..., ci % 3] = 180
                noise = rng.integers(0, 60, base.shape, dtype=np.uint8)
                Image.fromarray(base + noise).save(d / f"{cls}_{i:03d}.jpg", quality=90)
    return root


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("data") / "tiny")


def tiny_overrides(root: Path, run_dir: Path, *extra: str) -> list[str]:
    """Shrink the real config (data, crops, batch, epochs, the model: small_model) to seconds
    on 2 CPU cores. trainer.device=cpu: these runs test the application's logic (bit-exact
    resume, gloo DDP, messages) the same way on a GPU machine; the cuda-marked tests train
    on the GPU."""
    return [
        "trainer.device=cpu",
        *small_model(extra),
        f"dataset.root={root}",
        "dataset.prepare=null",
        "dataset.num_classes=3",
        "dataset.train_transform.size=32",
        "dataset.val_transform.size=32",
        "dataset.val_transform.resize=36",
        "trainer.epochs=2",
        "trainer.batch_size=4",
        "trainer.progress=false",
        "loader.num_workers=0",
        "logger=none",
        f"hydra.run.dir={run_dir}",
        f"output_root={run_dir.parent.parent}",
        *extra,
    ]


# Overrides that pick or shape the model themselves (another model, another task's dataset,
# an experiment): those runs keep the model the config names.
OWN_MODEL = ("model=", "model.", "dataset=", "experiment=")


def small_model(extra) -> list[str]:
    """The default ResNet-18 of a tiny run, shrunk (tests.helpers.build_small_resnet): a step
    takes ~10 ms on a CPU core instead of ~110 ms, and what the tests check (resume, DDP,
    messages, learning) does not depend on the width. The product's own ResNets are built by
    the runs that name a model and by test_model_weights.py."""
    if any(o.lstrip("+~").startswith(OWN_MODEL) for o in extra):
        return []
    return ["model._target_=tests.helpers.build_small_resnet"]


def compose_config(overrides: list[str], run_dir: Path | None = None):
    """The real config as `python train.py <overrides>` would see it, with HydraConfig set
    so that engine code reading HydraConfig works in-process."""
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(run_dir)
        HydraConfig.instance().set_config(cfg)
    return cfg


def resolve_all(cfg) -> dict:
    """Every value but Hydra's, resolved: catches typos in interpolations and missing keys."""
    from omegaconf import OmegaConf

    return {
        k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
        for k in cfg
        if k != "hydra"
    }


def build_test_loader(
    *overrides: str,
    folder: Path | None = None,
    split: str = "train",
    batch_size: int = 4,
    seed: int = 0,
    device="cpu",
    channels_last: bool = False,
    **kw,
):
    """A loader from the real config through the one builder (fastload/pipeline.py): the
    image folder `folder` with 24 px crops, or a custom `dataset` (kw, with `collate_fn`)."""
    from fastload.pipeline import build_loader, build_plan

    base = [f"dataset.root={folder}"] if folder is not None else []
    base += [
        "dataset.prepare=null",
        "dataset.train_transform.size=24",
        "dataset.val_transform.size=24",
        "dataset.val_transform.resize=27",
        f"trainer.batch_size={batch_size}",
        f"seed={seed}",
    ]
    cfg = compose_config([*base, *overrides])
    parts = {k: kw.pop(k) for k in ("storage", "backend") if k in kw}  # built already
    plan = build_plan(cfg, **parts)
    return build_loader(plan, split, device=device, channels_last=channels_last, **kw)


@functools.cache
def can_mount_privately() -> bool:
    """Whether this machine lets a test mount in a private mount namespace (root with
    unshare): a small /dev/shm, a read-only dataset folder, as in a container."""
    probe = ["unshare", "-m", "--propagation", "private", "sh", "-c",
             "mount -t tmpfs -o size=1m tmpfs /dev/shm"]  # fmt: skip
    try:
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


NOBODY = 65534


def as_another_user(tmp_path, code: str, *args: str) -> subprocess.CompletedProcess:
    """`python -c code args` as uid/gid nobody, with tmp_path/pub (root's own, 0755) at /media
    in a private mount namespace: tmp_path itself is root's alone (0700). Skips where that
    cannot be done (not root, no unshare -m or setpriv)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None or not can_mount_privately():
        pytest.skip("needs root, unshare -m and setpriv")
    pub = tmp_path / "pub"
    pub.mkdir(exist_ok=True)
    pub.chmod(0o755)
    drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    script = f'mount --bind "$0" /media && exec {" ".join(drop)} "$@"'
    return subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(pub),
         sys.executable, "-c", code, *args],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip


def in_other_pid_namespace(code: str, *args: str, pid: int) -> subprocess.Popen:
    """`python -c code args` as pid `pid` of a new PID namespace on this host (as in a
    container of the same host name); skips the test where unshare is not allowed."""
    probe = ["unshare", "--pid", "--fork", "--mount-proc", "true"]
    try:
        allowed = subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        allowed = False
    if not allowed:
        pytest.skip("needs unshare --pid (root)")
    # the namespace's first process is sh (pid 1); the next pid it hands out is ns_last_pid + 1
    # (python is forked, not exec'd: a command after it keeps sh from exec'ing it)
    script = f'echo {pid - 1} > /proc/sys/kernel/ns_last_pid && "$0" "$@"; exit $?'
    cmd = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c", script,
           sys.executable, "-c", code, *args]  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)


def run_train(args: list[str], *, env=None, timeout=300, cwd=REPO) -> subprocess.CompletedProcess:
    """`python train.py ARGS`, as a user runs it: a child of tests/train_forks.py, which has
    torch imported already (FASTLOAD_TEST_FORKS=0: a plain subprocess each time)."""
    full_env = {**os.environ, "WANDB_SILENT": "true", **(env or {})}
    return TRAIN_FORKS.run([sys.executable, str(REPO / "train.py"), *args], full_env, cwd, timeout)


class ForkedProcess:
    """A child of the fork server, as much of a subprocess.Popen as the tests use."""

    def __init__(self, args, conn: socket.socket):
        self.args, self.conn, self.buffer, self.returncode = args, conn, b"", None
        self.pid = self.read(60)["pid"]

    def read(self, timeout: float | None) -> dict:
        end = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = None if end is None else max(0.0, end - time.monotonic())
            if not select.select([self.conn], [], [], left)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            chunk = self.conn.recv(4096)
            if not chunk:  # the server is gone, and the child with it
                return {"returncode": -signal.SIGKILL}
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.read(timeout)["returncode"]
            self.conn.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None


class TrainForks:
    """This test process's fork server (tests/train_forks.py), started on first use (again if
    it died). Where it cannot serve (FASTLOAD_TEST_FORKS=0, or it found forking unsafe),
    processes start plainly."""

    def __init__(self):
        self.server: subprocess.Popen | None = None
        self.socket = ""
        self.off = os.environ.get("FASTLOAD_TEST_FORKS", "1") == "0"
        self.served = 0  # processes started by a fork (tests/test_train_forks.py counts them)
        self.lock = threading.Lock()

    def available(self) -> bool:
        with self.lock:
            if self.off or (self.server is not None and self.server.poll() is None):
                return not self.off
            self.socket = os.path.join(tempfile.mkdtemp(prefix="train-forks-"), "socket")
            script = [sys.executable, str(REPO / "tests" / "train_forks.py"), self.socket]
            self.server = subprocess.Popen(
                script, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO
            )
            ready = select.select([self.server.stdout], [], [], 120)[0]
            reply = json.loads(self.server.stdout.readline() or "{}") if ready else {}
            if "ready" not in reply:  # e.g. {"unsafe": "3 threads, 2 with numpy"}
                self.off = True
                self.server.kill()
            atexit.register(self.close, self.server, os.path.dirname(self.socket))
            return not self.off

    @staticmethod
    def close(server: subprocess.Popen, folder: str) -> None:
        """At this test process's exit: EOF on the server's stdin ends it."""
        server.stdin.close()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        server.stdout.close()
        shutil.rmtree(folder, ignore_errors=True)

    def popen(self, cmd, env, cwd, stdout, stderr) -> subprocess.Popen | ForkedProcess:
        """`cmd` (sys.executable and its arguments) with stdout/stderr to these open files."""
        if not self.available():
            return subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env, cwd=cwd)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.socket)
        request = {"argv": cmd[1:], "env": env, "cwd": str(cwd)}
        with open(os.devnull, "rb") as null:
            fds = [null.fileno(), stdout.fileno(), stderr.fileno()]
            socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], fds)
        self.served += 1
        return ForkedProcess(cmd, conn)

    def run(self, cmd, env, cwd, timeout) -> subprocess.CompletedProcess:
        """subprocess.run(cmd, capture_output=True, text=True, ...), forked where it can be."""
        if not self.available():
            return subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
            )
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = self.popen(cmd, env, cwd, out, err)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                kill_tree_of(proc.pid)
                proc.wait()
                raise
            finally:
                out.seek(0)
                err.seek(0)
            return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())


TRAIN_FORKS = TrainForks()


def run_gloo_ranks(target, tmp_path: Path, world: int = 2, messages: int = 1) -> list:
    """`target(rank, world, init, tmp_path, out)` in `world` spawned processes that join one
    gloo group at `init` and put `messages` results each on `out`: the results, in the order
    they came, once every process exited cleanly."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=target, args=(r, world, init, tmp_path, out))
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    results, deadline = [], time.monotonic() + 240
    while len(results) < messages * world:
        try:
            results.append(out.get(timeout=0.5))
        except queue.Empty:  # a rank that raised puts nothing: fail, do not wait forever
            dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                why = f"rank: exit code {dead}" if dead else "timed out"
                raise AssertionError(f"gloo ranks failed ({why}); tracebacks in stderr") from None
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return results


def _in_gloo_group(fn, rank: int, world: int, init: str, tmp_path: Path, out) -> None:
    import datetime

    import torch.distributed as torch_dist

    from fastload.dist import DistContext

    torch_dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                  timeout=datetime.timedelta(seconds=60))  # fmt: skip
    try:
        out.put((rank, fn(DistContext(rank=rank, world_size=world))))
    finally:
        torch_dist.destroy_process_group()


def on_gloo_ranks(fn, tmp_path: Path, world: int = 2) -> dict:
    """`fn(ctx)` (a module-level function) on `world` ranks of one gloo group: {rank: what
    it returned there}."""
    return dict(run_gloo_ranks(functools.partial(_in_gloo_group, fn), tmp_path, world))


def run_torchrun(root: Path, workdir: Path, *extra: str, nproc: int = 2, timeout=300, env=None,
                 launcher: tuple[str, ...] = ()):  # fmt: skip
    """`torchrun --standalone --nproc_per_node=N [launcher args] train.py` on tiny data (gloo
    on CPU); the run directory is left to the config (output_root/name/<launch time>) so
    ranks must agree. `env`: extra environment variables."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *launcher,
        str(REPO / "train.py"),
        *launch_overrides(root, workdir, extra),
        *extra,
    ]
    return TRAIN_FORKS.run(cmd, launch_env(env), workdir, timeout)


def launch_env(extra: dict | None = None) -> dict:
    """This environment for a torchrun launch: without the variables of a launch around
    this one (a suite run under torchrun or Slurm), plus `extra`."""
    skip = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_RUN_ID", "FASTLOAD_RUN_ID")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in skip}
    return {**env, "PYTHONPATH": str(REPO), "WANDB_SILENT": "true", **(extra or {})}


def launch_overrides(root: Path, workdir: Path, extra=(),
                     skip=("hydra.run.dir", "output_root")) -> list[str]:  # fmt: skip
    """The tiny overrides of a command that passes `extra` after them, without those that
    start with `skip`: by default the run directory, which the config names (output_root/
    name/<launch id>) so that every rank agrees on it."""
    return [
        o
        for o in tiny_overrides(root, workdir / "unused", *extra)
        if o not in extra and not o.startswith(skip)
    ]


# -- two nodes on this machine ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_nodes(
    root: Path,
    workdir: Path,
    *extra: str,
    per_node=lambda k: (),
    rdzv_id: str | None = "two-nodes",
    nproc: int = 2,
    timeout: float = 240,
    grace: float = 30,
) -> list[subprocess.CompletedProcess]:
    """Two torchrun launches on this machine acting as the two nodes of one job, as on a
    cluster: `--nnodes=2 --node-rank=K --nproc-per-node=N`, c10d rendezvous on a free local
    port (rdzv_id=None: static rendezvous on a master port), started together; gloo on CPU. Both get the tiny overrides and `extra` (an
    output_root there is shared, like a shared file system); node K's command line ends with
    `per_node(K)`: its node-local folders. Waits up to `timeout` s (once a node has failed,
    the other, left waiting in a collective, gets `grace` s more), then kills what is left
    (each launch's agent and ranks). Returns one CompletedProcess per
    node (its output also stays in workdir/launch/); a killed one has a negative returncode
    and says so at the end of its stderr."""
    env, overrides = launch_env(), launch_overrides(root, workdir, extra)
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
              f"--nproc-per-node={nproc}"]  # fmt: skip
    if rdzv_id is None:  # static rendezvous: --master-addr/--master-port, no id
        launch += [
            "--rdzv-backend=static",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
        ]
    else:
        launch += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
                   f"--rdzv-id={rdzv_id}"]  # fmt: skip
    cmds = [
        [*launch, f"--node-rank={k}", str(REPO / "train.py"), *overrides, *extra, *per_node(k)]
        for k in range(2)
    ]
    logs = workdir / "launch"
    logs.mkdir(parents=True, exist_ok=True)
    outs = [(logs / f"node{k}.out", logs / f"node{k}.err") for k in range(2)]
    with contextlib.ExitStack() as stack:
        procs = []
        for cmd, (out, err) in zip(cmds, outs, strict=True):
            files = [stack.enter_context(open(p, "w")) for p in (out, err)]  # noqa: SIM115
            procs.append(TRAIN_FORKS.popen(cmd, env, workdir, files[0], files[1]))
            stack.callback(kill_tree, procs[-1])
        killed = wait_both(procs, timeout, grace)
    results = []
    for cmd, p, (out, err) in zip(cmds, procs, outs, strict=True):
        stderr = err.read_text()
        if p in killed:
            stderr += f"\n[run_two_nodes: killed ({timeout:g} s, or {grace:g} s after a failure)]"
        results.append(subprocess.CompletedProcess(cmd, p.returncode, out.read_text(), stderr))
    return results


def wait_both(procs: list[subprocess.Popen], timeout: float, grace: float) -> list:
    """Wait until both exit, at most `timeout` s, or `grace` s after one failed; returns
    those still running (to be killed)."""
    end, failed = time.monotonic() + timeout, False
    while any(p.poll() is None for p in procs) and time.monotonic() < end:
        if not failed and any(p.returncode for p in procs):
            failed, end = True, min(end, time.monotonic() + grace)
        time.sleep(0.2)
    return [p for p in procs if p.poll() is None]


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a torchrun launch: its agent and every process below it (the agent starts
    each rank in a session of its own, so its process group alone would miss them)."""
    if proc.poll() is not None:
        return
    kill_tree_of(proc.pid)
    proc.wait()


def tails(nodes: list[subprocess.CompletedProcess], chars: int = 2500) -> str:
    """For an assertion message: each node's `error:` lines (fastload's one-line message,
    often far above the tracebacks of the ranks that lost their peer), then the end of its
    stdout and stderr."""
    parts = []
    for k, n in enumerate(nodes):
        errors = [line for line in n.stderr.splitlines() if line.startswith("error:")]
        parts += [
            f"--- node {k} (exit {n.returncode}) errors: {errors}",
            f"--- node {k} stdout:\n{n.stdout[-chars:]}",
            f"--- node {k} stderr:\n{n.stderr[-chars:]}",
        ]
    return "\n".join(parts)


# -- a local web server (storage=webdataset over HTTP) ---------------------------------------


def wait_for_port(port: int, proc, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, "the server exited"
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(port)


NGINX_CONF = """
daemon off; worker_processes 1; {user}
pid {d}/nginx.pid; error_log {d}/error.log;
events {{ worker_connections 64; }}
http {{
  access_log {log}; client_body_temp_path {d}/body; proxy_temp_path {d}/proxy;
  fastcgi_temp_path {d}/fcgi; uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;
  server {{ listen 127.0.0.1:{port}; root {root}; }}
}}
"""


@contextlib.contextmanager
def web_server(folder: Path, workdir: Path):
    """Serve `folder` over HTTP on a free port: nginx when installed, else Python's threaded
    http.server. Yields (base URL, process, access log); both log "GET /path HTTP/1.1" 200."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "access.log"
    if shutil.which("nginx"):
        user = "user root;" if os.geteuid() == 0 else ""  # tmp_path is private to root
        conf = workdir / "nginx.conf"
        conf.write_text(NGINX_CONF.format(user=user, d=workdir, log=log, port=port, root=folder))
        cmd = ["nginx", "-c", str(conf), "-p", str(workdir)]
        err = open(workdir / "stderr.log", "w")  # noqa: SIM115
    else:
        cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
        cmd += ["--directory", str(folder)]
        err = open(log, "w")  # noqa: SIM115 (http.server logs each request to stderr)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_for_port(port, proc)
        yield f"http://127.0.0.1:{port}", proc, log
    finally:
        proc.terminate()
        proc.wait(10)
        err.close()


def gets(log: Path) -> Counter:
    """GET requests per path in the server's access log."""
    return Counter(re.findall(r'"GET (\S+) HTTP', log.read_text()))
