"""`python train.py ARGS` for the tests, without importing torch each time.

Most of a short test run of train.py is the interpreter importing torch, torchvision and
Hydra (~5 s of a core, then ~1 s of training). This process imports them once, then forks a
child per request that runs train.py as `__main__` with the request's argv, environment,
working directory and output files: the same code path as `python train.py ARGS > out 2>
err`, its exit status included, minus the imports. fastload itself is not imported here, so
every run imports it afresh and reads its environment as a new process does.

Forking is safe only while no thread but numpy's BLAS pool runs here (OpenBLAS, which
every forking DataLoader also carries through fork, resets itself in the child): no
intra-op pool started, no Python thread. It checks that before serving and says `unsafe`
otherwise; the caller (tests/conftest.py `run_train`) then starts a plain subprocess.

Protocol, one JSON object per line: the caller writes {"argv", "env", "cwd", "out", "err"}
on our stdin; we answer {"pid": N} once the child runs, then {"returncode": R} when it ends
(R as subprocess gives it: negative for a signal). EOF on stdin ends this process.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading

PRELOAD = ("numpy", "PIL.Image", "torch", "torchvision", "hydra", "omegaconf", "yaml")


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def serve(requests, replies) -> dict:
    """Fork a child per request and report it; returns the request in the child only."""
    for line in requests:
        if not line.strip():
            continue
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            return request
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()
    os._exit(0)


def run(request: dict) -> None:
    """In the child: become `cd CWD && ENV python train.py ARGV < /dev/null > OUT 2> ERR`."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python train.py` sets it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    # The protocol gets fds of its own; 0 and 1 become /dev/null and stderr, so nothing
    # printed while importing can corrupt it.
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    import numpy  # noqa: F401  (its BLAS pool: the threads allowed)

    allowed = threads()
    for name in PRELOAD:
        __import__(name)
    if threading.active_count() > 1 or threads() > allowed:
        unsafe = f"{threads()} threads, {allowed} after importing numpy"
        replies.write(json.dumps({"unsafe": unsafe}) + "\n")
        replies.flush()
        sys.exit(0)
    replies.write(json.dumps({"ready": os.getpid()}) + "\n")
    replies.flush()
    run(serve(requests, replies))
