"""scripts/reproduce/<name>.sh and `python -m fastload.report`: every experiment's variants
compose, the report's numbers come from the run directories, and the scripts run end to end
at SIZE=tiny (one of them in the default suite, every one with -m slow)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CONF, REPO, compose_config
from matplotlib.container import BarContainer, ErrorbarContainer
from omegaconf import OmegaConf

from fastload.report import build_report
from fastload.report.__main__ import main as report_main
from tests.helpers import sample

SCRIPTS = REPO / "scripts" / "reproduce"
EXPERIMENTS = sorted(p.stem for p in SCRIPTS.glob("*.sh") if not p.stem.startswith("_"))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_run(
    root: Path, job: int, overrides: list[str], epoch_times, metric=50.0, images=None
) -> Path:
    d = root / str(job)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    rows = [
        {
            "epoch": i,
            "epoch_time_s": t,
            "images_per_s": (images or 100) / t,
            "data_wait_share": 0.1 * t,
            "gpu_util_mean": None,
            "val_acc1": metric,
            **({"train_images": images} if images else {}),
        }  # fmt: skip
        for i, t in enumerate(epoch_times)
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({"metric": "val_acc1"}))
    return d


def test_report_normalises_medians_to_the_baseline_and_keeps_the_spread(tmp_path):
    runs = []
    # baseline: 3 repeats of 2 epochs -> training time 10, 12, 20 s; median 12
    for job, (a, b) in enumerate([(5, 5), (6, 6), (10, 10)]):
        runs.append(fake_run(tmp_path, job, ["loader=baseline", f"+repeat={job}", "x=1"], [a, b]))
    for job, (a, b) in enumerate([(3, 3), (4, 5), (2, 4)], start=3):
        runs.append(fake_run(tmp_path, job, ["loader=bg", f"+repeat={job - 3}", "x=1"], [a, b]))
    report = build_report(runs, tmp_path / "report", baseline="loader=baseline", title="t")
    base, bg = report["rows"]
    assert base["variant"] == "loader=baseline" and base["baseline"] and base["runs"] == 3
    assert base["train_s"] == 12 and base["normalized"] == 1.0
    assert (bg["train_s"], bg["train_s_min"], bg["train_s_max"]) == (6, 6, 9)
    assert bg["normalized"] == pytest.approx(0.5) and bg["normalized_max"] == pytest.approx(0.75)
    assert bg["epoch_time_s"] == 4  # steady epochs only (the second): median of 3, 5, 4
    table = (tmp_path / "report" / "report.md").read_text()
    assert "**loader=baseline** (baseline)" in table and "0.50×" in table
    for png in ("normalized_time.png", "per_variant.png"):
        data = (tmp_path / "report" / png).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, png
        assert f"({png})" in table


def test_a_repeat_finished_with_resume_is_a_repeat_timed_for_whole_epochs(tmp_path):
    """A repeat killed inside epoch 1 and finished with resume=auto (what the report's own
    error advises) was its own, faster variant: its epoch 1 row times only the steps after
    the resume. It is a repeat of its variant, that epoch's missing images added at the
    run's steady speed."""
    runs = [fake_run(tmp_path, 0, ["loader=bg", "+repeat=0"], [5, 5, 5])]
    resumed = fake_run(tmp_path, 1, ["loader=bg", "+repeat=1", "resume=auto"], [5, 5, 5])
    rows = [json.loads(x) for x in (resumed / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r["train_images"] = 24
    rows[1].update(epoch_time_s=2.0, train_images=12, resumed_at_step=3)  # half of epoch 1
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs.append(resumed)
    runs.append(fake_run(tmp_path, 2, ["loader=baseline", "+repeat=0"], [10, 10, 10]))
    report = build_report(runs, tmp_path / "report", baseline="loader=baseline", title="t")
    bg, base = report["rows"]
    assert (bg["variant"], bg["runs"], base["variant"]) == ("loader=bg", 2, "loader=baseline")
    # 5 + (2 + 12 missing images at epoch 2's 24 / 5 s) + 5
    assert (bg["train_s_min"], bg["train_s_max"]) == (pytest.approx(14.5), 15)


def resumed_run(root: Path, job: int, overrides, epoch_times, at: int, images: int = 1000):
    """A fake run whose epoch `at` was resumed at step 99 of 100: 30 s of the new process's
    start-up and one step of 0.1 s, 10 of the epoch's `images`."""
    d = fake_run(root, job, overrides, epoch_times, images=images)
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    for i, r in enumerate(rows):
        r.update(start_up_epoch=i == 0)
    rows[at].update(epoch_time_s=30.1, train_images=10, resumed_at_step=99, start_up_epoch=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_a_resumed_epoch_adds_its_missing_images_and_does_not_scale_the_start_up(tmp_path):
    """The resumed epoch's row holds the new process's start-up: scaling its time by whole /
    trained images counted this repeat 40 + 10 + 30.1 x 100 = 3,060 s. Its 990 missing images
    at the run's steady 100 images/s are 9.9 s: 90 s."""
    runs = [fake_run(tmp_path, j, ["loader=baseline", f"+repeat={j}"], [40, 10, 10], images=1000)
            for j in (0, 1)]  # fmt: skip
    runs.append(resumed_run(tmp_path, 2, ["loader=baseline", "+repeat=2", "resume=auto"],
                            [40, 10, 10], at=2))  # fmt: skip
    runs.append(fake_run(tmp_path, 3, ["loader=bg", "+repeat=0"], [40, 9, 9], images=1000))
    row = build_report(runs, tmp_path / "report")["rows"][0]
    assert row["train_s_max"] == pytest.approx(90.0) and row["train_s"] == 60


def test_a_resumed_repeat_without_a_steady_epoch_of_its_own_uses_its_variants(tmp_path):
    """Two epochs, resumed inside the second: the run has no steady epoch, so the missing
    images go at its variant's other repeats' steady speed (1000 images / 10 s)."""
    runs = [fake_run(tmp_path, 0, ["loader=bg", "+repeat=0"], [40, 10], images=1000)]
    runs.append(resumed_run(tmp_path, 1, ["loader=bg", "+repeat=1", "resume=auto"], [40, 10], at=1))
    runs.append(fake_run(tmp_path, 2, ["loader=baseline", "+repeat=0"], [40, 12], images=1000))
    row = build_report(runs, tmp_path / "report")["rows"][0]
    assert (row["train_s_min"], row["train_s_max"]) == (50, pytest.approx(40 + 30.1 + 9.9))


def test_the_repeats_of_one_variant_alone_are_one_variant(tmp_path):
    """Only repeat keys differ: each run was its own variant named after its folder (3 rows
    of 1 run), so no median and no spread."""
    runs = [
        fake_run(tmp_path, j, ["loader=baseline", f"+repeat={j}"], [9, 4 + j]) for j in range(3)
    ]
    (row,) = build_report(runs, tmp_path / "report", baseline="loader=baseline")["rows"]
    assert (row["variant"], row["runs"], row["baseline"]) == ("all runs", 3, True)
    assert (row["train_s"], row["train_s_min"], row["train_s_max"]) == (14, 13, 15)
    bare = [fake_run(tmp_path / "bare", j, [f"+repeat={j}"], [1.0]) for j in range(2)]
    (row,) = build_report(bare, tmp_path / "bare-report")["rows"]
    assert (row["variant"], row["runs"]) == ("all runs", 2)


def test_rates_are_the_steady_epochs_totals_over_their_seconds(tmp_path):
    """Steady epochs of 2 s and 8 s with 1,000 images each: the mean of their rates read
    312 images/s (500 and 125), the truth is 2,000 / 10 s = 200; the data wait likewise."""
    runs = [fake_run(tmp_path, 0, ["loader=bg"], [9, 2, 8], images=1000),
            fake_run(tmp_path, 1, ["loader=baseline"], [9, 5, 5], images=1000)]  # fmt: skip
    rows = [json.loads(x) for x in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    for r, wait, util in zip(rows, [0, 1.0, 1.0], [0, 90, 40], strict=True):
        r.update(data_wait_s=wait, data_wait_share=wait / r["epoch_time_s"], gpu_util_mean=util)
    (runs[0] / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bg, base = build_report(runs, tmp_path / "report")["rows"]
    assert bg["images_per_s"] == pytest.approx(200) and base["images_per_s"] == pytest.approx(200)
    assert bg["data_wait_share"] == pytest.approx(2 / 10)  # the mean of shares: 0.3125
    assert bg["gpu_util_mean"] == pytest.approx((90 * 2 + 40 * 8) / 10)  # not 65
    assert bg["epoch_time_s"] == 5


def test_the_time_chart_says_each_bars_run_count_and_draws_no_spread_for_one_run(
    tmp_path, monkeypatch
):
    """The title said "median of 3 run(s)" (the largest count) over a bar of 1 run, which got
    a zero-length error bar: the look of a tight spread."""
    from fastload.report import charts

    figures = []
    monkeypatch.setattr(charts.plt, "close", figures.append)
    runs = [
        fake_run(tmp_path, j, ["loader=baseline", f"+repeat={j}"], [5, 5 + j]) for j in range(3)
    ]
    runs.append(fake_run(tmp_path, 3, ["loader=bg", "+repeat=0"], [4, 4]))
    build_report(runs, tmp_path / "report", title="t")
    ax = figures[0].axes[0]
    assert "median of 1–3 runs" in ax.get_title() and "hatched = 1 run" in ax.get_title()
    (bars,) = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert [b.get_hatch() for b in bars] == [None, "//"]
    (errors,) = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    xs = {x for seg in errors.lines[2][0].get_segments() for x, _ in seg}
    assert xs == {0}  # the baseline's 3 runs only
    assert [t.get_text() for t in ax.texts] == ["1.00×\nn=3", "0.73×\nn=1"]


def test_report_json_says_what_made_it_and_where_each_run_came_from(tmp_path, capsys, monkeypatch):
    """report.json held rows and folder paths only: not the commit, host or date it was
    made from, nor where its runs were made."""
    import datetime
    import socket

    runs = []
    for job, (host, rev) in enumerate(
        [("node-a", "abc1234"), ("node-b", "abc1234"), ("node-b", None)]
    ):
        run = fake_run(tmp_path, job, [f"loader={'bg' if job else 'baseline'}"], [2, 2])
        (run / ".fastload-run.json").write_text(json.dumps({"launch": "x", "host": host, "pid": 1}))
        if rev:
            (run / "summary.json").write_text(json.dumps({"metric": "val_acc1", "git_rev": rev}))
        runs.append(run)
    assert report_main([*map(str, runs), "--out", str(tmp_path / "report")]) == 0
    err = capsys.readouterr().err
    assert "warning: the runs come from 2 hosts (node-a, node-b)" in err and "commits" not in err
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    described = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip() or None  # fmt: skip
    assert report["made"]["commit"] == described and report["made"]["host"] == socket.gethostname()
    assert datetime.datetime.fromisoformat(report["made"]["date"]).tzinfo is not None
    assert report["runs"] == [
        {
            "folder": str(runs[0]),
            "variant": "loader=baseline",
            "host": "node-a",
            "commit": "abc1234",
        },
        {"folder": str(runs[1]), "variant": "loader=bg", "host": "node-b", "commit": "abc1234"},
        {"folder": str(runs[2]), "variant": "loader=bg", "host": "node-b", "commit": None},
    ]
    assert (
        len(report["warnings"]) == 1
        and "Warning: the runs come from 2 hosts" in (tmp_path / "report" / "report.md").read_text()
    )
    from fastload import host

    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    (tmp_path / "no-git").mkdir()
    monkeypatch.setattr(host, "__file__", str(tmp_path / "no-git" / "host.py"))
    assert host.code_version() is None  # outside a checkout: null


def test_report_refuses_what_is_not_a_run_and_an_unknown_baseline(tmp_path, capsys):
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    assert report_main([str(empty)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    run = fake_run(tmp_path, 0, ["loader=bg"], [1.0])
    assert report_main([str(run), "--baseline", "loader=prefetch"]) == 2
    err = capsys.readouterr().err
    assert "matches no variant" in err and "loader=bg" in err or str(run.name) in err
    # a repeat that stopped after one of its epochs is not a fast run
    stopped = fake_run(tmp_path / "stopped", 0, ["loader=bg"], [1.0])
    (stopped / "summary.json").unlink()
    assert report_main([str(run), str(stopped)]) == 2
    err = capsys.readouterr().err
    assert f"{stopped} holds 1 epoch(s) but no summary.json" in err and "resume=auto" in err


def test_report_refuses_a_baseline_that_matches_several_variants(tmp_path, capsys):
    """README's `--baseline storage=slow_disk` over two sweeps (logger.group differs) took the
    first sweep's slow_disk and normalised the other sweep's runs to it."""
    runs = []
    for sweep, slow in ((1, 20), (2, 30)):
        for job, storage in enumerate(["slow_disk", "disk"]):
            runs.append(fake_run(tmp_path / f"small-{sweep}", job,
                                 [f"storage={storage}", f"logger.group=s{sweep}", "+repeat=0"],
                                 [slow if storage == "slow_disk" else 10]))  # fmt: skip
    args = [str(r) for r in runs] + ["--out", str(tmp_path / "report")]
    assert report_main([*args, "--baseline", "storage=slow_disk"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "error: --baseline 'storage=slow_disk' matches 2"
    )
    assert "logger.group=s1 storage=slow_disk; logger.group=s2 storage=slow_disk" in err
    assert report_main([*args, "--baseline", "storage=slow_disk logger.group=s2"]) == 0
    rows = json.loads((tmp_path / "report" / "report.json").read_text())["rows"]
    assert [r["variant"] for r in rows if r["baseline"]] == ["logger.group=s2 storage=slow_disk"]


def test_report_refuses_an_out_folder_it_cannot_write(tmp_path, capsys):
    run = fake_run(tmp_path, 0, ["loader=bg"], [1.0])
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "report"
    assert report_main([str(run), "--out", str(out)]) == 2  # was a raw NotADirectoryError
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write the report into {out} (")
    assert err.endswith("): give --out a writable folder.\n")


def sweep_points(name: str) -> list[list[str]]:
    """Every job's overrides of experiment NAME's sweep (its hydra.sweeper.params)."""
    exp = OmegaConf.load(CONF / "experiment" / f"{name}.yaml")
    params = exp.hydra.sweeper.params
    axes = [[f"{k}={v.strip()}" for v in str(params[k]).split(",")] for k in params]
    return [list(p) for p in itertools.product(*axes)]


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_variant_of_every_experiment_composes(name, tmp_path):
    assert (CONF / "experiment" / f"{name}.yaml").is_file(), f"{name}.sh has no experiment yaml"
    points = sweep_points(name)
    assert len(points) >= 2, "an experiment compares at least two variants"
    for point in points:
        cfg = compose_config([f"experiment={name}", *point], tmp_path)
        cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
        OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves


def test_scripts_refuse_a_missing_or_unknown_size():
    for args in ([], ["huge"]):
        out = subprocess.run(["bash", str(SCRIPTS / "storage.sh"), *args], capture_output=True,
                             text=True)  # fmt: skip
        assert out.returncode == 2 and "usage:" in out.stderr and "tiny|small|full" in out.stderr
    out = subprocess.run(["bash", str(SCRIPTS / "storage.sh"), "full"], capture_output=True,
                         text=True, env={k: v for k, v in os.environ.items() if k != "DATA"})  # fmt: skip
    assert out.returncode != 0 and "DATA=" in out.stderr


def run_script(name: str, tmp_path: Path) -> Path:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "FASTLOAD_CACHE": str(tmp_path / "cache"),
        "FASTLOAD_REPRODUCE_DIR": str(tmp_path / "out"),
        "WANDB_SILENT": "true",
    }
    out = subprocess.run(["bash", str(SCRIPTS / f"{name}.sh"), "tiny"], capture_output=True,
                         text=True, env=env, timeout=900, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (sweep,) = (tmp_path / "out" / name).iterdir()
    report = json.loads((sweep / "report" / "report.json").read_text())
    jobs = sorted(p for p in sweep.iterdir() if p.name.isdigit())
    # every variant of the sweep; batch-size at tiny size: 2 of its 5 batch sizes x 3 stores
    expected = 6 if name == "batch-size" else len(sweep_points(name))
    if name == "backends":  # the script adds the backends this machine has
        expected += int(torch.cuda.is_available()) + int(
            importlib.util.find_spec("accimage") is not None
        )
    assert len(report["rows"]) == expected and len(jobs) >= expected
    assert sum(r["baseline"] for r in report["rows"]) == 1
    for row in report["rows"]:
        assert row["train_s"] > 0 and row["normalized"] > 0, row
    for png in report["charts"]:
        assert (sweep / "report" / png).read_bytes().startswith(PNG_MAGIC)
    # the W&B runs of one experiment share a group and tags
    cfg = OmegaConf.load(jobs[0] / ".hydra" / "config.yaml")
    assert cfg.logger.group.startswith(f"{name}-tiny-") and name in cfg.logger.tags
    assert "| variant |" in out.stdout  # the table is printed
    return sweep


@pytest.mark.parametrize(
    "name, wanted, unwanted",
    [
        # the experiment's batch (32) at every size: the size's (256) replaced it
        ("workers", [], ["trainer.batch_size=256"]),
        # packs at twice ImageNet's 224 px crop: the experiment's 128 px (twice the synthetic
        # set's 64 px crop) had every ImageNet crop upscaled from a smaller image
        ("preprocessing", ["preresize_side=448"], []),
    ],
)
def test_full_size_keeps_what_the_experiment_is_about(name, wanted, unwanted, tmp_path):
    calls = tmp_path / "calls"
    fake = tmp_path / "python"  # records every command line the script runs, runs nothing
    fake.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "DATA": str(tmp_path),
           "FASTLOAD_REPRODUCE_DIR": str(tmp_path / "out")}  # fmt: skip
    out = subprocess.run(["bash", str(SCRIPTS / f"{name}.sh"), "full"], capture_output=True,
                         text=True, env=env, timeout=60, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    sweep = calls.read_text().splitlines()[0].split()
    assert "dataset=imagenet" in sweep and all(w in sweep for w in wanted), sweep
    assert not any(u in sweep for u in unwanted), sweep


def test_combined_tiny_runs_end_to_end(tmp_path):
    run_script("combined", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in EXPERIMENTS if n != "combined"])
def test_every_experiment_runs_at_tiny_size(name, tmp_path):
    run_script(name, tmp_path)


def test_slow_disk_emulation_really_slows_each_read(tiny_folder, tmp_path):
    """storage=slow_disk: every read takes at least the latency + size / bandwidth (a lower
    bound that sleeping guarantees, not a speed target), and it is accounted as read time."""
    from fastload.pipeline import build_layout, build_storage

    cfg = compose_config(["storage=slow_disk", f"dataset.root={tiny_folder}",
                          "storage.latency_ms=30", "storage.mb_per_s=1"], tmp_path)  # fmt: skip
    reader = build_storage(cfg).open(build_layout(cfg), "train")
    nbytes = len(reader.get(0, "image")) + len(reader.get(1, "image"))
    stats = reader.epoch_stats()
    floor = 2 * 0.030 + nbytes / 1e6  # two reads: latency each, then the bytes at 1 MB/s
    assert stats["read_s"] >= floor * 0.99, stats
    fast = build_storage(compose_config([f"dataset.root={tiny_folder}"], tmp_path))
    fast_reader = fast.open(build_layout(cfg), "train")
    sample(fast_reader, 0)
    assert fast_reader.epoch_stats()["read_s"] < 0.030  # the plain disk is not throttled


@pytest.mark.parametrize("bad", [["storage.latency_ms=5"], ["storage.latency_ms=5",
                                 "storage.mb_per_s=0"]])  # fmt: skip
def test_slow_disk_needs_both_numbers(bad, tiny_folder, tmp_path):
    from fastload.errors import ConfigError
    from fastload.pipeline import build_storage

    cfg = compose_config(["storage=disk", "storage.mb_per_s=null", *bad], tmp_path)
    with pytest.raises(Exception) as info:
        build_storage(cfg)
    from fastload.errors import user_error

    err = user_error(info.value)
    assert isinstance(err, ConfigError) and "storage.mb_per_s" in err.user_message


def test_item_cost_adds_cpu_work_per_sample(tiny_folder, tmp_path):
    import time

    from fastload.pipeline import build_backend, build_layout, build_storage
    from fastload.tasks.base import build_task

    cfg = compose_config([f"dataset.root={tiny_folder}", "dataset.num_classes=3",
                          "dataset.task.item_cost_ms=40"], tmp_path)  # fmt: skip
    reader = build_storage(cfg).open(build_layout(cfg), "train")
    ds = build_task(cfg).dataset("train", reader, build_backend(cfg))
    assert ds.item_cost_ms == 40
    cpu0, wall0 = time.process_time(), time.perf_counter()
    ds[(0, 0)]
    assert time.perf_counter() - wall0 >= 0.040
    # it burns 40 ms of CPU (a sleep would not), however busy the machine is
    assert time.process_time() - cpu0 >= 0.040


def test_report_keeps_a_sweeps_job_order(tmp_path):
    runs = [fake_run(tmp_path, j, [f"loader.num_workers={j}"], [1.0 + j]) for j in range(12)]
    shell_order = sorted(runs, key=lambda p: p.name)  # what a glob gives: 0, 1, 10, 11, 2, ...
    rows = build_report(shell_order, tmp_path / "report")["rows"]
    assert [r["variant"] for r in rows] == [f"loader.num_workers={j}" for j in range(12)]


def test_install_pillow_simd_prints_its_help_and_changes_nothing():
    """`--help` ran the install (apt-get, pip uninstall pillow): it takes no arguments."""
    script = str(REPO / "scripts" / "install_pillow_simd.sh")
    env = {**os.environ, "PYTHON": "/bin/false"}  # had it started installing, it would stop
    out = subprocess.run(["bash", script, "--help"], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and "Replace Pillow by Pillow-SIMD" in out.stdout, out
    assert "[install_pillow_simd]" not in out.stdout + out.stderr
    out = subprocess.run(["bash", script, "now"], capture_output=True, text=True, env=env)
    assert out.returncode == 2 and "takes no arguments (got: now)" in out.stderr
