"""End to end: `python train.py` as users run it, on tiny data in tmp_path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, make_image_folder, run_torchrun, run_train, tiny_overrides

from fastload import checkpoint as ckpt
from fastload.decode import roi_decoders

EPOCH_KEYS = {
    "epoch",
    "train_loss",
    "train_acc1",
    "val_loss",
    "val_acc1",
    "val_acc5",
    "lr",
    "epoch_time_s",
    "images_per_s",
    "data_wait_s",
    "data_wait_share",
    "compute_s",
    "gpu_util_mean",
    "gpu_util_p10",
    "cpu_percent",
    "peak_pss_mib",
    "peak_rss_sum_mib",
    "eval_time_s",
    "decoder",
    "world_size",
}


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_clean_failure(out, *needles):
    assert out.returncode != 0, out.stdout + out.stderr
    text = out.stdout + out.stderr
    for needle in needles:
        assert needle in text, text
    assert "Traceback" not in text, text


def test_short_run_learns_and_writes_every_artifact(tiny_folder, tmp_path):
    run_dir = tmp_path / "run"
    out = run_train(
        tiny_overrides(  # the product's ResNet-18 here, not the tests' small one
            tiny_folder,
            run_dir,
            "model=resnet18",
            "trainer.epochs=4",
            "logger=wandb",
            "loader.num_workers=2",
        ),  # fmt: skip
        env={
            "WANDB_DIR": str(tmp_path),
            "WANDB_CONFIG_DIR": str(tmp_path / "cfg"),
            "WANDB_CACHE_DIR": str(tmp_path / "cache"),
        },
    )
    assert out.returncode == 0, out.stderr
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [0, 1, 2, 3]
    assert EPOCH_KEYS <= set(rows[0]), EPOCH_KEYS - set(rows[0])
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert all(0 < r["data_wait_share"] < 1 and r["images_per_s"] > 0 for r in rows)
    assert rows[0]["gpu_util_mean"] is None  # trainer.device=cpu: null, not a made-up number
    # two workers share most pages with the main process: PSS counts them once
    assert 100 < rows[0]["peak_pss_mib"] < rows[0]["peak_rss_sum_mib"]
    # backend=turbo, the default: ROI decode with the first region decoder that loads
    status = roi_decoders.status()
    if "" in status.values():
        first = next(k for k in roi_decoders.KINDS if status[k] == "")
        prefix = {"libjpeg": "libjpeg-turbo-3.", "nvimgcodec": "nvimgcodec-"}[first]
        assert rows[0]["decoder"].startswith(prefix), rows[0]["decoder"]
        assert all(r["decode_roi"] > 0 for r in rows), [r.get("decode_roi") for r in rows]
    else:
        assert rows[0]["decoder"].startswith("simplejpeg"), rows[0]["decoder"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epochs"] == 4 and summary["best_acc1"] == max(r["val_acc1"] for r in rows)
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert (run_dir / "checkpoints" / "last.pt").is_file()
    # the weights of the best evaluation, to use: the last epoch's exactly when it was the best
    best = ckpt.load(run_dir / "checkpoints" / "best.pt")
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    accs = [r["val_acc1"] for r in rows]
    assert best["epoch"] == accs.index(max(accs)) and best["value"] == summary["best_acc1"]
    assert best["kind"] == "weights" and best["metric"] == "val_acc1" and "optimizer" not in best
    same = all(torch.equal(best["model"][k], v) for k, v in last["model"].items())
    assert same == (best["epoch"] == 3)
    assert not (run_dir / "checkpoints" / "best_ema.pt").exists()  # no trainer.ema
    # W&B offline run inside the run directory, the sync command printed in the end table.
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, list(run_dir.rglob("*"))
    assert f"wandb sync {offline[0]}" in out.stdout and summary["wandb_sync"]
    assert "best top-1" in out.stdout.lower() or "best_acc1" in out.stdout


def test_a_wandb_start_failure_is_in_train_log_summary_and_table(tiny_folder, tmp_path):
    """A W&B that failed to start was a Python warning on stderr only: train.log had no
    word of it, summary.json said "wandb_sync": null and the table "W&B  n/a", as for
    logger=none. (An invalid project name makes wandb.init fail at once, offline too.)"""
    run_dir = tmp_path / "run"
    out = run_train(
        tiny_overrides(tiny_folder, run_dir, "trainer.epochs=1", "logger=wandb",
                       "logger.project=a/b"),
        env={"WANDB_DIR": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path / "cfg"),
             "WANDB_CACHE_DIR": str(tmp_path / "cache")},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        "W&B init failed (UsageError: Invalid project name 'a/b'"
        in (run_dir / "train.log").read_text()
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["wandb_error"].startswith("init failed (UsageError: Invalid project name")
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("W&B ")]
    assert row.split(None, 1)[1].startswith("failed: init failed (UsageError: Invalid project"), row


def test_sigterm_in_an_epochs_last_step_writes_the_checkpoint_it_reports(tiny_folder, tmp_path):
    """A signal that lands in an epoch's last step (or during its evaluation) is seen after
    the epoch; with trainer.checkpoint_every=2 no checkpoint was due there, so the stop
    writes one instead of naming a file that does not exist."""
    run_dir = tmp_path / "out" / "s" / "r"
    out = run_train(
        tiny_overrides(tiny_folder, run_dir, "trainer.epochs=3", "trainer.checkpoint_every=2",
                       "storage._target_=tests.helpers.SigtermAfterReads"),
        env={"SIGTERM_AFTER_READS": "16"},  # the last read of epoch 0 (4 steps of 4)
    )  # fmt: skip
    assert out.returncode == 143, out.stderr
    assert "stopped by SIGTERM after epoch 0" in out.stdout + out.stderr
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert (state["epoch"], state["step_in_epoch"]) == (1, 0)


def test_sigterm_to_the_process_group_writes_the_checkpoint(tiny_folder, tmp_path):
    """torchrun (os.killpg), Slurm and `kill -- -PGID` send SIGTERM to the whole process
    group: the DataLoader workers died of it, and the run ended with "worker exited
    unexpectedly", exit code 2 and no checkpoint of where it stopped."""
    run_dir = tmp_path / "out" / "g" / "r"
    args = tiny_overrides(tiny_folder, run_dir, "trainer.epochs=3", "loader.num_workers=2",
                          "storage._target_=tests.helpers.SigtermGroupAfterReads")  # fmt: skip
    env = {**os.environ, "SIGTERM_AFTER_READS": "10", "SIGTERM_ONCE": str(tmp_path / "sent"),
           "WANDB_SILENT": "true"}  # fmt: skip
    out = subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300,
                         start_new_session=True)  # its own group, as under torchrun  # fmt: skip
    assert (tmp_path / "sent").exists()
    assert out.returncode == 143, out.stderr[-3000:]
    assert "stopped by SIGTERM" in out.stdout + out.stderr
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert state["epoch"] < 3 and "exited unexpectedly" not in out.stderr
    # what a resume keeps whatever loader=auto prefers, and checks
    assert state["backend"] == "turbo" and state["data_sizes"] == {"train": 18, "val": 9}


