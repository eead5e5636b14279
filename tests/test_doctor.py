"""The doctor: the pre-flight check's failures produced on purpose (each with its fix), the
bottleneck doctor naming an injected slow stage, and loader=auto's choice and cache."""

from __future__ import annotations

import itertools
import json
import logging
import re
import subprocess
import sys
import time

import pytest
import torch
from conftest import (
    REPO,
    build_test_loader,
    compose_config,
    launch_overrides,
    make_image_folder,
    run_train,
    tiny_overrides,
)

from fastload import preflight as env
from fastload.doctor.__main__ import main as doctor_main
from fastload.errors import ConfigError

MB = 2**20


def facts(**changes) -> env.Facts:
    """A healthy machine, then the given changes (nothing read from this one)."""
    base = env.Facts(
        shm=(8 * 2**30, 8 * 2**30),
        nofile=(65536, 65536),
        usable_cores=16,
        cpu_count=16,
        cpu_flags=frozenset({"sse4_2", "avx", "avx2"}),
        arch="x86_64",
        ram_total=128 * 2**30,
        dataset_fs="ext4",
        decoders={m: "" for m in env.DECODER_MODULES},
    )
    return env.replace(base, **changes)


def checks(overrides=(), ranks=1, **changes) -> dict[str, env.Check]:
    cfg = compose_config(["trainer.device=cpu", *overrides])
    return {c.name: c for c in env.run_checks(cfg, facts(**changes), ranks)}


def test_a_healthy_machine_passes_every_check():
    results = checks(["loader.num_workers=8"])
    assert {c.status for c in results.values()} == {"ok"}, results
    assert len(results) == len(env.CHECKS)


def test_docker_default_shm_is_fatal_with_the_shm_size_ipc_host_and_emptydir_fixes():
    small = (64 * MB, 64 * MB)  # Docker's default
    over = ["loader.num_workers=8", "trainer.batch_size=256", "dataset.train_transform.size=224"]
    shm = checks(over, shm=small)["/dev/shm"]
    assert shm.status == "fatal"
    assert "Bus error" in shm.message and "8 workers" in shm.message
    for fix in ("--shm-size=", "--ipc=host", "emptyDir", "medium: Memory", "loader.num_workers"):
        assert fix in shm.fix, shm.fix
    # local ranks multiply the need: 4 ranks x 2 workers of small batches no longer fit 64 MB
    tiny = ["loader.num_workers=2", "trainer.batch_size=64", "dataset.train_transform.size=128"]
    assert checks(tiny, shm=small)["/dev/shm"].status != "fatal"
    assert checks(tiny, ranks=4, shm=small)["/dev/shm"].status == "fatal"
    # no workers, no shared memory needed
    assert checks(["loader.num_workers=0"], shm=small)["/dev/shm"].status == "ok"


def test_shm_room_is_judged_by_its_free_space_not_its_size():
    """A 1 GiB /dev/shm that other processes filled to 20 MiB free cannot take 80 MiB of
    batches: fatal, not "little headroom"."""
    over = ["loader.num_workers=2", "trainer.batch_size=64", "dataset.train_transform.size=224"]
    full = checks(over, shm=(1024 * MB, 20 * MB))["/dev/shm"]
    assert full.status == "fatal" and "20 MiB free" in full.message
    assert checks(over, shm=(1024 * MB, 1000 * MB))["/dev/shm"].status == "ok"


def test_a_fatal_check_stops_the_run_in_fit_with_the_fixes(tmp_path):
    from fastload.dist import DistContext

    cfg = compose_config(["trainer.device=cpu", "loader.num_workers=8", "trainer.batch_size=256"])
    small = facts(shm=(64 * MB, 64 * MB))
    with pytest.raises(ConfigError) as exc:
        env.preflight(cfg, DistContext(), small)
    text = exc.value.user_message
    assert "pre-flight" in text and "--shm-size=" in text and "--ipc=host" in text
    off = compose_config(["trainer.device=cpu", "loader.num_workers=8", "doctor.preflight=false"])
    assert env.preflight(off, DistContext(), small) == []


