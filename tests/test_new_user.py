"""What a new user hit, each reproduced as the user met it: stale packs, damaged
checkpoints, resuming another experiment, class counts, bad numbers, corrupt files while
packing, a full disk, Ctrl-C, and errors that arrived as tracebacks."""

from __future__ import annotations

import errno
import json
import os
import signal
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import REPO, make_image_folder, run_train, tiny_overrides

FOUR = ("ant", "bee", "cat", "dog")


def fail_cleanly(out, *needles):
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    assert "Traceback" not in text and "Error in call to target" not in text, text[-3000:]
    for needle in needles:
        assert needle in text, text[-3000:]
    return text


def said(out) -> str:
    """Everything a run printed (Hydra's log handler writes to stdout)."""
    return out.stdout + out.stderr


def quick(root, run_dir, *extra):
    """train.py on a 4-class folder: one epoch of one step (plus evaluation)."""
    args = tiny_overrides(root, run_dir, "dataset.num_classes=4", "trainer.epochs=1", *extra)
    return run_train([*args, "trainer.max_steps_per_epoch=1"])


# 1. A stale pack is served ----------------------------------------------------------------


# The staleness check (the pack's sidecar digest) is the same code for every store: lmdb's
# three training runs (~19 s) go with the slow suite.
@pytest.mark.parametrize(
    "fmt, marker",
    [("shards", "meta.json"), pytest.param("lmdb", "data.mdb", marks=pytest.mark.slow)],
)
def test_a_pack_of_a_changed_folder_is_rebuilt_or_refused(tmp_path, fmt, marker):
    root = make_image_folder(tmp_path / "SMALL", classes=FOUR, per_split=(6, 2))
    pack = (
        tmp_path / "SMALL.packs" / ("shards-jpeg-64px-q90" if fmt == "shards" else "lmdb-64px-q90")
    )
    over = [f"storage={fmt}", "storage.max_side=64"]
    first = quick(root, tmp_path / "r1", *over)
    assert first.returncode == 0, first.stderr[-3000:]
    sidecar = json.loads((pack / "train" / "fastload-pack.json").read_text())
    assert (pack / "train" / marker).is_file() and sidecar["params"]["max_side"] == 64

    for cls in FOUR:  # delete 8 images, as the user did
        for f in sorted((root / "train" / cls).iterdir())[:2]:
            f.unlink()
    second = quick(root, tmp_path / "r2", *over)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "re-packing" in said(second) and "changed since it was packed" in said(second)
    again = json.loads((pack / "train" / "fastload-pack.json").read_text())
    assert again["source_digest"] != sidecar["source_digest"]
    count = sum(1 for _ in (root / "train").rglob("*.jpg"))
    if fmt == "shards":
        assert json.loads((pack / "train" / "meta.json").read_text())["count"] == count == 16

    (sorted((root / "train" / "ant").iterdir())[0]).unlink()
    refused = quick(root, tmp_path / "r3", *over, "storage.auto_pack=false")
    fail_cleanly(refused, f"{pack / 'train'} is out of date", f"python -m fastload.pack {fmt}")


def test_pack_command_repacks_an_outdated_pack_and_keeps_a_current_one(tmp_path, capsys):
    from fastload.pack import main as pack_main

    root = make_image_folder(tmp_path / "SMALL", classes=FOUR, per_split=(3, 1))
    dst = tmp_path / "packs"
    assert pack_main(["shards", str(root), str(dst)]) == 0
    assert pack_main(["shards", str(root), str(dst)]) == 0
    assert "matches its source: skipped" in capsys.readouterr().out
    (root / "train" / "ant" / "ant_000.jpg").unlink()
    assert pack_main(["shards", str(root), str(dst)]) == 0
    out = capsys.readouterr().out
    assert "out of date" in out and "re-packing" in out
    assert json.loads((dst / "train" / "meta.json").read_text())["count"] == 11


