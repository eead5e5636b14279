"""python -m fastload.bench: bad options are refused with the valid names, a missing dataset is
one clear line, the DataLoader rows time whole warm epochs, every result lands in one place."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
from conftest import CONF, make_image_folder

from fastload.bench.__main__ import main


def refused(argv, capsys) -> str:
    """The one error line of a bench command that argparse refuses (exit 2, no traceback)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "argv, bad, valid",
    [
        (["storage", "--stores", "disk,lmbd"], "'lmbd'", ["disk", "lmdb", "shards-raw"]),
        (["storage", "--backend", "turbbo"], "'turbbo'", ["pil", "turbo", "nvjpeg"]),
        (["backends", "--backends", "pil,turbo2"], "'turbo2'", ["pil+draft", "turbo+cv2+fast"]),
        (["loaders", "--strategies", "prefetchbg"], "'prefetchbg'", ["bg", "prefetch+bg"]),
    ],
)
def test_unknown_names_are_refused_with_the_valid_ones(argv, bad, valid, capsys):
    line = refused(argv, capsys)
    assert line.startswith(f"python -m fastload.bench {argv[0]}: error: {argv[1]} ")
    assert f"unknown {bad}" in line and all(name in line for name in valid), line


def test_the_config_names_users_know_are_accepted():
    from fastload.bench import backends, loaders, storage
    from fastload.decode.pil import PILBackend
    from fastload.decode.turbo import TurboBackend

    names = sorted(f.stem for f in (CONF / "backend").glob("*.yaml"))
    assert {"pil", "pillow-simd", "accimage", "turbo", "nvjpeg"} <= set(names)
    args = backends.parse(["--backends", ",".join([*names, *backends.VARIANTS])])
    assert args.backends.split(",") == [*names, *backends.VARIANTS]
    strategies = ",".join(sorted(f.stem for f in (CONF / "loader").glob("*.yaml")))
    assert loaders.parse(["--strategies", strategies]).strategies == strategies
    assert storage.parse(["--stores", "lmdb,disk"]).stores == "lmdb,disk"
    # bench storage takes the same backend names, variants included (their overrides)
    assert storage.parse(["--backend", "turbo+cv2+fast"]).backend == "turbo+cv2+fast"
    assert storage.backend_overrides("turbo+cv2+fast") == [
        "backend=turbo",
        *backends.VARIANTS["turbo+cv2+fast"][1],
    ]
    assert storage.backend_overrides("pil") == ["backend=pil"]
    # the variants are config names plus overrides, built through the Hydra config
    draft = backends.build("pil+draft")
    assert isinstance(draft, PILBackend) and draft.draft
    fast = backends.build("turbo+cv2+fast")
    assert isinstance(fast, TurboBackend) and fast.resize == "cv2"
    assert fast.fastdct and fast.fastupsample and fast.dct_scale


@pytest.mark.parametrize("suite", ["backends", "loaders", "storage"])
def test_a_missing_root_or_one_without_train_is_one_clear_error(suite, tmp_path, capsys):
    line = refused([suite, "--root", str(tmp_path / "nope")], capsys)
    assert f"error: --root {tmp_path / 'nope'}: no such folder" in line
    (tmp_path / "flat").mkdir()
    line = refused([suite, "--root", str(tmp_path / "flat")], capsys)
    assert f"error: --root {tmp_path / 'flat'} has no train/ folder" in line