def test_a_resume_on_a_dataset_whose_files_changed_is_refused(tmp_path):
    """Files added to dataset.root while a run was stopped mid-epoch: the resumed epoch's
    plan indexed other files (in the audit's run 10 trained twice, 4 never), silently."""
    root = make_image_folder(tmp_path / "d")
    common = ["storage._target_=tests.helpers.SigtermAfterReads", "name=c"]
    stopped = run_train(tiny_overrides(root, tmp_path / "out" / "c" / "r1", *common),
                        env={"SIGTERM_AFTER_READS": "6"})  # fmt: skip
    assert stopped.returncode == 143, stopped.stderr
    shutil.copy(root / "train" / "cat" / "cat_000.jpg", root / "train" / "cat" / "new.jpg")
    resumed = run_train(tiny_overrides(root, tmp_path / "out" / "c" / "r2", *common,
                                       "resume=auto"))  # fmt: skip
    assert_clean_failure(resumed, "was written by a run on another dataset",
                         "train: 18 -> 19", "resume=null")  # fmt: skip
    (root / "train" / "cat" / "new.jpg").unlink()  # the data as it was: it goes on
    again = run_train(tiny_overrides(root, tmp_path / "out" / "c" / "r3", *common,
                                     "resume=auto"))  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]


def test_a_resume_on_a_dataset_whose_files_were_renamed_is_refused(tmp_path):
    """As many files, one renamed (cat_000.jpg -> cat_zzz.jpg): the sample counts agree, but
    the folder's order moved, and the resumed epoch trained cat_002 and cat_008 twice and
    cat_003 and cat_009 never. The split's fingerprint in the checkpoint tells."""
    root = make_image_folder(tmp_path / "d")
    common = ["storage._target_=tests.helpers.SigtermAfterReads", "name=m"]
    stopped = run_train(tiny_overrides(root, tmp_path / "out" / "m" / "r1", *common),
                        env={"SIGTERM_AFTER_READS": "6"})  # fmt: skip
    assert stopped.returncode == 143, stopped.stderr
    state = torch.load(tmp_path / "out" / "m" / "r1" / "checkpoints" / "last.pt",
                       weights_only=True)  # fmt: skip
    assert state["data_fingerprints"]["train"].startswith("files:"), state["data_fingerprints"]
    cat = root / "train" / "cat"
    (cat / "cat_000.jpg").rename(cat / "cat_zzz.jpg")
    resumed = run_train(tiny_overrides(root, tmp_path / "out" / "m" / "r2", *common,
                                       "resume=auto"))  # fmt: skip
    assert_clean_failure(resumed, "was written by a run on other data in the train split",
                         "renamed", "resume=null")  # fmt: skip