def test_pack_refuses_an_output_folder_inside_its_source(tmp_path, capsys):
    """DST under SRC wrote train/ and val/ beside the class folders: the next run counted
    them as classes."""
    from fastload.pack import main as pack_main

    root = make_image_folder(tmp_path / "SMALL", classes=FOUR, per_split=(1, 1))
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    for dst in (root / "train", root / "packs", root):
        assert pack_main(["shards", str(root), str(dst)]) == 2
        err = capsys.readouterr().err
        assert f"DST {dst} would put the pack" in err and "Give DST outside SRC" in err
    # one split packed into its dataset's folder: the pack would replace the split
    assert pack_main(["shards", str(root / "train"), str(root)]) == 2
    assert "in place of SRC" in capsys.readouterr().err
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
    assert pack_main(["shards", str(root), str(tmp_path)]) == 0  # beside it: tmp_path/train


def test_pack_takes_a_split_whose_class_folders_hold_subfolders_as_one_split(tmp_path, capsys):
    """ImageFolder reads a class folder's subfolders too; such a split was packed as a root
    whose 'splits' were its classes (one pack per class, every label from the subfolders)."""
    from fastload.pack import main as pack_main

    split = make_image_folder(tmp_path / "data", classes=("cat", "dog"), per_split=(2, 1))
    split = split / "train"
    for cls in ("cat", "dog"):
        nested = split / cls / "more"
        nested.mkdir()
        (split / cls / f"{cls}_001.jpg").rename(nested / f"{cls}_001.jpg")
    assert pack_main(["shards", str(split), str(tmp_path / "packs")]) == 0
    assert sorted(p.name for p in (tmp_path / "packs").iterdir()) == ["train"]
    assert json.loads((tmp_path / "packs" / "train" / "meta.json").read_text())["count"] == 4

    # classes whose images all sit in subfolders look like splits: said so, with the way out
    for cls in ("cat", "dog"):
        (split / cls / f"{cls}_000.jpg").rename(split / cls / "more" / f"{cls}_000.jpg")
    assert pack_main(["shards", str(split), str(tmp_path / "p2")]) == 0
    assert "pass --splits . to pack it as one" in capsys.readouterr().out
    assert pack_main(["shards", str(split), str(tmp_path / "p3"), "--splits", "."]) == 0
    assert sorted(p.name for p in (tmp_path / "p3").iterdir()) == ["train"]


# 2. A corrupted checkpoint is loaded ------------------------------------------------------


def flip_4kb(path: Path) -> None:
    """Flips up to 4 KiB in the middle of the checkpoint's largest tensor: the file stays a
    readable zip whose numbers changed (what a bad disk block does to a large checkpoint)."""
    with zipfile.ZipFile(path) as archive:
        entry = max(archive.infolist(), key=lambda e: e.file_size)
    data = bytearray(path.read_bytes())
    header = entry.header_offset  # the local header: 30 bytes, then the name and extra field
    name_len, extra_len = struct.unpack_from("<HH", data, header + 26)
    start = header + 30 + name_len + extra_len + entry.file_size // 4
    end = start + min(4096, entry.file_size // 2)
    data[start:end] = bytes(b ^ 0xFF for b in data[start:end])
    path.write_bytes(bytes(data))


def test_a_damaged_checkpoint_is_refused_and_auto_falls_back_to_an_intact_one(
    tiny_folder, tmp_path
):
    out_root = tmp_path / "out"
    runs = []
    for k in range(2):  # two runs of the same experiment; the newer one's checkpoint is hit
        run_dir = out_root / "x" / f"r{k}"
        out = run_train(tiny_overrides(tiny_folder, run_dir, "name=x", "trainer.epochs=1"))
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(run_dir / "checkpoints" / "last.pt")
        time.sleep(0.05)
    flip_4kb(runs[1])
    direct = run_train(tiny_overrides(tiny_folder, tmp_path / "d", f"resume={runs[1]}"))
    fail_cleanly(direct, f"checkpoint {runs[1]} is damaged", "resume=null")
    again = ["name=x", "trainer.epochs=1", "resume=auto"]  # the same experiment
    auto = run_train(tiny_overrides(tiny_folder, out_root / "x" / "r2", *again))
    assert auto.returncode == 0, auto.stderr[-3000:]
    assert f"skipping {runs[1]}" in said(auto) and f"resuming from {runs[0]}" in said(auto)


def test_a_checkpoint_holds_and_verifies_its_checksum(tmp_path):
    from fastload import checkpoint as ckpt
    from fastload.errors import CheckpointError

    path = tmp_path / "last.pt"
    ckpt.save_atomic({"model": {"w": torch.arange(1000.0)}, "epoch": 3}, path)
    state = torch.load(path, weights_only=True)  # still a plain torch checkpoint
    assert state["format"] == ckpt.FORMAT and state["checksum"] == ckpt.checksum(state)
    assert ckpt.load(path)["epoch"] == 3
    state["model"]["w"][500] = 7.0  # one changed value, file otherwise valid
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="is damaged"):
        ckpt.load(path)


