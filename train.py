"""fastload: train an image classifier with a selectable data-loading path.

    python train.py                                   # built-in synthetic dataset, CPU or GPU
    python train.py loader=prefetch+bg storage=tmpfs  # pick each stage of the data path
    torchrun --nproc_per_node=8 train.py dataset=imagenet dataset.root=/data/imagenet model=resnet50

Everything else lives in fastload/ (engine, data path) and conf/ (one yaml per variant).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys

import hydra
from hydra.errors import ConfigCompositionException, OverrideParseException
from omegaconf import DictConfig

import fastload.config  # noqa: F401  (registers the run-id resolvers used by conf/config.yaml)
from fastload.errors import hydra_one_line, printed_here, to_log_files, user_error
from fastload.host import global_rank, local_rank


def strip_local_rank_arg() -> None:
    """torch.distributed.launch passes --local-rank=N, which Hydra rejects; torchrun sets
    LOCAL_RANK in the environment instead, so move the flag there."""
    for arg in list(sys.argv[1:]):
        if arg.startswith(("--local_rank=", "--local-rank=")):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
            sys.argv.remove(arg)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    # torch comes in here, not at the top: the spawn pools that generate and pack datasets
    # import this file in every worker, which then starts in a tenth of a second, not seconds.
    from fastload import dist
    from fastload.engine import TrainingInterrupted, fit

    try:
        fit(cfg)
    except TrainingInterrupted as exc:  # every rank stops at the same step; rank 0 says so
        if global_rank() == 0:
            logging.getLogger("fastload").warning(exc.user_message)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt as exc:  # Ctrl-C outside the training loop (generating,
        # packing, ...), or SIGTERM while preparing the data (fastload.host.Terminated)
        signum = getattr(exc, "signum", signal.SIGINT)
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"interrupted ({what}): nothing half-written was kept.", file=sys.stderr)
        sys.exit(128 + signum)
    except Exception as exc:
        # A user error, raised by us or while Hydra built one of our objects (Hydra wraps it):
        # one clear message naming the file or option and the fix, no traceback, exit 2.
        error = user_error(exc)
        if error is None:
            raise
        if printed_here(error):
            print(f"error: {error.user_message}", file=sys.stderr, flush=True)
        to_log_files(f"error: {error.user_message}")
        sys.exit(2)
    finally:
        dist.cleanup()


if __name__ == "__main__":
    # A native crash (a damaged memory-mapped pack, a decoder bug) prints where it happened
    # instead of ending the run without a word.
    faulthandler.enable()
    strip_local_rank_arg()
    # A config Hydra cannot compose (a misspelt option or group choice) would be its own
    # multi-line report, exit 1; raised to here it is one line, exit 2, as every input error.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        main()
    except (ConfigCompositionException, OverrideParseException) as exc:
        cause = str(exc.__cause__ or "").split("\n")[0]  # e.g. "Key 'epoch' is not in struct"
        if local_rank() == 0:  # a node's ranks got one command line: said once per node
            print(f"error: {hydra_one_line(str(exc))}{f' ({cause})' if cause else ''}",
                  file=sys.stderr, flush=True)  # fmt: skip
        sys.exit(2)