def test_checkpoints_without_a_fingerprint_of_the_kind_resume_on_their_counts():
    """A checkpoint written before the fingerprints (or of another kind: the folder's run
    resumed on its pack) is checked by its sample counts alone, as before."""
    from types import SimpleNamespace

    from fastload.errors import CheckpointError
    from fastload.train_state import TrainState

    now = SimpleNamespace(data_sizes={"train": 18, "val": 9},
                          data_fingerprints={"train": "files:aa", "val": "files:bb"})  # fmt: skip
    check = TrainState.check_same_data
    check(now, {"data_sizes": {"train": 18, "val": 9}}, "old.pt")
    check(now, {"data_sizes": {"train": 18}, "data_fingerprints": {"train": "pack:lmdb:cc"}}, "p")
    with pytest.raises(CheckpointError, match="train: 18 -> 19"):
        check(SimpleNamespace(data_sizes={"train": 19}, data_fingerprints=None),
              {"data_sizes": {"train": 18}}, "old.pt")  # fmt: skip
    with pytest.raises(CheckpointError, match="in the val split"):
        check(now, {"data_sizes": {"val": 9}, "data_fingerprints": {"val": "files:cc"}}, "n.pt")
    # a shards run resumed on an LMDB pack of the same data (another storage=), or on a pack
    # made again (other checksums, as many samples): counts only
    packed = SimpleNamespace(data_sizes={"train": 18},
                             data_fingerprints={"train": "pack:fastload-lmdb:542a"})  # fmt: skip
    check(packed, {"data_sizes": {"train": 18},
                   "data_fingerprints": {"train": "pack:fastload-shards:258b"}}, "s.pt")  # fmt: skip
    check(packed, {"data_sizes": {"train": 18},
                   "data_fingerprints": {"train": "pack:fastload-lmdb:9999"}}, "l.pt")  # fmt: skip