# 3. resume=auto continues a different experiment -------------------------------------------


def test_resume_refuses_another_experiment_and_names_the_keys(tiny_folder, tmp_path):
    out_root = tmp_path / "out"
    first = run_train(
        tiny_overrides(tiny_folder, out_root / "x" / "a", "name=x", "optim.base_lr=0.2")
    )
    assert first.returncode == 0, first.stderr[-3000:]
    other = tiny_overrides(tiny_folder, out_root / "x" / "b", "name=x", "resume=auto")
    out = run_train([*other, "optim.base_lr=0.1", "loader.num_workers=1"])  # workers: no matter
    text = fail_cleanly(out, "optim.base_lr: 0.2 -> 0.1", "resume=null")
    assert "num_workers" not in text


def test_the_run_name_names_the_data_path(tiny_folder, tmp_path):
    args = [a for a in tiny_overrides(tiny_folder, tmp_path / "x") if not a.startswith("hydra.run")]
    out = run_train([*args, f"output_root={tmp_path / 'out'}", "storage=tmpfs",
                     f"storage.target_dir={tmp_path / 'shm'}", "trainer.epochs=1"])  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert [p.name for p in (tmp_path / "out").iterdir()] == [
        "synthetic-resnet18-turbo-tmpfs-baseline"
    ]


# 4. dataset.num_classes against the class folders ----------------------------------------


@pytest.mark.parametrize("n", [2, 6])
def test_num_classes_must_match_the_class_folders(tmp_path, n):
    root = make_image_folder(tmp_path / "SMALL", classes=FOUR, per_split=(2, 1))
    args = tiny_overrides(root, tmp_path / "r", "trainer.epochs=1")
    out = run_train(
        [a for a in args if not a.startswith("dataset.num_classes")] + [f"dataset.num_classes={n}"]
    )
    fail_cleanly(out, f"dataset.num_classes={n}, but {root / 'train'} has 4 class folders",
                 "set dataset.num_classes=4")  # fmt: skip


# 9. trainer.batch_size=0 or -8 ----------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-8"])
def test_bad_batch_size_is_one_line(tiny_folder, tmp_path, value):
    out = run_train(tiny_overrides(tiny_folder, tmp_path / "r", f"trainer.batch_size={value}"))
    fail_cleanly(out, f"trainer.batch_size={value}: use a whole number >= 1")


# 10. A truncated JPEG while packing -----------------------------------------------------


def truncated_folder(tmp_path) -> tuple[Path, Path]:
    root = make_image_folder(tmp_path / "SMALL", classes=FOUR, per_split=(3, 1))
    bad = root / "train" / "bee" / "bee_001.jpg"
    bad.write_bytes(bad.read_bytes()[:400])
    return root, bad


def test_packing_a_truncated_jpeg_names_it_and_leaves_nothing(tmp_path, capsys):
    from fastload.pack import main as pack_main

    root, bad = truncated_folder(tmp_path)
    dst = tmp_path / "DST"
    assert pack_main(["shards", str(root), str(dst), "--max-side", "64"]) == 2
    err = capsys.readouterr().err
    assert f"cannot decode {bad}" in err and "--skip-corrupt" in err and not dst.exists()
    assert pack_main(["shards", str(root), str(dst), "--max-side", "64", "--skip-corrupt"]) == 0
    assert "1 undecodable file(s) left out" in capsys.readouterr().out
    assert json.loads((dst / "train" / "meta.json").read_text())["count"] == 11


def test_training_with_skip_corrupt_packs_without_the_bad_file_and_says_so(tmp_path):
    root, bad = truncated_folder(tmp_path)
    out = quick(root, tmp_path / "r", "storage=shards", "storage.max_side=64",
                "dataset.skip_corrupt=true")  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "left out 1 file(s)" in said(out) and str(bad) in said(out)


