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
    env = {**os.environ, "WANDB_SILENT": "true", "FASTLOAD_CACHE": str(tmp_path / "cache")}
    codes = []
    for args in (["--cfg", "job", "--resolve"], ["trainer.epochs=oops"]):
        served = TRAIN_FORKS.served
        forked = run_train(args, env={"FASTLOAD_CACHE": str(tmp_path / "cache")})
        assert TRAIN_FORKS.served == served + 1, "run_train fell back to a subprocess"
        fresh = subprocess.run([sys.executable, str(REPO / "train.py"), *args], env=env,
                               capture_output=True, text=True, cwd=REPO, timeout=120)  # fmt: skip
        assert (forked.returncode, forked.stdout, forked.stderr) == (
            fresh.returncode, fresh.stdout, fresh.stderr)  # fmt: skip
        codes.append(forked.returncode)
        assert str(tmp_path / "cache") in forked.stdout + forked.stderr or forked.returncode
    assert codes == [0, 2]  # the config printed; a bad number refused with its one line
