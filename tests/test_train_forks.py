"""run_train's fork server (tests/train_forks.py): a forked train.py gives what a fresh
`python train.py` gives, and the suite really uses it (else it silently takes ~2 min more)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO, TRAIN_FORKS, run_train


@pytest.mark.skipif(os.environ.get("FASTLOAD_TEST_FORKS") == "0", reason="forks turned off")
def test_a_forked_run_prints_and_exits_as_a_fresh_process(tmp_path):
    cache = {"FASTLOAD_CACHE": str(tmp_path / "cache")}
    outs = []
    for args in (["--cfg", "job", "--resolve"], ["trainer.epochs=oops"]):
        served = TRAIN_FORKS.served
        forked = run_train(args, env=cache)
        assert TRAIN_FORKS.served == served + 1, "run_train fell back to a subprocess"
        fresh = subprocess.run([sys.executable, str(REPO / "train.py"), *args],
                               env={**os.environ, "WANDB_SILENT": "true", **cache},
                               capture_output=True, text=True, cwd=REPO, timeout=120)  # fmt: skip
        assert (forked.returncode, forked.stdout, forked.stderr) == (
            fresh.returncode, fresh.stdout, fresh.stderr)  # fmt: skip
        outs.append(forked)
    assert [o.returncode for o in outs] == [0, 2]  # the config; a bad number's one line
    assert cache["FASTLOAD_CACHE"] in outs[0].stdout  # the request's environment was used