def test_skip_corrupt_says_which_files_it_skipped(tmp_path):
    root, bad = truncated_folder(tmp_path)
    run_dir = tmp_path / "r"
    out = run_train(tiny_overrides(root, run_dir, "dataset.num_classes=4", "trainer.epochs=1",
                                   "dataset.skip_corrupt=true",
                                   "dataset.max_skipped_share=0.1"))  # 1 of 12  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "skipped 1 image(s) that cannot be decoded" in said(out) and str(bad) in said(out)
    assert str(bad) in (run_dir / "skipped_files.txt").read_text()


def test_a_restart_in_its_folder_lists_each_skipped_file_once_per_epoch(tmp_path):
    """A run killed after an epoch's listing but before its checkpoint (a torchrun restart
    resumes in the same folder) redoes that epoch: its lines of skipped_files.txt were
    listed twice, as metrics.jsonl's rows are not."""
    root, bad = truncated_folder(tmp_path)
    run_dir = tmp_path / "out" / "restart" / "r"
    args = ["dataset.num_classes=4", "dataset.skip_corrupt=true", "name=restart",
            "dataset.max_skipped_share=0.1", "trainer.checkpoint_every=1", "trainer.epochs=3",
            "storage._target_=tests.helpers.SigkillAfterReads"]  # fmt: skip
    # killed in epoch 2 (12 reads an epoch), after epoch 1's checkpoint
    out = run_train(tiny_overrides(root, run_dir, *args), env={"SIGKILL_AFTER_READS": "26"})
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    listing = run_dir / "skipped_files.txt"
    assert listing.read_text().splitlines() == [f"epoch {e}\t{bad}" for e in range(2)]
    # what a kill after epoch 2's listing, before its checkpoint, leaves
    with open(listing, "a") as f:
        f.write(f"epoch 2\t{bad}\n")
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 2}\n')
    out = run_train(tiny_overrides(root, run_dir, *args, "resume=auto"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resume=auto: resuming from" in said(out)
    lines = listing.read_text().splitlines()
    assert lines == [f"epoch {e}\t{bad}" for e in range(3)], lines


def test_a_run_resumed_in_a_new_folder_carries_every_epochs_record(tmp_path):
    """resume=auto from another folder (a new launch): metrics.jsonl held every epoch, but
    skipped_files.txt and the logger (W&B) only the epochs trained after the resume."""
    root, bad = truncated_folder(tmp_path)
    args = ["dataset.num_classes=4", "dataset.skip_corrupt=true", "name=carry",
            "dataset.max_skipped_share=0.1", "trainer.epochs=3",
            "storage._target_=tests.helpers.SigtermAfterReads",
            "logger._target_=tests.helpers.RecordingSink"]  # fmt: skip
    first = tmp_path / "out" / "carry" / "r1"
    out = run_train(tiny_overrides(root, first, *args),  # stopped in epoch 1 (3 steps of 4)
                    env={"RECORDING_SINK": str(tmp_path / "first.jsonl"),
                         "SIGTERM_AFTER_READS": "17"})  # fmt: skip
    assert out.returncode == 143, out.stderr[-3000:]
    calls = [json.loads(x) for x in (tmp_path / "first.jsonl").read_text().splitlines()]
    # closed, its record complete; with the exit code, so W&B shows the run as stopped
    assert calls[-1] == {"call": "finish", "epochs": None, "exit_code": 143}
    second = tmp_path / "out" / "carry" / "r2"
    out = run_train(tiny_overrides(root, second, *args, "resume=auto"),
                    env={"RECORDING_SINK": str(tmp_path / "second.jsonl")})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = (second / "skipped_files.txt").read_text().splitlines()
    assert lines == [f"epoch {e}\t{bad}" for e in range(3)], lines
    calls = [json.loads(x) for x in (tmp_path / "second.jsonl").read_text().splitlines()]
    assert [c.get("step") for c in calls if c["call"] == "log"] == [0, 1, 2]
    assert calls[-1] == {"call": "finish", "epochs": 3, "exit_code": 0}


def test_a_restart_from_a_checkpoint_inside_the_epoch_lists_the_files_skipped_before_it(tmp_path):
    """trainer.checkpoint_every_steps, then a SIGKILL (no time for a checkpoint): the restart
    trains the epoch's rest, and the files skipped before the checkpoint were not listed."""
    root = make_image_folder(tmp_path / "SMALL", classes=FOUR, per_split=(3, 1))
    # 5 of 12: at least one lies in the first two batches of 4, read before the kill
    bad = sorted((root / "train").rglob("*.jpg"))[::2][:5]
    for path in bad:
        path.write_bytes(path.read_bytes()[:400])
    run_dir = tmp_path / "out" / "kill" / "r"
    args = ["dataset.num_classes=4", "dataset.skip_corrupt=true", "name=kill",
            "dataset.max_skipped_share=0.5", "trainer.epochs=1",
            "trainer.checkpoint_every_steps=1",
            "storage._target_=tests.helpers.SigkillAfterReads"]  # fmt: skip
    out = run_train(tiny_overrides(root, run_dir, *args), env={"SIGKILL_AFTER_READS": "11"})
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert (state["epoch"], state["step_in_epoch"]) == (0, 2)
    out = run_train(tiny_overrides(root, run_dir, *args, "resume=auto"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resume=auto: resuming from" in said(out)
    lines = (run_dir / "skipped_files.txt").read_text().splitlines()
    assert sorted(lines) == sorted(f"epoch 0\t{path}" for path in bad), lines


# 11. A full disk while checkpointing, packing or staging ------------------------------------


def test_a_full_disk_while_checkpointing_is_one_message_and_keeps_the_last(tmp_path, monkeypatch):
    from fastload import checkpoint as ckpt
    from fastload.errors import CheckpointError

    path = tmp_path / "c" / "last.pt"
    ckpt.save_atomic({"w": torch.zeros(10)}, path)
    before = path.read_bytes()

    def full(obj, f):
        f.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointError) as err:
        ckpt.save_atomic({"w": torch.zeros(1 << 20)}, path)
    msg = err.value.user_message
    assert f"no space left to write the checkpoint {path}" in msg and "needs about 4.0 MiB" in msg
    assert "free" in msg and "output_root" in msg
    assert path.read_bytes() == before and [p.name for p in path.parent.iterdir()] == ["last.pt"]


FULL_FOR_BEST = """
import errno, torch
save = torch.save
def full_for_best(obj, f, *a, **k):
    if "best.pt.pending" in str(getattr(f, "name", f)):
        raise OSError(errno.ENOSPC, "No space left on device")
    return save(obj, f, *a, **k)
torch.save = full_for_best
"""


def test_best_weights_that_do_not_fit_keep_the_epochs_row(tiny_folder, tmp_path):
    """The new best's weights are written after the epoch's row: a full disk there stops
    the run with one message, and the epoch trained and evaluated is in metrics.jsonl."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(FULL_FOR_BEST)
    run_dir = tmp_path / "out" / "n" / "run"
    args = [sys.executable, str(REPO / "train.py"), *tiny_overrides(tiny_folder, run_dir)]
    env = {**os.environ, "WANDB_SILENT": "true", "PYTHONPATH": str(inject)}
    # a process of its own (not a fork of the tests' fork server): sitecustomize runs in it
    out = subprocess.run([*args, "trainer.epochs=1"], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 2, out.stderr[-3000:]
    assert "no space left to write the checkpoint" in out.stderr and "Traceback" not in out.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0] and rows[0]["val_acc1"] is not None


def test_run_files_on_a_full_disk_are_one_message_and_keep_what_was_written(tmp_path, monkeypatch):
    from fastload.errors import OutputError
    from fastload.telemetry import sinks

    files = sinks.MetricsFiles(tmp_path / "run")
    files.append_epoch({"epoch": 0, "loss": 1.0})

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sinks.os, "fsync", no_space)
    for write in (lambda: files.append_epoch({"epoch": 1}), lambda: files.write_summary({}),
                  lambda: files.rewrite_epochs([])):  # fmt: skip
        with pytest.raises(OutputError, match="no space left to write .*output_root="):
            write()
    monkeypatch.undo()
    assert [r["epoch"] for r in files.read_epochs()][0] == 0
    assert not (tmp_path / "run" / "summary.json").exists()


def test_checkpoints_that_cannot_fit_are_refused_before_training(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from fastload import engine
    from fastload.errors import CheckpointError

    model = torch.nn.Linear(1000, 1000)  # 4.0 MB of weights
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = SimpleNamespace(model=model, optimizer=sgd, ema=None)
    cfg = OmegaConf.create({"trainer": {"checkpoint_every": 1, "checkpoint_every_steps": 0}})

    def free(n):
        monkeypatch.setattr(engine.shutil, "disk_usage", lambda p: SimpleNamespace(free=n))

    free(10 * 2**20)  # last.pt ~8 MB (weights, momentum) + best.pt ~4 MB
    with pytest.raises(CheckpointError, match=r"need about 11\.5 MiB .*checkpoint_every=0"):
        engine.check_checkpoint_room(tmp_path, cfg, state)
    free(100 * 2**20)
    engine.check_checkpoint_room(tmp_path, cfg, state)
    cfg.trainer.checkpoint_every = 0
    free(0)
    engine.check_checkpoint_room(tmp_path, cfg, state)  # no checkpoints: nothing to fit


def test_a_full_disk_while_packing_or_staging_is_one_message(tmp_path, monkeypatch):
    from fastload.errors import StorageError
    from fastload.storage import shards, tmpfs
    from fastload.storage.packing import pack_split

    root = make_image_folder(tmp_path / "SMALL", classes=FOUR, per_split=(3, 1))

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shards.ShardWriter, "_write", no_space)
    store = shards.ShardStorage()
    with pytest.raises(StorageError, match=r"no space left to write the pack .*needs about"):
        pack_split(store.writer, root / "train", tmp_path / "p" / "train", progress=False)
    assert not (tmp_path / "p" / "train").exists() and not list((tmp_path / "p").iterdir())

    monkeypatch.setattr(tmpfs.shutil, "copyfile", no_space)
    with pytest.raises(StorageError, match=r"no space left to write the staged copy .*target_dir"):
        tmpfs.stage(root, ["train"], tmp_path / "shm", progress=False)
    assert not list(tmpfs.user_folder(tmp_path / "shm").iterdir())


# 12. Ctrl-C while the built-in dataset is generated -----------------------------------------


@pytest.mark.parametrize("when", ["pool importing", "generating"])
def test_ctrl_c_during_generation_is_one_line_and_exit_130(tmp_path, when):
    """'pool importing': while the spawn pool's children start and import their modules,
    where an initializer that ignores SIGINT has not run yet (a 16-core box printed their
    tracebacks)."""
    cache = tmp_path / "cache"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), f"output_root={tmp_path / 'out'}", "logger=none"],
        env={**os.environ, "FASTLOAD_CACHE": str(cache)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's Ctrl-C reaches it
        # SIGINT at its default, as from a terminal: a suite started in the background of a
        # non-interactive shell (`make test &`) ignores SIGINT, and children inherit that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )

    def started() -> bool:  # the dataset's temporary folder comes just before the pool starts
        return any(cache.glob(".*.tmp-*" if when == "pool importing" else ".*.tmp-*/train/*/*.jpg"))

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not started():
        time.sleep(0.05)
    time.sleep(0.3 if when == "pool importing" else 0.5)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "interrupted (Ctrl-C)" in err, err[-3000:]
    assert not list(cache.glob(".*tmp*"))  # the partial dataset is gone


CTRL_C_WHILE_THE_POOL_STARTS = """
import multiprocessing.context, os, signal
from fastload.host import spawn_pool

real = multiprocessing.context.SpawnContext.Pool
def pool_hit_by_ctrl_c(self, *a, **k):
    pool = real(self, *a, **k)
    os.kill(os.getpid(), signal.SIGINT)  # lands inside spawn_pool's window
    masks = pool.map(blocked_in_child, range(2))
    print("children block SIGINT:", all(m & 2 for m in masks), flush=True)
    return pool
multiprocessing.context.SpawnContext.Pool = pool_hit_by_ctrl_c

def blocked_in_child(_):
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(l.split()[1], 16) for l in f if l.startswith("SigBlk"))

if __name__ == "__main__":
    try:
        spawn_pool(2)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    else:
        print("Ctrl-C lost", flush=True)
"""


def test_ctrl_c_while_the_pool_starts_is_not_lost(tmp_path):
    """The window the test above can only hit by chance: a Ctrl-C during the pool's start is
    raised in the parent once it started (a lost one let a run generate on), and the children
    never take it."""
    script = tmp_path / "pool_window.py"
    script.write_text(CTRL_C_WHILE_THE_POOL_STARTS)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    assert out.stdout.split("\n")[:2] == ["children block SIGINT: True", "interrupted"], (
        out.stdout + out.stderr
    )
    assert "Traceback" not in out.stderr, out.stderr


CTRL_C_INSIDE_A_COMPILED_MODULES_IMPORT = """
import importlib.util, os, signal, sys
from fastload.decode import roi_nvimgcodec

real = importlib.util.find_spec("nvidia.nvimgcodec")

class Initialising:
    \"\"\"nvidia.nvimgcodec as its compiled part initialises: Python code runs, takes the
    Ctrl-C, and the error becomes the module's own ImportError (pybind11's way).\"\"\"
    def find_spec(self, name, path=None, target=None):
        if name == "nvidia.nvimgcodec":
            return importlib.util.spec_from_loader(name, self, origin=real.origin)
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(100))
        except BaseException as e:
            raise ImportError("initialization failed") from e