def test_sigterm_writes_checkpoint_and_resume_matches_uninterrupted(tiny_folder, tmp_path):
    # with the EMA of the weights (trainer.ema), which the checkpoint carries too
    common = ["trainer.epochs=3", "loader.num_workers=0", "trainer.ema.decay=0.8"]
    ref = run_train(tiny_overrides(tiny_folder, tmp_path / "ref" / "r", *common, "name=ref"))
    assert ref.returncode == 0, ref.stderr

    # Preempted during epoch 1 (after 6 of 4 + 4 steps' reads), then resumed with resume=auto.
    killed_dir = tmp_path / "out" / "b" / "r1"
    killed = run_train(
        tiny_overrides(
            tiny_folder,
            killed_dir,
            *common,
            "name=b",
            "storage._target_=tests.helpers.SigtermAfterReads",
        ),
        env={"SIGTERM_AFTER_READS": "23"},
    )
    assert killed.returncode == 143, killed.stderr
    text = killed.stdout + killed.stderr
    assert "resume=auto" in text and "SIGTERM" in text and "Traceback" not in text
    state = torch.load(killed_dir / "checkpoints" / "last.pt", weights_only=True)
    assert (state["epoch"], state["step_in_epoch"]) == (1, 2)
    assert not list((killed_dir / "checkpoints").glob(".*tmp*"))  # nothing half-written

    resumed_dir = tmp_path / "out" / "b" / "r2"
    # the same settings as the interrupted run (resume checks them), without the preemption
    same = ["storage._target_=tests.helpers.SigtermAfterReads"]
    resumed = run_train(
        tiny_overrides(tiny_folder, resumed_dir, *common, *same, "name=b", "resume=auto")
    )
    assert resumed.returncode == 0, resumed.stderr
    a = torch.load(tmp_path / "ref" / "r" / "checkpoints" / "last.pt", weights_only=True)
    b = torch.load(resumed_dir / "checkpoints" / "last.pt", weights_only=True)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["ema"]["updates"] == b["ema"]["updates"] == 3 * 4  # 4 updates per epoch
    for k in a["ema"]["model"]:
        assert torch.equal(a["ema"]["model"][k], b["ema"]["model"][k]), k
    rows = read_jsonl(resumed_dir / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    # the epoch resumed inside of says so: its numbers cover its last 2 steps only
    assert [r.get("resumed_at_step") for r in rows] == [None, 2, None]
    # each process's first epoch carries its start-up, left out of the steady-state means
    assert [r.get("start_up_epoch") for r in rows] == [True, True, None]
    # the EMA evaluated beside the model: its own numbers, the same as the uninterrupted run's
    ref_rows = read_jsonl(tmp_path / "ref" / "r" / "metrics.jsonl")
    assert rows[-1]["ema_val_loss"] == ref_rows[-1]["ema_val_loss"] != rows[-1]["val_loss"]
    summary = json.loads((resumed_dir / "summary.json").read_text())
    assert summary["best_ema_acc1"] == max(r["ema_val_acc1"] for r in rows)
    assert "best top-1 (EMA)" in resumed.stdout
    # the best weights, the model's and the EMA's: the uninterrupted run's, bit for bit
    for name, metric in (("best.pt", "best_acc1"), ("best_ema.pt", "best_ema_acc1")):
        ref_best = ckpt.load(tmp_path / "ref" / "r" / "checkpoints" / name)
        got = ckpt.load(resumed_dir / "checkpoints" / name)
        assert (
            got["value"] == ref_best["value"] == summary[metric]
            and got["epoch"] == ref_best["epoch"]
        )
        for k, v in ref_best["model"].items():
            assert torch.equal(got["model"][k], v), (name, k)

    # evaluate=: the files give the numbers the run had for them, with no training
    def evaluated(weights):
        out_dir = tmp_path / "out" / "e" / weights.name
        out = run_train(tiny_overrides(tiny_folder, out_dir, "name=e", f"evaluate={weights}"))
        assert out.returncode == 0 and "val_acc1" in out.stdout, out.stderr[-3000:]
        return json.loads((out_dir / "evaluation.json").read_text())

    last = evaluated(resumed_dir / "checkpoints" / "last.pt")  # its model and its EMA
    assert last["epoch"] == rows[-1]["epoch"] == 2 and last["val_images"] == 9  # 3 x 3 classes
    for key in ("val_acc1", "val_loss", "ema_val_acc1", "ema_val_loss"):
        assert last[key] == rows[-1][key], key
    # the EMA's best weights as weights saved elsewhere: a state dict of a DDP-wrapped model
    best_ema = ckpt.load(resumed_dir / "checkpoints" / "best_ema.pt")
    assert best_ema["of"] == "ema"
    plain = tmp_path / "plain.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in best_ema["model"].items()}}, plain)
    got = evaluated(plain)
    at = rows[best_ema["epoch"]]
    assert "ema_val_acc1" not in got and got["epoch"] is None
    assert (got["val_acc1"], got["val_loss"]) == (at["ema_val_acc1"], at["ema_val_loss"])


@pytest.mark.slow  # two nodes of two ranks each: tests/test_multinode.py
def test_two_process_ddp_on_cpu(tiny_folder, tmp_path):
    out_root = tmp_path / "outputs"
    out = run_torchrun(tiny_folder, tmp_path, f"output_root={out_root}", "name=ddp")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_dirs = list((out_root / "ddp").iterdir())
    assert len(run_dirs) == 1, run_dirs  # one run directory for both ranks
    rows = read_jsonl(run_dirs[0] / "metrics.jsonl")
    assert len(rows) == 2 and rows[0]["world_size"] == 2  # rank 0 alone writes
    assert (run_dirs[0] / ".hydra" / "config.yaml").is_file()


@pytest.mark.parametrize(
    "case",
    [
        "missing_root",
        "no_classes",
        "corrupt",
        "batch_too_big",
        "unwritable_output",
        "other_model_checkpoint",
        "root_not_set",
        "input_dtype_without_autocast",
    ],
)
def test_bad_input_gets_one_clear_message(case, tmp_path, tiny_folder):
    run_dir = tmp_path / "run"
    root = tiny_folder
    extra = []
    if case == "missing_root":
        root = tmp_path / "nope"
        needles = [str(root / "train"), "dataset.root"]
    elif case == "no_classes":
        root = tmp_path / "flat"
        (root / "train").mkdir(parents=True)
        needles = [str(root / "train"), "no class folders"]
    elif case == "corrupt":
        root = tmp_path / "c"
        shutil.copytree(tiny_folder, root)
        bad = root / "train" / "dog" / "dog_002.jpg"
        bad.write_bytes(bad.read_bytes()[:300])
        extra = ["loader.num_workers=1"]
        needles = [f"cannot decode image {bad}", "dataset.skip_corrupt=true"]
    elif case == "batch_too_big":
        extra = ["trainer.batch_size=64"]
        needles = ["trainer.batch_size=64", "18 training images"]
    elif case == "unwritable_output":
        extra = ["output_root=/proc/fastload-test"]  # after tiny_overrides' own, so it wins
        needles = ["/proc/fastload-test", "output_root="]
    elif case == "other_model_checkpoint":
        first = run_train(tiny_overrides(root, tmp_path / "first", "trainer.epochs=1"))
        assert first.returncode == 0, first.stderr
        extra = ["model=resnet50", f"resume={tmp_path / 'first' / 'checkpoints' / 'last.pt'}"]
        needles = ["resnet18", "resnet50", "resume=null"]
    elif case == "root_not_set":
        extra = ["dataset=imagenet", "dataset.num_classes=3"]
        needles = ["dataset.root must be set", "dataset.root=/data/imagenet"]
    elif case == "input_dtype_without_autocast":  # was a traceback from the first conv
        extra = ["loader.input_dtype=bf16", "trainer.precision=fp32"]
        needles = ["loader.input_dtype=bf16 needs autocast", "trainer.precision=bf16"]
    args = tiny_overrides(root, run_dir, *extra)
    if case == "root_not_set":
        args = [a for a in args if not a.startswith(("dataset.root=", "dataset.prepare="))]
    if case == "unwritable_output":  # let output_root decide the run directory, as by default
        args = [a for a in args if not a.startswith("hydra.run.dir=")]
    out = run_train(args)
    assert_clean_failure(out, *needles)
    if case != "unwritable_output":  # the run folder says why the run stopped
        logged = (run_dir / "train.log").read_text()
        assert "[ERROR] - error: " in logged and needles[0] in logged, logged


def test_skip_corrupt_counts_and_trains(tmp_path):
    root = make_image_folder(tmp_path / "d")
    bad = root / "train" / "cat" / "cat_001.jpg"
    bad.write_bytes(b"\xff\xd8 truncated")
    out = run_train(
        tiny_overrides(
            root,
            tmp_path / "run",
            "dataset.skip_corrupt=true",
            "trainer.epochs=1",
            "dataset.max_skipped_share=0.1",
        )  # 1 of 18  # fmt: skip
    )
    assert out.returncode == 0, out.stderr
    row = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert row["skipped_corrupt"] == 1 and row["val_skipped_corrupt"] == 0


@pytest.mark.slow
def test_default_run_learns_the_builtin_dataset(tmp_path):
    """`python train.py` exactly as the README's first command runs it (minus W&B)."""
    out = run_train(
        [f"output_root={tmp_path}", "logger=none", "trainer.progress=false"],
        env={"FASTLOAD_CACHE": str(tmp_path / "cache")},
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # name: dataset-model-backend-storage-loader (conf/config.yaml)
    (run_dir,) = (tmp_path / "synthetic-resnet18-turbo-disk-baseline").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epochs"] == 6
    assert summary["best_acc1"] > 30  # 10 classes: chance is 10 %


@pytest.mark.parametrize(
    "bad, said",
    [
        ("+trainer.lr_typo=0.5", "trainer has no option 'lr_typo'"),  # check_config's
        ("trainer.epoch=3", "trainer.epoch"),  # Hydra's own (a misspelt option)
    ],
)
def test_a_config_error_is_said_once_per_node_not_once_per_rank(tiny_folder, tmp_path, bad, said):
    """Every rank of a node checks the same command line and raises the same words: printed
    by each of them, 8 ranks gave 8 identical lines."""
    out = run_torchrun(tiny_folder, tmp_path, f"output_root={tmp_path / 'out'}", bad, timeout=180)
    assert out.returncode != 0, out.stdout[-2000:] + out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and said in errors[0], out.stderr[-3000:]