def test_bench_train_names_a_missing_dataset_root(tmp_path, capsys):
    root = tmp_path / "nope"
    assert main(["train", f"dataset.root={root}", "dataset.prepare=null"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: dataset folder {root}/train does not exist")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_backends_refuses_a_set_too_small_for_the_dataloader_rows(tmp_path, capsys):
    root = make_image_folder(tmp_path / "d", per_split=(5, 1), size=(32, 24))  # 15 images
    argv = ["backends", "--root", str(root), "--workers", "1", "--batch-size", "4"]
    line = refused(argv, capsys)
    # 4 x (1 worker x prefetch_factor 2) batches of 4 = 32 images
    assert f"--root {root}: 15 training images" in line
    assert "at least 32 images" in line and "--no-loaders" in line


def test_backends_rows_of_an_adequate_set(tmp_path, capsys):
    import torch

    root = make_image_folder(tmp_path / "d", per_split=(11, 1), size=(32, 24))  # 33 >= 32
    out = tmp_path / "backends.json"
    argv = ["backends", "--root", str(root), "--workers", "1", "--batch-size", "4"]
    argv += ["--backends", "pil,nvjpeg", "--repeats", "1", "--size", "16", "--json", str(out)]
    argv += ["--rounds", "2"]  # the DataLoader row (and FFCV's, when asked) timed twice
    assert main(argv) == 0
    got = capsys.readouterr()
    assert "x textbook" in got.out
    # the decode rows time the files the DataLoader rows load (train/: 33), not val/ too
    assert f"33 JPEGs of {root}/train, the files the DataLoader rows load" in got.err
    doc = json.loads(out.read_text())
    rows = {r["pipeline"]: r for r in doc["results"]}
    loader_rows = [r for r in doc["results"] if r["kind"] == "loader"]
    assert [r["pipeline"] for r in loader_rows] == [
        "textbook: ImageFolder+ToTensor+Normalize",
        "fastload DataLoader, backend=pil",
        # what a new iteration per epoch costs beside the streamed epochs of training
        "fastload DataLoader, backend=pil, a new iteration per epoch (timed once)",
    ]
    assert all(r["1 cores img/s"] > 0 for r in loader_rows)
    ours = loader_rows[1]
    assert len(ours["rounds_img_s"]) == 2 and min(ours["rounds_img_s"]) <= ours["1 cores img/s"]
    assert rows["backend=pil"]["1 core img/s"] > 0
    if not torch.cuda.is_available():  # GPU decode: refused here, reported as such
        assert rows["backend=nvjpeg"]["kind"] == "unavailable"
    assert doc["params"]["images"] == 33 and doc["params"]["batch_size"] == 4


def test_dataloader_rows_time_whole_epochs_after_an_untimed_one():
    from fastload.bench.backends import warm_epochs

    calls = []

    def run_epoch(epoch):
        calls.append(epoch)
        time.sleep(0.02)  # as a first batch would: inside the timed epoch
        return 10

    rate = warm_epochs(run_epoch, repeats=2)
    assert calls == [0, 1, 2]
    assert 0 < rate <= 10 / 0.02


@pytest.mark.parametrize("suite", ["backends", "loaders", "storage", "train"])
def test_every_bench_writes_under_outputs_bench(suite):
    module = importlib.import_module(f"fastload.bench.{suite}")
    assert module.parse([]).json == f"outputs/bench/{suite}.json"


@pytest.mark.parametrize(
    "module, option",
    [("fastload.bench.backends", "--json"), ("fastload.bench.loaders", "--json"),
     ("fastload.bench.storage", "--json"), ("fastload.bench.train", "--json"),
     ("fastload.doctor.pipeline", "--out")],
)  # fmt: skip
def test_an_output_that_cannot_be_written_is_refused_before_any_work(
    module, option, tmp_path, capsys
):
    """A --json under a file (or a --out that is one) was found after the whole measurement:
    a FileExistsError / NotADirectoryError traceback, exit 1, the results lost."""
    blocker = tmp_path / "f"
    blocker.write_text("")
    parse = importlib.import_module(module).parse
    prog = module.replace(".__main__", "").replace("fastload.bench.", "fastload.bench ")
    prog = prog.replace("fastload.doctor.", "fastload.doctor ")
    cases = [(blocker / "sub" / "x", f"{blocker} is a file, not a folder")]
    if option == "--out":  # a folder to write into
        cases.append((blocker, f"{blocker} is a file, not a folder"))
    else:
        cases.append((tmp_path, f"{tmp_path} is a folder; give a file name"))
    for path, why in cases:
        with pytest.raises(SystemExit) as exc:
            parse([option, str(path)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.strip().splitlines()[-1] == f"python -m {prog}: error: {option} {path}: {why}"
    # a folder that does not exist yet is fine, and nothing is left behind by the check
    fresh = tmp_path / "new" / ("out" if option == "--out" else "x.json")
    assert getattr(parse([option, str(fresh)]), option.lstrip("-")) == str(fresh)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_results_that_cannot_be_written_at_the_end_are_one_error(tmp_path, capsys):
    from fastload.bench.__main__ import reporting_errors
    from fastload.bench.common import write_json

    (tmp_path / "f").write_text("")

    def suite(argv):
        write_json(tmp_path / "f" / "x.json", "storage", {}, [])
        return 0

    assert reporting_errors(suite, []) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write the results to {tmp_path / 'f' / 'x.json'}: ")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bench_train_names_its_worst_epoch_wait_share_as_such(capsys):
    """The key read 'data_wait_share_epochs_2_on', as if of epochs 2 on together; it is the
    worst of those epochs' shares (the target is per epoch)."""
    from types import SimpleNamespace

    from fastload.bench.train import print_targets, summarize

    rows = [{"train_images": 8, "wall_s": 1.0, "epoch_time_s": 1.0, "data_wait_s": w,
             "data_wait_share": w} for w in (0.5, 0.01, 0.04, 0.02)]  # fmt: skip
    summary = summarize(rows, 4.0, 4.0, 2, 0, SimpleNamespace(model=None, step_ms=10.0),
                        ceiling=rows)  # fmt: skip
    assert summary["worst_data_wait_share_epochs_2_on"] == 0.04
    assert "data_wait_share_epochs_2_on" not in summary
    print_targets(summary, SimpleNamespace(model=None))
    assert "epochs >= 2: worst data-wait share 4.0 %" in capsys.readouterr().out


def test_storage_targets_take_each_rounds_ratio_then_the_median(capsys):
    """--rounds: a target's ratio is taken within each round (FFCV beside fastload), the
    verdict on the median; the table's rows are each figure's median over the rounds."""
    from fastload.bench import storage

    def round_rows(raw, ffcv_raw, disk, ffcv_jpeg):
        def row(name, rate):
            return {
                "storage": name,
                "cache": "warm",
                "epoch_img_s": rate,
                "epochs_img_s": [rate],
                "images": 18,
            }

        return [
            row("disk", disk),
            {**row("disk", disk / 2), "cache": "cold"},
            row("shards-raw", raw),
            row("ffcv-raw-256", ffcv_raw),
            row("ffcv-jpeg-full", ffcv_jpeg),
        ]

    # the machine slows down by half in round 2: both sides do, the ratio holds
    rounds = [round_rows(21, 10, 30, 20), round_rows(11, 5, 14, 10), round_rows(19, 10, 40, 20)]
    args = storage.parse(["--rounds", "3"])
    targets = {t["store"]: t for t in storage.target_ratios(rounds, args)}
    assert targets["shards-raw"]["ratios"] == [2.1, 2.2, 1.9]
    assert targets["shards-raw"]["median_ratio"] == 2.1 and targets["shards-raw"]["met"]
    assert targets["disk"]["ratios"] == [1.5, 1.4, 2.0] and not targets["disk"]["met"]
    # no FFCV row in a round: that round judges nothing; in none: not judged at all
    no_peer = [[r for r in rows if not r["storage"].startswith("ffcv")] for rows in rounds]
    partial = {t["store"]: t for t in storage.target_ratios([no_peer[0], *rounds[1:]], args)}
    assert partial["shards-raw"]["ratios"] == [2.2, 1.9]
    unjudged = storage.target_ratios(no_peer, args)
    assert {(t["store"], t["measured"]) for t in unjudged} == {("shards-raw", False),
                                                             ("disk", False)}  # fmt: skip
    storage.print_targets(unjudged)
    assert "shards-raw vs FFCV raw: not judged (no FFCV row" in capsys.readouterr().out
    rows = {(r["storage"], r["cache"]): r for r in storage.combine_rounds(rounds)}
    assert rows[("shards-raw", "warm")]["epoch_img_s"] == 19
    assert rows[("shards-raw", "warm")]["rounds_epoch_img_s"] == [21, 11, 19]
    assert rows[("disk", "cold")]["epochs_img_s"] == [15, 7, 20]
    # an even number of rounds: figures take the middle two's mean, counts stay counts
    even = storage.combine_rounds([*rounds, round_rows(20, 10, 30, 20)])
    assert even[2]["epoch_img_s"] == 19.5 and even[2]["images"] == 18
    assert isinstance(even[2]["images"], int)
    with pytest.raises(SystemExit):
        storage.parse(["--rounds", "0"])
    with pytest.raises(SystemExit):  # the peers read train: val against them compares nothing
        storage.parse(["--split", "val", "--ffcv-python", sys.executable])
    assert "FFCV and DALI read the train split" in capsys.readouterr().err


@pytest.mark.parametrize("suite", ["storage", "backends"])
def test_a_peer_python_that_is_not_there_is_refused_before_any_work(suite, capsys):
    """README's placeholder path ran the whole benchmark, then said the row failed (exit 0)."""
    module = importlib.import_module(f"fastload.bench.{suite}")
    for option, script in (("--ffcv-python", "bench_ffcv.py"), ("--dali-python", "bench_dali.py")):
        with pytest.raises(SystemExit) as stop:
            module.parse([option, "/path/to/env/bin/python"])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and option in err and f"scripts/{script} --help" in err
    assert module.parse(["--ffcv-python", sys.executable]).ffcv_python == sys.executable


def test_rounds_take_turns_at_going_first(monkeypatch):
    """--rounds: fastload's rows run first in even rounds and FFCV's in odd ones (a drift
    within a round then favours each side in turn); the rows come back in the same order."""
    from fastload.bench import backends, storage

    calls = []

    def store(name, root, args):
        calls.append(name)
        return [{"storage": name, "cache": "warm", "epoch_img_s": 1.0}]

    def ffcv(args, root):
        calls.append("ffcv")
        return [{"storage": "ffcv-jpeg-full", "cache": "warm", "epoch_img_s": 1.0}]

    monkeypatch.setattr(storage, "measure_store", store)
    monkeypatch.setattr(storage, "ffcv_rates", ffcv)
    args = storage.parse(["--stores", "disk,shards-raw", "--ffcv-python", sys.executable])
    rows = [storage.round_rows(r, Path("."), args) for r in range(3)]
    order = ["disk", "shards-raw", "ffcv", "ffcv", "disk", "shards-raw", "disk", "shards-raw"]
    assert calls == [*order, "ffcv"]
    assert all(
        [r["storage"] for r in rr] == ["disk", "shards-raw", "ffcv-jpeg-full"] for rr in rows
    )

    calls.clear()
    peer_args = []
    monkeypatch.setattr(backends, "fastload_loader_rate", lambda *a: calls.append("ours") or 2.0)
    monkeypatch.setattr(backends, "floor_rate", lambda *a: calls.append("floor") or 4.0)
    monkeypatch.setattr(
        backends,
        "run_ffcv",
        lambda *a, **k: calls.append("ffcv") or peer_args.append(a) or {"images_per_s": 1.0},
    )
    args = backends.parse(["--rounds", "3", "--ffcv-python", sys.executable, "--repeats", "4",
                           "--batch-size", "32"])  # fmt: skip
    got = backends.target_rounds(
        args, Path("."), "pil", object(), (224, 2, 32, 4), lambda *a, **k: None
    )
    assert calls == ["ours", "floor", "ffcv", "floor", "ffcv", "ours", "ffcv", "ours", "floor"]
    # the peer times what the rows beside it do: the batch, and the best of --repeats epochs
    assert all(a[-4:] == ("--epochs", "5", "--batch-size", "32") for a in peer_args), peer_args
    assert [g["ours"] for g in got] == [2.0] * 3


def test_peer_rounds_rotate_and_the_peer_targets_hold_in_every_round(monkeypatch):
    """With FFCV and DALI both given, each round runs every side once, the order rotating;
    'ahead of a peer' must hold in every round (behind DALI once: not met), and the loader is
    judged against the bare-decode ceiling of the same round (timed once, before the rounds,
    it gave one ratio against the rounds' median)."""
    from fastload.bench import backends

    calls, rows = [], []
    dali_rates = iter([2.0, 4.0, 2.0])
    floors = iter([4.0, 3.0, 6.0])
    monkeypatch.setattr(backends, "fastload_loader_rate", lambda *a: calls.append("ours") or 3.0)
    monkeypatch.setattr(backends, "floor_rate", lambda *a: calls.append("floor") or next(floors))
    monkeypatch.setattr(
        backends, "run_ffcv", lambda *a, **k: calls.append("ffcv") or {"images_per_s": 1.0}
    )
    monkeypatch.setattr(
        backends,
        "run_dali",
        lambda *a, **k: calls.append("dali") or {"images_per_s": next(dali_rates)},
    )
    args = backends.parse(
        ["--rounds", "3", "--ffcv-python", sys.executable, "--dali-python", sys.executable]
    )
    got = backends.target_rounds(
        args, Path("."), "pil", object(), (224, 2, 64, 1), lambda *a, **k: rows.append(a)
    )
    assert calls == ["ours", "floor", "ffcv", "dali", "floor", "ffcv", "dali", "ours",
                     "ffcv", "dali", "ours", "floor"]  # fmt: skip
    assert [r[0] for r in rows][-1].startswith("DALI CPU") and rows[-1][3] == 2.0  # the median
    targets = backends.print_targets(got)
    assert targets["ffcv"]["met"] and targets["ffcv"]["ratios"] == [3.0] * 3
    assert not targets["dali"]["met"] and targets["dali"]["median_ratio"] == 1.5
    assert targets["bare_decode"]["ratios"] == [0.75, 1.0, 0.5]
    assert targets["bare_decode"]["median_ratio"] == 0.75 and not targets["bare_decode"]["met"]


def test_a_peer_script_gives_its_json_or_an_error_row(tmp_path):
    """run_dali / run_ffcv run scripts/bench_<peer>.py with the peer env's python: its last
    JSON line is the result; a crash, a missing python or output that is not JSON is an
    error entry (a row with no figure), never an exception that ends the benchmark."""
    from fastload.bench.common import run_dali, run_ffcv

    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "a log line"\nprintf \'{"argv": "%s"}\\n\' "$*"\n')
    fake.chmod(0o755)
    got = run_dali(str(fake), tmp_path, 160, 3, "--write-mode", "raw")
    argv = got["argv"].split()
    assert argv[0].endswith("scripts/bench_dali.py") and Path(argv[0]).is_file()
    assert argv[1:] == ["--root", str(tmp_path), "--size", "160", "--workers", "3",
                        "--write-mode", "raw"]  # fmt: skip
    assert run_ffcv(str(fake), tmp_path, 224, 2)["argv"].split()[0].endswith("bench_ffcv.py")
    assert "error" in run_dali("/bin/false", tmp_path, 224, 2)
    assert "error" in run_dali(str(tmp_path / "no-such-python"), tmp_path, 224, 2)
    words = tmp_path / "words"
    words.write_text("#!/bin/sh\necho 'Traceback: ModuleNotFoundError: nvidia.dali'\n")
    words.chmod(0o755)
    assert run_dali(str(words), tmp_path, 224, 2) == {
        "error": "Traceback: ModuleNotFoundError: nvidia.dali"
    }
    assert run_dali("/bin/false", tmp_path, 224, 2) == {"error": "bench_dali.py: exit 1"}


def test_storage_rounds_run_both_peers_in_turn(monkeypatch):
    """bench storage with FFCV and DALI: the peers after the stores in even rounds, before
    them in odd ones, their own order turning; DALI's rows feed their own target lines."""
    from fastload.bench import storage

    calls = []

    def peer(name):
        def rates(args, root):
            calls.append(name)
            return [{"storage": f"{name}-jpeg", "cache": "warm", "epoch_img_s": 1.0}]

        return rates

    monkeypatch.setattr(
        storage,
        "measure_store",
        lambda name, root, args: (
            calls.append(name) or [{"storage": name, "cache": "warm", "epoch_img_s": 3.0}]
        ),
    )
    monkeypatch.setattr(storage, "ffcv_rates", peer("ffcv"))
    monkeypatch.setattr(storage, "dali_rates", peer("dali"))
    args = storage.parse(
        ["--stores", "disk", "--ffcv-python", sys.executable, "--dali-python", sys.executable]
    )
    rounds = [storage.round_rows(r, Path("."), args) for r in range(2)]
    assert calls == ["disk", "ffcv", "dali", "dali", "ffcv", "disk"]
    targets = storage.target_ratios(rounds, args)
    dali = [t for t in targets if t["reference"] == "DALI CPU JPEG"]
    assert len(dali) == 1 and dali[0]["ratios"] == [3.0, 3.0] and dali[0]["met"]


def test_host_stage_benches_refuse_a_backend_that_decodes_on_the_device(tiny_folder):
    """bench storage / backends time the loader's host stage; a backend that decodes in
    device prep (backend=nvjpeg) ships undecoded bytes there: its rows would time no decode."""
    from fastload.bench.common import compose, product_loader
    from fastload.decode.pil import PILBackend
    from fastload.errors import ConfigError

    cfg = compose([f"dataset.root={tiny_folder}", "dataset.prepare=null"])
    gpu_decoding = PILBackend()
    gpu_decoding.device_decoder = lambda images, encoded, device: images
    with pytest.raises(ConfigError, match="decodes in device prep.*no decode at all"):
        product_loader(cfg, backend=gpu_decoding)
    assert product_loader(cfg, backend=PILBackend()).dataset.reader  # a host decoder: timed


def test_gpu_timeline_sums_each_streams_work_and_the_calls_that_wait():
    """bench train --profile's reading of a Kineto trace: per stream its kernel and copy time
    and the share of the window it kept busy (overlaps counted once), its heaviest kernels,
    and the host calls that block (a cudaFree, a stream sync: not launches or async copies)."""
    from fastload.bench.gpu_timeline import summarize

    def span(cat, name, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}

    trace = {"traceEvents": [
        span("cpu_op", "aten::mm", 0, 1000),  # the window: 0 .. 1000 us
        span("kernel", "sm90_gemm", 0, 400, stream=7),
        span("kernel", "sm90_gemm", 300, 300, stream=7),  # overlaps the first: busy 0..600
        span("kernel", "relu", 700, 100, stream=7),
        span("gpu_memcpy", "Memcpy HtoD", 100, 50, stream=13),
        span("kernel", "nvjpeg_idct", 150, 200, stream=13),
        span("gpu_memset", "Memset", 850, 50, stream=13),
        span("cuda_runtime", "cudaLaunchKernel", 0, 5),
        span("cuda_runtime", "cudaMemcpyAsync", 10, 5),
        span("cuda_runtime", "cudaFree", 20, 300),
        span("cuda_runtime", "cudaStreamSynchronize", 400, 100),
        span("cuda_runtime", "cudaFree", 600, 100),
        {"ph": "M", "name": "thread_name", "args": {"name": "python"}},
    ]}  # fmt: skip
    got = summarize(trace)
    assert got["window_ms"] == pytest.approx(1.0)
    model, side = got["streams"]
    assert model["stream"] == 7 and model["kernels_ms"] == pytest.approx(0.8)
    assert model["busy_share"] == pytest.approx(0.7)  # 0..600 and 700..800
    assert model["top_kernels"][0] == "sm90_gemm 0.7 ms"
    assert side["stream"] == 13 and side["copies_ms"] == pytest.approx(0.1)
    assert side["busy_share"] == pytest.approx(0.3)  # 100..350, 850..900
    assert got["gpu_busy_share"] == pytest.approx(0.75)  # any stream: 0..600, 700..800, 850..900
    calls = {c["call"]: c for c in got["blocking"]}
    assert set(calls) == {"cudaFree", "cudaStreamSynchronize"}
    assert calls["cudaFree"]["count"] == 2 and calls["cudaFree"]["total_ms"] == pytest.approx(0.4)
    assert got["blocking"][0]["call"] == "cudaFree"  # the most time first
    empty = summarize({"traceEvents": []})
    assert empty["streams"] == [] and empty["gpu_busy_share"] is None


def test_gpu_timeline_charges_the_model_streams_idle_gaps_to_the_late_host_or_to_waiting():
    """A gap on the model's stream whose next kernel was launched only after the stream went
    idle is the host's, charged to the launching thread by its most specific name; a gap
    whose next kernel was queued in time (it waited for another stream's event) is waiting."""
    from fastload.bench.gpu_timeline import idle_line, summarize

    def span(cat, name, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1,
                "tid": args.pop("tid", 0), "args": args}  # fmt: skip

    def thread(tid, name):
        return {"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": name}}

    trace = {"traceEvents": [
        span("cuda_runtime", "cudaLaunchKernel", 0, 5, correlation=1, tid=11),
        span("kernel", "conv", 10, 100, stream=7, correlation=1),  # busy 10 .. 110
        span("cuda_runtime", "cudaLaunchKernel", 20, 5, correlation=2, tid=11),
        span("kernel", "bn", 150, 50, stream=7, correlation=2),  # 40 us gap, launched in time
        span("cuda_runtime", "cudaLaunchKernel", 290, 10, correlation=3, tid=12),
        span("kernel", "relu", 305, 20, stream=7, correlation=3),  # 105 us gap, launch at 300
        span("cuda_runtime", "cudaLaunchKernel", 390, 20, correlation=4, tid=11),
        span("kernel", "add", 420, 30, stream=7, correlation=4),  # 95 us gap, launch at 410
        span("kernel", "nvjpeg_idct", 0, 100, stream=13, correlation=99),  # not the model's
        thread(11, "thread 11 (python)"), thread(12, "thread 12 (pt_autograd_0)"),
        thread(12, "thread 12 (python)"),
    ]}  # fmt: skip
    got = summarize(trace)["idle"]
    assert got["stream"] == 7 and got["span_ms"] == pytest.approx(0.44)  # 10 .. 450
    assert got["idle_ms"] == pytest.approx(0.24)
    assert got["waiting_ms"] == pytest.approx(0.04)
    assert got["host_ms"] == pytest.approx(0.2)
    assert got["host_by_thread"] == pytest.approx(
        {"thread 12 (pt_autograd_0)": 0.105, "thread 11 (python)": 0.095}
    )
    line = idle_line(summarize(trace))
    assert "the host late 0 ms (thread 12 (pt_autograd_0) 0 ms" in line and "waiting 0 ms" in line
    assert summarize({"traceEvents": []})["idle"] is None


def test_bench_train_profile_runs_one_more_epoch_left_out_of_the_figures(tiny_folder, tmp_path,
                                                                        capsys):  # fmt: skip
    from fastload.bench.__main__ import main

    out = tmp_path / "b" / "train.json"
    data = [f"dataset.root={tiny_folder}", "dataset.prepare=null", "dataset.num_classes=3",
            "dataset.train_transform.size=32", "dataset.val_transform.size=32",
            "trainer.batch_size=4", "loader.num_workers=0", "backend=pil", "trainer.device=cpu"]  # fmt: skip
    argv = ["train", "--step-ms", "5", "--epochs", "2", "--steps-per-epoch", "2", "--profile"]
    assert main([*argv, "--json", str(out), *data]) == 0
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())["results"]
    assert [r["epoch"] for r in rows] == [0, 1, "all", "profiled"]  # the third epoch: profiled
    assert rows[2]["epochs"] == 2
    assert rows[2]["wall_s"] == pytest.approx(rows[0]["wall_s"] + rows[1]["wall_s"])
    for loop, name in (("run", "train.trace.json"), ("ceiling", "train.ceiling.trace.json")):
        events = json.loads((out.parent / name).read_text())["traceEvents"]
        assert any(e.get("cat") == "cpu_op" for e in events), loop  # the step's torch ops
        assert rows[3][loop]["window_ms"] > 0
        assert rows[3][loop]["gpu_busy_share"] is None  # a CPU run: no GPU activity
    assert "profiled epoch, run:" in text and "no GPU activity recorded" in text


@pytest.mark.parametrize(
    "module, parser, option, value",
    [
        ("fastload.bench.train", "parse", "--json", "x.json"),
        ("fastload.bench.loaders", "parse", "--json", "x.json"),
        ("fastload.doctor.pipeline", "parse", "--out", "x"),
        ("fastload.doctor.__main__", "parse_env", "--local-ranks", 2),
    ],
)
def test_overrides_may_come_before_and_after_options(module, parser, option, value):
    """`... trainer.batch_size=256 --json x.json backend=nvjpeg`: every override is taken,
    not refused as an unrecognized argument for coming after an option."""
    parse = getattr(importlib.import_module(module), parser)
    args = parse(["trainer.batch_size=8", option, str(value), "backend=pil", "loader=bg"])
    assert args.override == ["trainer.batch_size=8", "backend=pil", "loader=bg"]
    assert getattr(args, option.lstrip("-").replace("-", "_")) == value


def test_the_suites_are_the_modules_with_a_main_and_help_lists_them(capsys):
    from fastload.bench.__main__ import suites

    assert suites() == ["backends", "loaders", "storage", "train"]  # not gpu_timeline, common
    for suite in suites():
        assert callable(importlib.import_module(f"fastload.bench.{suite}").main)
    for flag in ("--help", "-h"):
        assert main([flag]) == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: python -m fastload.bench {backends,loaders,storage,train}")
        assert "  train     the real training loop" in out
    for argv, what in ((["gpu_timeline"], "unknown suite 'gpu_timeline'"),
                       (["foo"], "unknown suite 'foo'"), ([], "no suite given")):  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {what}; the suites: backends, loaders, storage, train")
        assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "suite, argv, message",
    [
        ("train", ["--step-ms", "-5"], "argument --step-ms: '-5': use a number >= 0"),
        ("loaders", ["--batch-size", "0"], "argument --batch-size: '0': use a whole number >= 1"),
        ("loaders", ["--steps", "0"], "argument --steps: '0': use a whole number >= 1"),
        ("loaders", ["--step-ms", "nan"], "argument --step-ms: 'nan': use a number >= 0"),
        ("storage", ["--batch-size", "0"], "argument --batch-size: '0': use a whole number >= 1"),
        ("storage", ["--repeats", "0"], "argument --repeats: '0': use a whole number >= 1"),
        ("storage", ["--workers", "-1"], "argument --workers: '-1': use a whole number >= 0"),
        ("backends", ["--size", "0"], "argument --size: '0': use a whole number >= 1"),
        # in-process, yet its column read "0 cores img/s"
        ("backends", ["--workers", "0"], "argument --workers: '0': use a whole number >= 1"),
        (
            "storage",
            ["--quality", "101"],
            "argument --quality: '101': use a whole number from 1 to 100",
        ),
    ],
)
def test_numbers_out_of_range_are_refused_naming_the_option(suite, argv, message, capsys):
    """Each of these ran on (building the dataset and the loaders) and ended in a traceback
    (a negative sleep, a division by a batch of 0, the median of no repeat) or, for
    --steps 0, in a table of nan; argparse now refuses them before any work."""
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(f"fastload.bench.{suite}").parse(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"python -m fastload.bench {suite}: error: {message}"


def test_bench_train_refuses_the_trainer_options_train_py_refuses(tiny_folder, capsys):
    data = [f"dataset.root={tiny_folder}", "dataset.prepare=null", "dataset.num_classes=3",
            "dataset.train_transform.size=32", "dataset.val_transform.size=32",
            "loader.num_workers=0", "backend=pil", "trainer.device=cpu"]  # fmt: skip
    argv = ["train", "--step-ms", "1", "--epochs", "1", "--steps-per-epoch", "1", *data]
    assert main([*argv, "trainer.batch_size=-1"]) == 2
    err = capsys.readouterr().err
    assert (
        err == "error: trainer.batch_size=-1: use a whole number >= 1 (images per rank per step).\n"
    )


def failing_peer(tmp_path, monkeypatch):
    """bench storage's args with --ffcv-python naming a python without ffcv, the stores'
    rows faked, and a dataset root."""
    from fastload.bench import storage

    monkeypatch.setattr(storage, "measure_store", lambda name, root, args: [
        {"storage": name, "cache": "warm", "epoch_img_s": 3.0}])  # fmt: skip
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'error: ffcv is not installed in this python' >&2\nexit 2\n")
    fake.chmod(0o755)
    root = tmp_path / "data"
    root.mkdir()
    return storage.parse(["--stores", "disk", "--ffcv-python", str(fake)]), root


def test_a_peer_that_cannot_run_leaves_no_empty_packs_folder(tmp_path, monkeypatch):
    """It left an empty ROOT.packs/ beside the user's dataset."""
    from fastload.bench import storage

    args, root = failing_peer(tmp_path, monkeypatch)
    storage.round_rows(0, root, args)
    assert not Path(f"{root}.packs").exists()
    # a packs folder that was there is the user's (or an earlier run's): kept, empty or not
    Path(f"{root}.packs").mkdir()
    storage.round_rows(0, root, args)
    assert Path(f"{root}.packs").is_dir()


def test_a_peer_that_cannot_run_is_named_with_its_error(tmp_path, monkeypatch, capsys):
    """The targets said "no FFCV row in this run; --ffcv-python runs it": the option given."""
    from fastload.bench import storage

    args, root = failing_peer(tmp_path, monkeypatch)
    rounds = [storage.round_rows(0, root, args)]
    storage.print_targets(storage.target_ratios(rounds, args))
    assert (
        f"disk vs FFCV full-size JPEG: not judged (--ffcv-python {args.ffcv_python} could not "
        f"run FFCV: error: ffcv is not installed in this python)"
    ) in capsys.readouterr().out


@pytest.mark.parametrize(
    "script, module, recipe",
    [
        ("bench_ffcv.py", "ffcv", "python3.11 -m venv /work/ffcv-venv"),
        ("bench_dali.py", "nvidia.dali", "python3.11 -m venv /work/dali-venv"),
    ],
)
def test_peer_scripts_say_how_to_make_their_environment(script, module, recipe, tmp_path):
    """--help showed bare options (the recipe was only in the source), and a python without
    the peer ended in a ModuleNotFoundError traceback."""
    import importlib.util
    import subprocess
    import sys

    path = Path(__file__).resolve().parents[1] / "scripts" / script
    shown = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True)
    assert shown.returncode == 0 and f"\n  {recipe}\n" in shown.stdout
    try:
        installed = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # nvidia.dali without an nvidia package
        installed = False
    if installed:
        pytest.skip(f"{module} is installed here")
    run = subprocess.run([sys.executable, str(path), "--root", str(tmp_path)],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.count("\n") == 1 and run.stderr.startswith(
        f"error: no module '{module}' in {sys.executable}: run {path} with the python of an "
        f"environment that has "
    )
    assert f"`{path} --help` says (" in run.stderr and recipe in run.stderr


def test_the_machine_record_says_when_the_tree_had_uncommitted_changes(tmp_path, monkeypatch):
    """git_rev was the commit alone: a figure measured on edited code named a commit whose
    code did not give it."""
    import subprocess

    from fastload import host
    from fastload.bench import common

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                       cwd=tmp_path, check=True, capture_output=True)  # fmt: skip

    (tmp_path / "a.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", "a.py")
    git("commit", "-qm", "a")
    monkeypatch.setattr(host, "__file__", str(tmp_path / "a.py"))
    clean = common.machine()["git_rev"]
    (tmp_path / "a.py").write_text("x = 2\n")
    assert common.machine()["git_rev"] == clean + "-dirty" and len(clean) >= 7


def test_a_peer_epoch_that_gives_no_image_is_an_error_not_a_rate_of_zero(monkeypatch, capsys):
    """bench_ffcv.py on a set smaller than its batch (drop_last) printed images_per_s 0.0."""
    spec = importlib.util.spec_from_file_location(
        "peer_timing", Path(__file__).resolve().parents[1] / "scripts" / "peer_timing.py"
    )
    peer_timing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer_timing)
    assert len(peer_timing.time_epochs(lambda: 10, 3)) == 2  # the first epoch is not timed
    with pytest.raises(SystemExit) as stop:
        peer_timing.time_epochs(lambda: 0, 3)
    assert stop.value.code == 2 and "gave no image" in capsys.readouterr().err


def test_bench_tools_refuse_an_added_key_nothing_reads():
    """The tools compose without a Hydra app, whose overrides check_config reads: a typo the
    user added with + was taken without a word."""
    from fastload.bench.common import compose
    from fastload.errors import ConfigError

    with pytest.raises(ConfigError, match=r"\+trainer.lr_typo=0.5: trainer has no option"):
        compose(["+trainer.lr_typo=0.5"])
    assert compose(["+repeat=1"]).repeat == 1