sys.meta_path.insert(0, Initialising())
try:
    nv = roi_nvimgcodec.load()
except KeyboardInterrupt:
    print("interrupted", flush=True)
else:
    print("Ctrl-C lost:", nv, roi_nvimgcodec.UNAVAILABLE_REASON, flush=True)
"""


def test_ctrl_c_inside_a_compiled_modules_import_is_not_lost(tmp_path):
    """The pre-flight imports nvImageCodec, whose initialisation turns a KeyboardInterrupt
    raised inside it into an ImportError: the Ctrl-C used to read as "nvImageCodec did not
    load" and the run went on. It now stops the run, once the import is done."""
    pytest.importorskip("nvidia.nvimgcodec")
    script = tmp_path / "import_window.py"
    script.write_text(CTRL_C_INSIDE_A_COMPILED_MODULES_IMPORT)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "FASTLOAD_CACHE": str(tmp_path / "c")},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    assert out.stdout.strip() == "interrupted", out.stdout + out.stderr


# 13, 14. Tracebacks where a message belongs --------------------------------------------------


def test_resume_from_a_file_that_is_not_a_checkpoint(tiny_folder, tmp_path):
    junk = tmp_path / "notes.txt"
    junk.write_text("not a checkpoint")
    out = run_train(tiny_overrides(tiny_folder, tmp_path / "r", f"resume={junk}"))
    text = fail_cleanly(out, f"{junk} is not a fastload checkpoint", "resume=null")
    assert "weights_only" not in text and "issue" not in text