def test_train_py_stops_before_any_work_on_a_fatal_check(tiny_folder, tmp_path):
    # 2 workers x 10^7 prefetched batches cannot fit any /dev/shm: refused before the data
    run_dir = tmp_path / "run"
    extra = ["loader.num_workers=2", "loader.prefetch_factor=10000000"]
    out = run_train(tiny_overrides(tiny_folder, run_dir, *extra), timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "error: the pre-flight check found 1 problem" in out.stderr
    assert "--shm-size=" in out.stderr and "Traceback" not in out.stderr
    assert not (run_dir / "metrics.jsonl").exists()


def test_low_open_file_limit_warns_with_the_ulimit_fix():
    code = (
        "import resource, sys\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "from fastload.doctor.__main__ import main\n"
        "sys.exit(main(['env', 'trainer.device=cpu', 'loader.num_workers=2']))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]  # a warning, not fatal
    line = [ln for ln in out.stdout.splitlines() if "ulimit -n:" in ln][0]
    assert line.startswith("[WARN ]") and "soft limit 256" in line, out.stdout
    assert "fix: raise it before starting: `ulimit -n" in out.stdout
    assert "--ulimit nofile=" in out.stdout


def test_pillow_simd_without_avx2_warns_and_on_arm_is_fatal():
    no_avx2 = frozenset({"sse4_2", "avx"})
    cpu = checks(["backend=pillow-simd"], cpu_flags=no_avx2, pillow="pillow-simd")["CPU flags"]
    assert cpu.status == "warn" and "Illegal instruction" in cpu.message
    assert "install_pillow_simd.sh" in cpu.fix and "backend=turbo" in cpu.fix
    arm = checks(["backend=pillow-simd"], arch="aarch64", cpu_flags=None)["CPU flags"]
    assert arm.status == "fatal" and "backend=turbo" in arm.fix
    # AVX2 does not matter to other backends
    assert checks(["backend=pil"], cpu_flags=no_avx2)["CPU flags"].status == "ok"


def test_a_staged_copy_that_does_not_fit_in_dev_shm_says_where_else_to_stage(tiny_folder):
    """The shortfall is the staging, not the batches: fewer workers (none here) cannot help."""
    over = ["storage=tmpfs", f"dataset.root={tiny_folder}", "dataset.prepare=null",
            "storage.target_dir=/dev/shm/fastload-doctor-test", "loader.num_workers=0"]  # fmt: skip
    shm = checks(over, shm=(64 * 1024, 16 * 1024))["/dev/shm"]
    assert shm.status == "fatal" and "tmpfs staging" in shm.message
    assert "storage.target_dir=" in shm.fix and "storage=disk" in shm.fix
    assert "loader.num_workers" not in shm.fix and "--shm-size=1g" in shm.fix


def test_missing_decoder_network_fs_cores_gpu_and_pinning_each_give_their_fix(monkeypatch):
    no_simplejpeg = {**{m: "" for m in env.DECODER_MODULES}, "simplejpeg": env.MISSING}
    dec = checks(["backend=turbo"], decoders=no_simplejpeg)["decoders"]
    assert dec.status == "fatal" and "pip install simplejpeg" in dec.fix
    both = {"libjpeg": "", "nvimgcodec": ""}
    not_built = {"libjpeg": "not built: apt-get install gcc libjpeg62-turbo-dev", "nvimgcodec": ""}
    neither = {**not_built, "nvimgcodec": "nvImageCodec is not installed"}
    no_roi = checks(["backend=turbo"], roi_decode=neither)["decoders"]
    assert no_roi.status == "warn" and "whole images" in no_roi.message
    assert "nvImageCodec is not installed" in no_roi.message and "not built" in no_roi.message
    assert "apt-get install gcc" in no_roi.fix and "pip install nvidia-nvimgcodec" in no_roi.fix
    assert (
        checks(["backend=turbo", "backend.roi=off"], roi_decode=neither)["decoders"].status == "ok"
    )
    # which library decodes this run's JPEGs, with its version
    own = checks(["backend=turbo"], roi_decode=both)["decoders"]
    assert own.status == "ok" and "fastload's region decoder on pillow-" in own.message
    assert "libjpeg-turbo 3." in own.message and "simplejpeg 1." in own.message
    nv = checks(["backend=turbo", "backend.roi=nvimgcodec"], roi_decode=both)["decoders"]
    assert nv.status == "ok" and "crop regions decoded by nvImageCodec 0." in nv.message
    nv_auto = checks(["backend=turbo"], roi_decode=not_built)["decoders"]
    assert nv_auto.status == "warn" and "nvImageCodec" in nv_auto.message
    assert "apt-get install gcc" in nv_auto.fix
    whole = checks(["backend=turbo", "backend.roi=off"], roi_decode=both)["decoders"].message
    assert "decoded whole by simplejpeg" in whole and "nvImageCodec" not in whole
    assert "libjpeg" in checks(["backend=pil"])["decoders"].message
    # a real dataset's root that is not there (no prepare step makes it): said, with the fix
    gone = checks(["dataset=imagenet", "dataset.root=/nope"], dataset_fs="")["dataset file system"]
    assert gone.status == "warn" and "/nope does not exist" in gone.message
    assert "dataset.root=" in gone.fix
    made = checks(dataset_fs="")["dataset file system"]  # the built-in set: generated
    assert made.status == "ok" and "generated on first use" in made.message
    nfs = checks(dataset_fs="nfs4")["dataset file system"]
    assert nfs.status == "warn" and "storage=tmpfs" in nfs.fix and "storage=shards" in nfs.fix
    # the storage judges it: staged to RAM or packed, the root is read once, not per epoch
    assert checks(["storage=tmpfs"], dataset_fs="nfs4")["dataset file system"].status == "ok"
    cores = checks(["loader.num_workers=8"], ranks=4, usable_cores=8)["cores"]
    assert cores.status == "warn" and "loader.num_workers=auto (= 2 per rank" in cores.fix
    gpu = checks(["trainer.device=cuda"])["GPU"]
    assert gpu.status == "fatal" and "--gpus all" in gpu.fix
    nvml = checks(["trainer.device=auto"], gpus=["NVIDIA H100"], nvml=None)["GPU"]
    assert nvml.status == "warn" and "nvidia-ml-py" in nvml.fix
    ranks = checks(["trainer.device=auto"], ranks=2, gpus=["NVIDIA H100"], nvml="driver 550")
    assert ranks["GPU"].status == "fatal" and "--nproc_per_node=1" in ranks["GPU"].fix
    # too many ranks is said without NVML too (not only its warning)
    ranks = checks(["trainer.device=auto"], ranks=2, gpus=["NVIDIA H100"], nvml=None)["GPU"]
    assert ranks.status == "fatal" and "no NVML; 2 local ranks need one GPU each" in ranks.message
    # srun --gpus-per-task=1: each of the node's tasks sees a GPU of its own
    for key, value in (("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2")):
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    own = checks(["trainer.device=auto"], ranks=2, gpus=["NVIDIA H100"], nvml="driver 550")["GPU"]
    assert own.status == "ok", own
    monkeypatch.delenv("SLURM_PROCID")
    # trainer.device=cpu on a GPU box (gloo DDP, the CPU tests): the GPUs do not count
    cpu = checks(["trainer.device=cpu"], ranks=2, gpus=["NVIDIA H100"], nvml=None)["GPU"]
    assert cpu.status == "ok" and "unused" in cpu.message
    pinned = checks(
        ["trainer.device=auto", "loader.pin_memory=true", "loader.pin_memory_max_mb=10",
         "trainer.batch_size=256", "dataset.train_transform.size=224"],
        gpus=["NVIDIA H100"], nvml="driver 550",
    )["pinned memory"]  # fmt: skip
    assert pinned.status == "fatal" and "loader.pin_memory_max_mb" in pinned.fix


def test_an_installed_decoder_whose_import_fails_is_not_importable(tmp_path, monkeypatch):
    """An opencv-python without libGL (a slim container) and a broken simplejpeg are there
    for find_spec but fail at import: the check imports them and names the error."""
    fake = tmp_path / "site"
    errors = {"cv2": "libGL.so.1: cannot open shared object file: No such file or directory",
              "simplejpeg": "undefined symbol: tjDecompress2"}  # fmt: skip
    for name, error in errors.items():
        (fake / name).mkdir(parents=True)
        (fake / name / "__init__.py").write_text(f"raise ImportError({error!r})\n")
        monkeypatch.delitem(sys.modules, name, raising=False)  # the real ones come back after
    monkeypatch.syspath_prepend(str(fake))
    if hasattr(env, "decoder_imports"):
        env.decoder_imports.cache_clear()
    try:
        decoders = env.gather(compose_config(["trainer.device=cpu"])).decoders
    finally:
        monkeypatch.undo()
        if hasattr(env, "decoder_imports"):
            env.decoder_imports.cache_clear()  # the real modules for the other tests
    assert decoders["cv2"] == f"ImportError: {errors['cv2']}", decoders
    assert decoders["simplejpeg"] == f"ImportError: {errors['simplejpeg']}"
    assert decoders["PIL"] == ""
    dec = checks(["backend=turbo"], decoders=decoders)["decoders"]
    assert dec.status == "fatal" and "needs simplejpeg, which does not import" in dec.message
    assert "undefined symbol: tjDecompress2" in dec.message and "reinstall" in dec.fix
    jpeg_ok = {**decoders, "simplejpeg": ""}
    dec = checks(["backend=turbo"], decoders=jpeg_ok)["decoders"]  # resize: auto
    assert dec.status == "warn" and "resizes with PIL" in dec.message, dec
    assert "libGL.so.1" in dec.message and "opencv-python-headless" in dec.fix
    assert "cv2" not in dec.message.split("importable: ")[1].split(";")[0]
    # asked for by name, it cannot start; resize=pil needs no OpenCV
    assert checks(["backend=turbo", "backend.resize=cv2"], decoders=jpeg_ok)["decoders"].status \
        == "fatal"  # fmt: skip
    assert checks(["backend=turbo", "backend.resize=pil"], decoders=jpeg_ok)["decoders"].status \
        == "ok"  # fmt: skip


def test_the_preflight_imports_only_the_decoders_its_backend_uses():
    """backend=pil's pre-flight imports no OpenCV and no torchvision (seconds of torch._dynamo):
    it only looks them up; backend=turbo's imports OpenCV (its resize), not torchvision.
    A fresh process: this one has imported them all."""
    script = (
        "import sys\n"
        "from fastload.doctor.__main__ import main\n"
        "main(['env', 'trainer.device=cpu', *sys.argv[1:]])\n"
        "print('imported:', *(m for m in ('cv2', 'torchvision', 'simplejpeg') "
        "if m in sys.modules))\n"
    )
    for backend, imported in (("pil", []), ("turbo", ["cv2", "simplejpeg"])):
        out = subprocess.run([sys.executable, "-c", script, f"backend={backend}"], cwd=REPO,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines()[-1].split()[1:] == imported, out.stdout
        decoders = next(line for line in out.stdout.splitlines() if "] decoders:" in line)
        assert f"installed, not imported (backend={backend} does not use them): " in decoders
        assert "torchvision" in decoders.split("not imported")[1]


def test_doctor_env_prints_one_line_per_check_and_is_quick(capsys):
    import time

    assert doctor_main(["env", "trainer.device=cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n[") + out.startswith("[") == len(env.CHECKS), out
    assert f"{len(env.CHECKS)} checks: 0 fatal" in out
    cfg = compose_config(["trainer.device=cpu"])
    env.run_checks(cfg)  # warm (torch.cuda, NVML lookups)
    t0 = time.perf_counter()
    env.run_checks(cfg)
    assert time.perf_counter() - t0 < 0.5


def test_doctor_refuses_bad_input_in_one_line(capsys):
    assert doctor_main(["nope"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: unknown command 'nope'; the commands: env, pipeline (python -m fastload.doctor "
        "--help says what each does)\n"
    )
    assert doctor_main(["env", "loader=nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    with pytest.raises(SystemExit):
        doctor_main(["pipeline", "--images", "0"])
    assert "--images 0: use a whole number >= 1" in capsys.readouterr().err


def test_doctor_refuses_the_options_train_py_refuses(tiny_folder, capsys):
    # doctor env judged num_workers=abc as 0 workers and passed; train.py refuses it
    assert doctor_main(["env", "trainer.device=cpu", "loader.num_workers=abc"]) == 2
    err = capsys.readouterr().err
    assert err == "error: loader.num_workers='abc': use a whole number >= 0 or 'auto'.\n"
    # doctor pipeline ended in BatchRing's ValueError
    argv = ["pipeline", "--step-ms", "1", *doctor_overrides(tiny_folder), "trainer.batch_size=-1"]
    assert doctor_main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err == "error: trainer.batch_size=-1: use a whole number >= 1 (images per rank per step).\n"
    )
    # --local-ranks 0 was taken for "not given" (the default) while -2 was refused
    for command in ("env", "pipeline"):
        with pytest.raises(SystemExit) as exc:
            doctor_main([command, "--local-ranks", "0"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.endswith(f"{command}: error: --local-ranks 0: use a whole number >= 1\n")
    # a step of nan ms passed the `< 0` check
    with pytest.raises(SystemExit) as exc:
        doctor_main(["pipeline", "--step-ms", "nan"])
    assert exc.value.code == 2 and "--step-ms nan: use milliseconds >= 0" in capsys.readouterr().err


def test_doctor_help_lists_the_commands_and_exits_0(capsys):
    for flag in ("--help", "-h"):
        assert doctor_main([flag]) == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: python -m fastload.doctor {env,pipeline}")
        assert "    env       the pre-flight check" in out and "    pipeline  which stage" in out


# -- the bottleneck doctor --------------------------------------------------------------------


def doctor_overrides(root, *extra: str) -> list[str]:
    """conftest's tiny run (2 CPU cores, 32 px crops, batch 4), with one worker."""
    skip = ("hydra.", "output_root", "loader.num_workers")
    return [*launch_overrides(root, REPO, extra, skip), "loader.num_workers=1", *extra]


def diagnose(root, *extra: str, step_ms: float = 5.0):
    from fastload.doctor import pipeline

    argv = ["--images", "8", "--batches", "3", "--model-steps", "2", "--step-ms", str(step_ms)]
    _, report = pipeline.run(pipeline.parse([*argv, *doctor_overrides(root, *extra)]))
    return report


def test_the_doctor_names_the_injected_slow_stage(tiny_folder):
    # a slow model step (200 ms per batch of 4): nothing to fix in the data path
    slow_model = diagnose(tiny_folder, step_ms=200)
    assert slow_model.bound["stage"] == "model", slow_model.bound
    assert "nothing to fix in the data path" in slow_model.bound["message"]
    # 40 ms of extra CPU work per image (a heavy augmentation) and a fast step
    heavy = diagnose(tiny_folder, "dataset.task.item_cost_ms=40")
    assert heavy.bound["stage"] == "augment", heavy.bound
    assert heavy.bound["img_s"] < 0.5 * heavy.bound["model_img_s"]
    changes = [a[0] for a in heavy.advice]
    assert "dataset.task.item_cost_ms=0" in changes, heavy.advice
    # an emulated slow disk: 8 ms + size / 120 MB/s per file
    disk = diagnose(tiny_folder, "storage=slow_disk")
    assert disk.bound["stage"] == "storage", disk.bound
    costs = disk.measured["costs_ms"]
    assert costs["storage read"] > 5 * costs["decode"]
    # among the largest expected gains (a many-core box also ties loader.num_workers=<cores>)
    # (within 2 %: on a loaded 2-core machine the worker-count estimate can edge ahead)
    best = max(gain for _, gain, _ in disk.advice)
    top = {change for change, gain, _ in disk.advice if gain >= 0.98 * best}
    assert top & {"storage=tmpfs", "storage=shards"}, disk.advice
    # the rows the table and the chart show
    stages = [r["stage"] for r in disk.stages]
    for name in ("storage read", "decode", "augment", "collate", "transfer + device prep",
                 "model step", "epoch boundary (amortised)"):  # fmt: skip
        assert name in stages


def test_the_doctor_measures_one_ranks_share_of_the_node(tiny_folder, monkeypatch):
    """On an 8-GPU node each rank has an eighth of the cores: num_workers=auto and the
    cores the advice counts are one rank's, as training resolves them."""
    from fastload.doctor import pipeline
    from fastload.host import usable_cores

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    base = ["--images", "4", *launch_overrides(tiny_folder, REPO, (), ("hydra.", "output_root",
                                                                     "loader.num_workers"))]  # fmt: skip
    whole = pipeline.setup(pipeline.parse(base))
    assert (whole.workers, whole.cores) == (usable_cores(), usable_cores())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # under torchrun, or --local-ranks 2
    for argv in (base, ["--local-ranks", "2", *base]):
        half = pipeline.setup(pipeline.parse(argv))
        assert (half.workers, half.cores) == (max(1, usable_cores() // 2),) * 2


def test_the_doctor_times_gpu_decode_and_offers_it_when_decode_bounds(tiny_folder):
    """backend=nvjpeg's device half timed on this dataset (here on the CPU, where nvImageCodec
    decodes the same way; the doctor does it on a GPU run), and offered when decode bounds the
    workers, its time charged to the model's step."""
    from fastload.doctor import pipeline

    argv = ["--images", "4", "--step-ms", "5", *doctor_overrides(tiny_folder)]
    s = pipeline.setup(pipeline.parse(argv))
    ms = pipeline.device_decode_ms(s, torch.device("cpu"), n=8, reps=1)
    assert ms is not None and 0 < ms < 1000
    costs = {"storage read": 0.1, "decode": 5.0, "augment": 1.0, "collate": 0.1,
             "extra per-sample work (ms)": 0.0}  # fmt: skip
    bound = {"stage": "decode", "img_s": 150.0, "model_img_s": 1000.0}
    alt = {"backends": {}, "mean_side": 200.0, "gpu_decode_ms": 0.5}
    advice = pipeline.advice(s, bound, costs, alt, {"host_img_s": 150.0}, 1000.0)
    (line,) = [a for a in advice if a[0] == "backend=nvjpeg loader=prefetch"]
    assert line[1] == pytest.approx(1000 / 1.5)  # 1 ms of model + 0.5 ms of decode per image
    assert "0.500 ms per image" in line[2] and "taken from the model's" in line[2]
    alt.pop("gpu_decode_ms")  # no GPU: not offered
    assert not [a for a in pipeline.advice(s, bound, costs, alt, {"host_img_s": 150.0}, 1000.0)
                if "nvjpeg" in a[0]]  # fmt: skip


def test_the_doctor_offers_no_change_its_own_figures_say_is_slower():
    """A backend whose decode+crop measured slower than the current one was offered as the
    best change, with a predicted rate below the bound it was meant to lift."""
    from types import SimpleNamespace

    from fastload.doctor import pipeline

    s = SimpleNamespace(cfg=compose_config(["trainer.device=cpu"]), workers=2, cores=2,
                        backend=SimpleNamespace(name="turbo"))  # fmt: skip
    costs = {"storage read": 0.1, "decode": 5.0, "augment": 1.0, "collate": 0.1,
             "extra per-sample work (ms)": 0.0}  # fmt: skip
    bound = {"stage": "decode", "img_s": 400.0, "model_img_s": 1000.0}
    loader = {"host_img_s": 400.0}
    slower = {"backends": {"pil": 9.0}, "mean_side": 200.0}
    (only,) = pipeline.advice(s, bound, costs, slower, loader, 1000.0)
    assert only[0] == "(keep backend=turbo)" and only[1] == 400.0, only
    assert "the fastest decode+crop of those measured" in only[2] and "pil 9.00 ms" in only[2]
    faster = {"backends": {"pil": 3.0}, "mean_side": 200.0}
    (best,) = pipeline.advice(s, bound, costs, faster, loader, 1000.0)
    assert best[0] == "backend=pil" and best[1] > 400.0, best
    # any stage: a change predicted at or below the bound is not offered
    for advice in (pipeline.advice(s, {**bound, "stage": st}, costs, slower, loader, 1000.0)
                   for st in ("decode", "augment", "storage", "collate")):  # fmt: skip
        assert all(rate > 400.0 for change, rate, _ in advice if not change.startswith("(")), advice


def test_doctor_pipeline_writes_the_table_json_and_png(tiny_folder, tmp_path, capsys):
    out = tmp_path / "doctor"
    argv = ["pipeline", "--images", "6", "--batches", "2", "--model-steps", "1", "--step-ms",
            "300", "--out", str(out), *doctor_overrides(tiny_folder)]  # fmt: skip
    assert doctor_main(argv) == 0
    text = capsys.readouterr().out
    assert "bound: the model step bounds you at" in text
    assert "best change: (nothing in the data path)" in text
    payload = json.loads((out / "pipeline.json").read_text())
    assert payload["bound"]["stage"] == "model"
    assert {r["stage"] for r in payload["stages"]} >= {"decode", "model step"}
    png = (out / "pipeline.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


# -- loader=auto ------------------------------------------------------------------------------


def tune_with(root, caplog, *extra: str, model=None):
    """fastload.autotune.tune as fit calls it, on `root`; (the tuned plan's loader options,
    trial log lines, cache-hit log lines)."""
    from fastload.autotune import tune
    from fastload.dist import DistContext
    from fastload.pipeline import build_plan

    over = [o for o in doctor_overrides(root) if not o.startswith("loader.num_workers")]
    cfg = compose_config([*over, "loader=auto", "loader.auto.backends=[]", *extra])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fastload"):
        tuned = tune(build_plan(cfg), cfg, DistContext(), model, channels_last=False, amp=None)
    lines = [r.getMessage() for r in caplog.records]
    return (
        tuned.loader,
        [m for m in lines if m.startswith("loader=auto trial")],
        [m for m in lines if "cache hit" in m],
    )


@pytest.fixture
def tune_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "cache"))
    return make_image_folder(tmp_path / "d", per_split=(16, 2))  # 48 images: 12 batches of 4


def test_a_resumed_run_keeps_the_backend_its_checkpoint_was_trained_with(
    tiny_folder, caplog, monkeypatch
):
    """loader=auto's cache is per machine: resumed on another node, whose probe preferred
    another backend, a run went on with other decoders (their pixels differ): 32 of 38
    weight tensors off the uninterrupted run's, without a word."""
    from fastload import autotune
    from fastload.dist import DistContext
    from fastload.pipeline import build_plan

    cfg = compose_config([*doctor_overrides(tiny_folder), "loader=auto", "backend=turbo"])
    here = {"num_workers": 2, "prefetch_factor": 4, "pin_memory": False, "backend": "turbo"}
    for choice in (here, None):  # None: no trial finished (the configured options)
        monkeypatch.setattr(autotune, "choose", lambda *a, c=choice: c)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fastload"):
            plan = autotune.tune(build_plan(cfg), cfg, DistContext(), None, channels_last=False,
                                 amp=None, resumed_backend="pil")  # fmt: skip
        assert plan.backend.name == "pil", choice  # the probe of the first node chose it
        assert "trained with backend=pil" in caplog.text and "keeping it" in caplog.text
        assert plan.loader["num_workers"] == (2 if choice else 1)
    monkeypatch.setattr(autotune, "choose", lambda *a: dict(here))
    plan = autotune.tune(build_plan(cfg), cfg, DistContext(), None, channels_last=False,
                         amp=None)  # fmt: skip
    assert plan.backend.name == "turbo"  # a fresh run takes the probe's choice


def test_loader_auto_picks_workers_over_none_when_items_cost_cpu(tune_folder, caplog):
    # 20 ms of CPU per image, an 80 ms step (a sleep): in the main thread every batch costs
    # 80 + 80 ms; with workers the loading overlaps the step (2 cores here: 2 workers are the
    # known best). Under xdist a neighbouring test may take a core: a step as long as a
    # batch's loading keeps the workers ahead even on the core that is left (a 30 ms step
    # once measured 32 against 34 img/s on a loaded machine).
    extra = (
        "dataset.task.item_cost_ms=20",
        "loader.auto.step_ms=80",
        "loader.auto.workers=[0,1,2]",
    )
    tuned, trials, hits = tune_with(tune_folder, caplog, *extra)
    assert not hits and len(trials) >= 3, trials
    assert tuned["num_workers"] >= 1, trials
    rate = {int(m.split("num_workers=")[1].split()[0]): float(m.split(": ")[-1].split()[0])
            for m in trials if "prefetch_factor=2 " in m}  # fmt: skip
    assert rate[0] < rate[tuned["num_workers"]], trials
    assert any(f"chose num_workers={tuned['num_workers']}" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    # the second run starts directly from the cache: logged, no trial
    again, trials2, hits2 = tune_with(tune_folder, caplog, *extra)
    assert hits2 and not trials2, caplog.text
    assert again["num_workers"] == tuned["num_workers"]
    assert again["prefetch_factor"] == tuned["prefetch_factor"]
    # a changed config (batch size) is another key: probed again
    _, trials3, hits3 = tune_with(tune_folder, caplog, *extra, "trainer.batch_size=2")
    assert trials3 and not hits3
    assert len(list((tune_folder.parent / "cache" / "autotune").glob("*.json"))) == 2


@pytest.mark.parametrize(
    "override, message",
    [
        ("loader.auto.budget_s=0", "loader.auto.budget_s=0: use seconds > 0"),
        ("loader.auto.workers=[-1]", "loader.auto.workers=[-1]: use auto or a list"),
        ("loader.auto.backends=turbo", "loader.auto.backends='turbo': use available, []"),
        ("loader.auto.step_ms=-5", "loader.auto.step_ms=-5: use null (measure) or ms >= 0"),
        ("loader.auto.gpu_decode=yes", "loader.auto.gpu_decode='yes': use auto"),
        ("loader.auto.gpu_decode=1", "loader.auto.gpu_decode=1: use auto"),
    ],
)
def test_loader_auto_refuses_bad_settings_naming_the_option(tune_folder, caplog, override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        tune_with(tune_folder, caplog, override)


def test_loader_auto_worker_candidates_follow_the_affinity_mask_and_local_ranks():
    from fastload.autotune import worker_candidates

    auto = {"workers": "auto"}
    assert worker_candidates(auto, 1, cores=16) == [16, 8, 4, 2, 1, 0]
    assert worker_candidates(auto, 4, cores=16) == [4, 2, 1, 0]
    assert worker_candidates(auto, 8, cores=6) == [1, 0]
    assert worker_candidates({"workers": [4, 12, 8]}, 1) == [12, 8, 4]


def test_loader_auto_times_the_models_step_on_a_copy(tune_folder, caplog):
    import torch

    from fastload.tasks.base import build_task

    cfg = compose_config(["dataset.num_classes=3"])
    model = build_task(cfg).build_model(cfg)
    before = [p.detach().clone() for p in model.parameters()]
    extra = ("loader.auto.workers=[1]", "loader.auto.batches=2", "loader.auto.budget_s=1")
    tuned, trials, _ = tune_with(tune_folder, caplog, *extra, model=model)
    assert "the model's step takes" in caplog.text, caplog.text
    if not trials:  # the budget ran out first: the base settings, said so
        assert "no trial finished within 1 s" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_loader_auto_budget_is_the_trials_not_the_step_measurement(
    tune_folder, caplog, monkeypatch
):
    """The budget ran out while the model's step was measured (a ResNet on a CPU: seconds),
    and "probing for up to 8 s" ended 26 s later with no trial: the measurement is outside
    the budget now, and the log says what the time went to."""
    import time

    from fastload import autotune

    def slow_measurement(probe, batch):
        time.sleep(1.5)
        return 0.001

    monkeypatch.setattr(autotune, "measure_step", slow_measurement)
    extra = ("loader.auto.workers=[0]", "loader.auto.batches=2", "loader.auto.budget_s=1")
    tuned, trials, _ = tune_with(tune_folder, caplog, *extra)
    assert len(trials) == 1, caplog.text
    assert "trials for up to 1 s (loader.auto.budget_s), plus the one-off" in caplog.text
    assert "s of it measuring the model's step" in caplog.text


def fake_search_probe(
    rates: dict, *, mode="auto", device="cuda", normalize="device", backends=("turbo",)
):
    """A stand-in for autotune.Probe as search() uses it: each trial gets its
    (img/s, data-wait share) from `rates` by backend (worker counts ignored)."""
    from types import SimpleNamespace

    from fastload.autotune import Trial

    auto = {"workers": [4], "prefetch_factors": [2], "pin_memory": [True],
            "backends": list(backends), "gpu_decode": mode}  # fmt: skip
    p = SimpleNamespace(
        cfg=SimpleNamespace(loader=SimpleNamespace(pin_memory="auto")),
        auto=auto,
        ctx=SimpleNamespace(device=torch.device(device), local_world_size=1),
        plan=SimpleNamespace(normalize_on=normalize),
        trials=[],
        current_backend="turbo",
        remaining=lambda: 10.0,
    )

    def run(t: Trial):
        t.img_s, t.data_wait = rates[t.backend]
        p.trials.append(t)
        return t

    p.run = run
    return p


def test_loader_auto_tries_gpu_decode_when_the_workers_cannot_keep_up():
    from fastload.autotune import search

    # the workers keep the step waiting 40 % of the time: the GPU decode is tried and wins
    p = fake_search_probe({"turbo": (600.0, 0.40), "nvjpeg": (900.0, 0.01)})
    chosen = search(p)
    assert [t.backend for t in p.trials] == ["turbo", "nvjpeg"]
    assert chosen.backend == "nvjpeg" and chosen.num_workers == 4
    # it is tried, and loses, when its charged GPU time makes it slower
    p = fake_search_probe({"turbo": (600.0, 0.40), "nvjpeg": (500.0, 0.0)})
    assert search(p).backend == "turbo" and len(p.trials) == 2
    # the workers keep up (5 % wait): not tried; nor without CUDA, with gpu_decode=false, or
    # with normalisation in the workers (the device decoder needs it on the device)
    for kwargs, wait in (({}, 0.05), ({"device": "cpu"}, 0.4), ({"mode": False}, 0.4),
                         ({"normalize": "cpu"}, 0.4)):  # fmt: skip
        p = fake_search_probe({"turbo": (600.0, wait), "nvjpeg": (900.0, 0.0)}, **kwargs)
        assert search(p).backend == "turbo" and len(p.trials) == 1, kwargs
    # gpu_decode=true tries it even when the workers keep up
    p = fake_search_probe({"turbo": (600.0, 0.0), "nvjpeg": (900.0, 0.0)}, mode=True)
    assert search(p).backend == "nvjpeg"
    # loader.auto.backends=[] keeps backend= as configured: auto does not swap in the GPU
    p = fake_search_probe({"turbo": (600.0, 0.40), "nvjpeg": (900.0, 0.0)}, backends=[])
    assert search(p).backend == "turbo" and len(p.trials) == 1
    p = fake_search_probe({"turbo": (600.0, 0.40), "nvjpeg": (900.0, 0.0)}, backends=[], mode=True)
    assert search(p).backend == "nvjpeg"


def test_loader_auto_charges_a_device_decoders_gpu_time_to_the_step(monkeypatch, tiny_folder):
    """The trial of a backend that decodes on the GPU: its measured device time per batch is
    added to the stand-in step (a sleep leaves the GPU idle, which would hide it)."""
    from types import SimpleNamespace

    from fastload import autotune, measure
    from fastload.autotune import Probe, Trial
    from fastload.decode.nvjpeg import NvjpegBackend
    from fastload.pipeline import build_plan

    slept = []

    class Step(measure.SleepStep):
        def __init__(self, ms, device="cpu"):
            slept.append(ms)
            super().__init__(0.0, device)

    monkeypatch.setattr(measure, "SleepStep", Step)
    probe = SimpleNamespace(step_s=0.020, auto={"batches": 2}, remaining=lambda: 5.0)
    batches = [{"image": torch.zeros(4, 3, 8, 8), "target": torch.zeros(4)} for _ in range(4)]
    loader = type("L", (), {"set_epoch": lambda self, e: None,
                            "__iter__": lambda self: iter(batches)})()  # fmt: skip
    autotune.timed(probe, loader, Trial(1, 2, False, "nvjpeg", gpu_ms=35.0))
    autotune.timed(probe, loader, Trial(1, 2, False, "turbo"))
    assert slept == [pytest.approx(55.0), pytest.approx(20.0)]
    # the time charged is measured on the dataset's own JPEGs (here with nvImageCodec's CPU
    # decoder, the same calls as on a GPU), per batch; a host backend is charged nothing
    cfg = compose_config(doctor_overrides(tiny_folder))
    plan = build_plan(cfg)
    p = Probe(cfg, plan, SimpleNamespace(device=torch.device("cpu")), None, False, None,
              {"batches": 2}, deadline=0.0)  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ms = p.device_time("nvjpeg", NvjpegBackend())
    assert ms is not None and 0 < ms < 4000
    assert p.device_time("turbo", plan.backend) == 0.0
    # chosen, it brings the prep thread with it (loader=prefetch), whatever loader=auto's is
    tuned = autotune.apply(plan, cfg, {"num_workers": 1, "prefetch_factor": 2,
                                       "pin_memory": False, "backend": "nvjpeg"})  # fmt: skip
    assert tuned.backend.name == "nvjpeg"
    assert tuned.loader["_target_"] == autotune.PREP_THREAD_LOADER
    assert autotune.apply(plan, cfg, None).loader["_target_"] == plan.loader["_target_"]
    # configured backend=nvjpeg and kept: its trial ran in the prep thread, so does the run
    configured = plan.replace(backend=NvjpegBackend())
    kept = autotune.apply(configured, cfg, {"num_workers": 1, "prefetch_factor": 2,
                                            "pin_memory": False, "backend": "nvjpeg"})  # fmt: skip
    assert kept.backend is configured.backend
    assert kept.loader["_target_"] == autotune.PREP_THREAD_LOADER


class BuildTimes(torch.utils.data.Dataset):
    """Each sample's target is when it was built (CLOCK_MONOTONIC: one clock for all
    processes)."""

    def __len__(self):
        return 64

    def __getitem__(self, key):
        return torch.zeros(3, 4, 4, dtype=torch.uint8), time.monotonic()


def test_loader_auto_times_no_batch_built_while_it_measured_the_step(monkeypatch):
    """The first trial measures the model's step on its warm-up batch; its workers went on
    building batches meanwhile, so its timed batches were partly ready (its rate ~40 % above
    the same setting's as a later trial), and it was compared with the others as if not."""
    from types import SimpleNamespace

    from fastload import autotune, measure
    from fastload.autotune import Trial

    def collate(items):
        return {"image": torch.stack([a for a, _ in items]),
                "target": torch.tensor([b for _, b in items], dtype=torch.float64),
                "skipped": 0}  # fmt: skip

    measured = []

    def measure_step(probe, batch):
        time.sleep(0.5)  # a model's warm-up and 3 steps
        measured.append(time.monotonic())
        return 0.001

    built = []

    def feed(it, step, **kw):
        for batch in itertools.islice(it, 3):
            built.extend(batch["target"].tolist())
        return measure.Feed(images=12, batches=3, wall_s=1.0)

    monkeypatch.setattr(autotune, "measure_step", measure_step)
    monkeypatch.setattr(measure, "feed", feed)
    loader = build_test_loader("loader=baseline", "loader.num_workers=1", "trainer.epochs=1",
                               dataset=BuildTimes(), collate_fn=collate)  # fmt: skip
    probe = SimpleNamespace(step_s=None, auto={"batches": 3}, remaining=lambda: 30.0,
                            deadline=0.0, measure_s=0.0)  # fmt: skip
    try:
        autotune.timed(probe, loader, Trial(1, 2, False, "turbo"))
    finally:
        loader.close()
    assert len(measured) == 1 and len(built) == 12
    assert min(built) > measured[0]


@pytest.mark.cuda
def test_loader_auto_on_a_gpu_runs_a_gpu_decode_trial_with_its_time_charged(tune_folder, caplog):
    from fastload.autotune import tune
    from fastload.dist import DistContext
    from fastload.pipeline import build_plan

    over = [o for o in doctor_overrides(tune_folder) if not o.startswith("loader.num_workers")]
    cfg = compose_config([*over, "loader=auto", "loader.auto.backends=[]",
                          "loader.auto.workers=[1]", "loader.auto.step_ms=5",
                          "loader.auto.gpu_decode=true", "loader.auto.budget_s=120"])  # fmt: skip
    ctx = DistContext(device=torch.device("cuda", 0))
    with caplog.at_level(logging.INFO, logger="fastload"):
        tuned = tune(build_plan(cfg), cfg, ctx, None, channels_last=False, amp=None)
    trials = [r.getMessage() for r in caplog.records if "loader=auto trial" in r.getMessage()]
    (gpu,) = [m for m in trials if "backend=nvjpeg" in m]
    assert "ms of GPU decode per batch charged to the step" in gpu, trials
    if tuned.backend.name == "nvjpeg":  # chosen: with the prep thread
        assert tuned.loader["_target_"].endswith("CudaPrefetchLoader")


def test_train_py_with_loader_auto_probes_then_uses_the_cache(tiny_folder, tmp_path):
    env = {"FASTLOAD_CACHE": str(tmp_path / "cache")}
    extra = ("loader=auto", "loader.auto.step_ms=20", "loader.auto.backends=[]",
             "loader.auto.workers=[0,1]", "trainer.epochs=1")  # fmt: skip
    first = run_train(tiny_overrides(tiny_folder, tmp_path / "a" / "run", *extra), env=env)
    text = first.stdout + first.stderr
    assert first.returncode == 0, text[-3000:]
    assert "loader=auto trial 1:" in text and "loader=auto: chose num_workers=" in text, text
    second = run_train(tiny_overrides(tiny_folder, tmp_path / "b" / "run", *extra), env=env)
    text = second.stdout + second.stderr
    assert second.returncode == 0, text[-3000:]
    assert "loader=auto: cache hit" in text and "loader=auto trial" not in text, text
