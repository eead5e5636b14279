"""`python train.py ARGS` (and `python -m torch.distributed.run ...`) for the tests, without
importing torch each time.

Most of a short test run of train.py is the interpreter importing torch (and torch._dynamo),
torchvision and Hydra (~5 s of a core, then a second or two of work). This server imports them once, then
forks a child per request that runs the script (or module) as `__main__` with the request's
argv, environment, working directory and stdin/stdout/stderr: the same code path as a fresh
`python train.py ARGS`, its exit status included, minus the imports. fastload itself is not
imported here, so every run imports it afresh and reads its environment as a new process
does. A torchrun launch comes here too: its agent is forked, and it starts its ranks as
fresh processes, its own children, as the run folder's launch identity expects.

Forking is safe only while no thread but numpy's BLAS pool runs here (OpenBLAS, which every
forking DataLoader also carries through fork, resets itself in the child): no intra-op pool
started, no Python thread. The server checks that before serving and says `unsafe`
otherwise; the callers then start plain processes.

    python tests/train_forks.py SOCKET

Prints {"ready": pid} (or {"unsafe": why}) on stdout, then serves connections on the Unix
socket SOCKET until its stdin closes (the test process that started it is gone). Per
connection, a watcher process: it receives one request, a JSON line {"argv", "env", "cwd"}
with three file descriptors (the child's 0, 1, 2), forks the child, answers {"pid": N},
then {"returncode": R} when the child ends (R as subprocess gives it: negative for a
signal). The caller closing the connection early kills the child and its descendants.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import select
import socket
import sys
import threading

# torch._dynamo: every run imports it when it builds its optimizer (torch.optim's
# _disable_dynamo), ~2 s of a core here.
PRELOAD = ("numpy", "PIL.Image", "torch", "torch._dynamo", "torchvision", "hydra", "omegaconf",
           "yaml", "psutil")  # fmt: skip


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def serve(listener: socket.socket, control) -> tuple[dict, list[int]]:
    """Fork a watcher per connection; returns (request, fds) in the forked child only."""
    while True:
        readable = select.select([listener, control], [], [], 1.0)[0]
        reap()
        if control in readable and not os.read(control.fileno(), 4096):
            os._exit(0)  # the test process is gone
        if listener in readable:
            conn, _ = listener.accept()
            if os.fork() == 0:
                listener.close()
                control.close()
                return watch(conn)
            conn.close()


def reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def watch(conn: socket.socket) -> tuple[dict, list[int]]:
    """The watcher: fork the child, report it, kill it if the caller goes away."""
    message, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)
    while not message.endswith(b"\n"):
        message += conn.recv(1 << 22)
    request = json.loads(message)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        conn.close()
        return request, fds
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            conn.sendall(
                json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n"
            )
            os._exit(0)
        if select.select([conn], [], [], 0.2)[0] and not conn.recv(4096):
            kill_tree(pid)  # the caller is gone (killed, or timed out)


def kill_tree(pid: int) -> None:
    """SIGKILL process `pid` and every process below it, and wait for those below it (the
    caller reaps `pid`, its child). tests/conftest.py uses it too."""
    import psutil

    try:
        tree = psutil.Process(pid).children(recursive=True)
        procs = [psutil.Process(pid), *tree]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=10)


def run(request: dict, fds: list[int]) -> None:
    """In the child: become `cd CWD && ENV python ARGV <&fd0 >&fd1 2>&fd2`."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = list(request["argv"])
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script` sets it
        runpy.run_path(argv[0], run_name="__main__")


def main(path: str) -> tuple[dict, list[int]]:
    # The handshake (stdout) and the control pipe (stdin; EOF: stop) move to fds of their
    # own; 0 becomes /dev/null and 1 stderr, so nothing printed while importing can corrupt
    # the handshake and no child inherits the pipes as its stdio.
    replies = os.fdopen(os.dup(1), "w")
    control = os.fdopen(os.dup(0), "rb", buffering=0)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    import numpy  # noqa: F401  (its BLAS pool: the threads allowed)

    allowed = threads()
    for name in PRELOAD:
        __import__(name)
    if threading.active_count() > 1 or threads() > allowed:
        replies.write(json.dumps({"unsafe": f"{threads()} threads, {allowed} with numpy"}) + "\n")
        replies.flush()
        sys.exit(0)
    # The preloaded modules' objects live as long as any run: out of the collector's sight,
    # a child's full collections (and the last one, at its exit: ~0.8 s) skip them.
    gc.collect()
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    replies.write(json.dumps({"ready": os.getpid()}) + "\n")
    replies.close()
    return serve(listener, control)


if __name__ == "__main__":
    run(*main(sys.argv[1]))