@pytest.mark.parametrize("backend, needle", [
    ("pillow-simd", "backend=pillow-simd needs Pillow-SIMD"),
    ("accimage", "backend=accimage needs accimage"),
])  # fmt: skip
def test_errors_while_building_objects_are_one_line_and_exit_2(
    tiny_folder, tmp_path, backend, needle
):
    if backend == "pillow-simd":
        import PIL

        if ".post" in PIL.__version__:
            pytest.skip("Pillow-SIMD is installed here")
    out = run_train(tiny_overrides(tiny_folder, tmp_path / "r", f"backend={backend}"))
    fail_cleanly(out, f"error: {needle}")


# Quieter rough edges ---------------------------------------------------------------------


def test_debug_fast_writes_no_checkpoint_and_has_its_own_name(tmp_path):
    out = run_train(
        [f"output_root={tmp_path / 'out'}", "debug=fast", "trainer.progress=false"],
        env={"FASTLOAD_CACHE": str(tmp_path / "cache")},
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = (tmp_path / "out").iterdir()
    assert run.name == "debug-synthetic-resnet18"
    assert not list(run.rglob("*.pt")) and list(run.rglob("metrics.jsonl"))


def test_a_staged_copy_that_stays_says_where_and_how_to_remove_it(tmp_path, caplog):
    from fastload.storage.tmpfs import TmpfsStorage

    root = make_image_folder(tmp_path / "SMALL", classes=FOUR, per_split=(1, 1))
    store = TmpfsStorage(target_dir=str(tmp_path / "shm"), progress=False)
    store.prepare(root, ["train", "val"])
    with caplog.at_level("INFO", logger="fastload"):
        store.finish(root, ["train", "val"])
    assert (
        "stays in RAM" in caplog.text
        and "rm -rf" in caplog.text
        and "storage.cleanup=true" in caplog.text
    )
