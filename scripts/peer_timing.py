"""What the peer loaders' benchmarks (bench_ffcv.py, bench_dali.py) share. They run in the
peers' own environments, where fastload is not installed: this module needs the standard
library only."""

from __future__ import annotations

import json
import sys
import time


def time_epochs(run_epoch, epochs: int) -> list[float]:
    """images/s of every epoch after the first, which is not timed (JIT compilation, thread
    start-up, buffers growing); `run_epoch()` runs one and returns how many images it gave."""
    rates = []
    for epoch in range(epochs):
        t0 = time.perf_counter()
        n = run_epoch()
        if n == 0:  # a rate of 0 would read as a measurement
            print(
                f"error: {sys.argv[0]}: an epoch gave no image: fewer images than --batch-size "
                f"(the last partial batch is dropped)? Give a larger set or a smaller batch.",
                file=sys.stderr,
            )
            sys.exit(2)
        if epoch > 0:
            rates.append(n / (time.perf_counter() - t0))
    return rates


def report(rates: list[float], **facts) -> None:
    """The result line the fastload benches read (the last line printed): the best epoch's
    rate, every timed epoch's, and what the peer says about its run."""
    print(json.dumps({"images_per_s": max(rates), "epochs_images_per_s": rates, **facts}))


def exit_missing(exc: ModuleNotFoundError, peer: str, recipe: str) -> None:
    """Run with a python that lacks the peer (or what it needs): one line naming the module,
    the python and the environment to make (`recipe`, from the script's docstring), exit 2,
    instead of an import traceback. The fastload benches show this line as the peer's error."""
    script = sys.argv[0]
    print(
        f"error: no module {exc.name!r} in {sys.executable}: run {script} with the python of "
        f"an environment that has {peer}, made as `{script} --help` says ({recipe})",
        file=sys.stderr,
    )
    sys.exit(2)
