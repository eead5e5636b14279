"""A run whose numbers would mean nothing ends with an error, not a normal summary: a
non-finite loss, too many undecodable samples skipped, options that cannot train."""

from __future__ import annotations

import json
import math
import os
import signal
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    compose_config,
    make_image_folder,
    on_gloo_ranks,
    run_train,
    tiny_overrides,
)
from test_engine import CountingStep
from test_train import assert_clean_failure, read_jsonl

from fastload.errors import ConfigError, FastloadError
from fastload.optim import check_options
from fastload.train_checks import LossWatch, SkipBudget, TooManySkipped


def sums(loss: float, n: int = 4) -> torch.Tensor:
    return torch.tensor([loss * n, 1.0, n], dtype=torch.float64)


def test_loss_watch_names_the_first_non_finite_step():
    watch = LossWatch(torch.device("cpu"))
    watch.start(first_step=5)  # a resumed epoch counts from its first step
    for loss in (2.3, 1.9):
        watch.add(sums(loss))
    assert watch.first_bad() is None
    watch.add(sums(math.inf))
    watch.add(sums(math.nan))
    step, loss = watch.first_bad()
    assert step == 7 and loss == math.inf  # the first one, not the latest
    watch.start(first_step=0)
    assert watch.first_bad() is None
    watch.add(torch.tensor([0.0, 0.0, 0.0], dtype=torch.float64))  # an empty batch is finite
    assert watch.first_bad() is None


def test_a_diverging_run_stops_at_the_first_non_finite_loss(tmp_path):
    root = make_image_folder(tmp_path / "d")
    run_dir = tmp_path / "run"
    out = run_train(tiny_overrides(root, run_dir, "optim.base_lr=1e12", "trainer.epochs=3",
                                   "trainer.batch_size=2"))  # fmt: skip
    assert_clean_failure(
        out, "loss became non-finite at epoch 0 step", "optim.base_lr=1000000000000.0"
    )
    assert "fp16" not in out.stderr  # no scaler on the CPU: not a cause to suggest
    assert out.returncode == 2
    assert "best top-1" not in out.stdout  # no summary table of a run that learnt nothing
    assert not (run_dir / "summary.json").exists()
    assert not (run_dir / "metrics.jsonl").exists() or not read_jsonl(run_dir / "metrics.jsonl")
    assert not (run_dir / "checkpoints" / "last.pt").exists()  # no nan weights kept


def test_a_checkpoint_inside_the_epoch_never_keeps_non_finite_weights(tmp_path):
    """The stop check that notices a non-finite loss may come steps after it (under DDP
    every few steps); a checkpoint due in between is not written, so last.pt stays the last
    good one and resume=auto does not pick broken weights."""
    root = make_image_folder(tmp_path / "d")
    run_dir = tmp_path / "run"
    out = run_train(tiny_overrides(root, run_dir, "optim.base_lr=1e12", "trainer.batch_size=2",
                                   "trainer.checkpoint_every_steps=1"))  # fmt: skip
    assert_clean_failure(out, "loss became non-finite at epoch 0 step")
    step = int(out.stderr.split("loss became non-finite at epoch 0 step ")[1].split()[0])
    last = run_dir / "checkpoints" / "last.pt"
    if step > 1:  # the steps before it had finite losses: the newest of them was kept
        state = torch.load(last, weights_only=True)
        assert state["step_in_epoch"] <= step
        assert all(
            torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point()
        )
    else:
        assert not last.exists()


def test_checkpoints_inside_the_epoch_are_timed_apart_from_it(tmp_path):
    root = make_image_folder(tmp_path / "d")
    run_dir = tmp_path / "run"
    out = run_train(tiny_overrides(root, run_dir, "trainer.epochs=1",
                                   "trainer.checkpoint_every_steps=1"))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert row["checkpoint_s"] > 0
    assert row["compute_s"] + row["data_wait_s"] == pytest.approx(row["epoch_time_s"])


def test_the_fp16_scaler_skipped_steps_are_counted(tmp_path):
    """GradScaler skips the optimizer step of a batch whose gradients overflow; the step
    counts it on the device (no host sync) and hands the count over once."""
    from fastload.tasks.classification import ClassificationStep

    cfg = compose_config(tiny_overrides(tmp_path, tmp_path / "run"))
    model = torch.nn.Linear(8, 3)
    before = model.weight.detach().clone()
    # A scale just under float32's maximum: the scaled gradients overflow, so the step skips.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = SimpleNamespace(
        model=model,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
        scaler=torch.amp.GradScaler("cpu", init_scale=3e38),
        ema=None,  # trainer.ema off
    )
    ctx = SimpleNamespace(device=torch.device("cpu"), distributed=False, rank=0)
    step = ClassificationStep(state, cfg, ctx, amp=None)
    batch = {"image": torch.randn(4, 8) * 100, "target": torch.tensor([0, 1, 2, 0])}
    step.train(batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's scheduler-order warning is not raised to users
        step.after_step()  # the update: the scaler finds the overflow and skips it
    assert state.scheduler.last_epoch == 1  # the schedule moved all the same
    assert torch.equal(model.weight, before)  # skipped: nothing trained
    assert step.scaler_skips() == 1
    assert step.scaler_skips() == 0  # read and reset
    state.scaler = torch.amp.GradScaler("cpu", enabled=False)
    assert step.scaler_skips() is None  # no scaler, nothing to count


class _OverflowingStep(CountingStep):
    """A step whose fp16 scaler skipped 3 updates."""

    def scaler_skips(self):
        return 3.0


def _count_overflows(ctx):
    from fastload.engine import EpochSpan, GracefulStop, train_one_epoch
    from fastload.telemetry.timer import StepTimer

    batches = [{"image": torch.zeros(2, 1), "target": torch.zeros(2), "skipped": 0}] * 4
    with GracefulStop() as stopper:
        done = train_one_epoch(
            _OverflowingStep(), batches, ctx, EpochSpan(0, 0, 4), stopper=stopper,
            timer=StepTimer(), progress=False, watch=LossWatch(ctx.device),
            budget=SkipBudget(0.0, 16),
        )  # fmt: skip
    return done.metrics["scaler_skipped_steps"], done.trained


def _agree_on_a_signal(ctx):
    from fastload.engine import GracefulStop, signal_agreed

    with GracefulStop() as stopper:
        quiet = signal_agreed(stopper, ctx)  # no rank has a signal
        stopper.signum = signal.SIGTERM if ctx.rank == 0 else None  # rank 0 alone got one
        return quiet, signal_agreed(stopper, ctx), stopper.signum


def test_a_signal_one_rank_got_after_the_last_check_stops_every_rank(tmp_path):
    """The check after an epoch is agreed: a rank that alone saw SIGTERM while writing the
    epoch's checkpoint does not stop (and wait in a collective) while the others train on."""
    got = on_gloo_ranks(_agree_on_a_signal, tmp_path)
    assert got == {0: (False, True, signal.SIGTERM), 1: (False, True, signal.SIGTERM)}


def _stage_fails(ctx):
    from fastload.dist import agreed

    assert agreed(ctx, "warming up", lambda: ctx.rank * 10) == ctx.rank * 10  # all well

    def stage():
        raise ConfigError("storage.target_dir=/full: no room")

    try:  # rank 1 alone does the work (a node's local rank 0 staging), and fails
        agreed(ctx, "preparing the data", stage if ctx.rank == 1 else None)
        return "went on"
    except FastloadError as exc:
        return f"{type(exc).__name__}: {exc}"


def test_an_error_on_one_rank_stops_every_rank_at_once(tmp_path):
    """A rank that fails in a phase all ranks finish together (staging, the pre-flight
    check, loader=auto's probe) tells the others, which stop naming it instead of waiting
    for the process group's 30-minute timeout."""
    got = on_gloo_ranks(_stage_fails, tmp_path)
    assert got[1] == "ConfigError: storage.target_dir=/full: no room"
    assert got[0].startswith("RankFailed: rank 1 stopped with an error while preparing the data")
    assert "train.rank<N>.log" in got[0]


class _NodeStorage:
    """A storage whose preparation fails on rank 1 (another node's local rank 0) and whose
    `finish` (storage.cleanup's) leaves a mark in `folder`."""

    def __init__(self, folder):
        self.folder = folder

    def prepare(self, layout, names, skip_corrupt=False) -> None:
        import torch.distributed as torch_dist

        if torch_dist.get_rank() == 1:
            raise ConfigError("storage.target_dir=/full: no room")

    def finish(self, layout, names) -> None:
        import torch.distributed as torch_dist

        (self.folder / f"finished.{torch_dist.get_rank()}").write_text(",".join(names))


def _two_nodes_prepare(ctx):
    import torch.distributed as torch_dist
    from omegaconf import OmegaConf

    from fastload.dist import DistContext
    from fastload.pipeline import prepare_data

    rank = torch_dist.get_rank()
    node = DistContext(rank=rank, local_rank=0, world_size=2, local_world_size=1)
    cfg = OmegaConf.create({"dataset": {
        "prepare": None, "train_split": "train", "val_split": "val", "skip_corrupt": False,
        "layout": {"_target_": "builtins.dict"}}})  # fmt: skip
    folder = Path(os.environ["NODE_FOLDER"])
    try:
        prepare_data(cfg, node, storage=_NodeStorage(folder))
        return "prepared"
    except FastloadError as exc:
        return type(exc).__name__


def test_a_node_whose_preparation_went_well_cleans_up_when_another_nodes_failed(
    tmp_path, monkeypatch
):
    """storage.cleanup=true removes the tmpfs copy when training ends; a run stopped while
    preparing the data, because another node's staging failed, left this node's copy in
    RAM."""
    monkeypatch.setenv("NODE_FOLDER", str(tmp_path))
    got = on_gloo_ranks(_two_nodes_prepare, tmp_path)
    assert got == {0: "RankFailed", 1: "ConfigError"}
    assert (tmp_path / "finished.0").read_text() == "train,val"


class _SlowStorage:
    """A storage whose preparation (staging) takes `seconds`, or kills its process."""

    def __init__(self, seconds: float, die: bool = False):
        self.seconds, self.die = seconds, die

    def prepare(self, layout, names, skip_corrupt=False) -> None:
        import os
        import time

        time.sleep(self.seconds)
        if self.die:
            os._exit(3)  # killed while staging: no error, no word to the other ranks


def _prepare_on_ranks(rank, world, init, tmp_path, out, seconds=6.0, die=False,
                      term_after=None) -> None:  # fmt: skip
    """Rank 0 (local rank 0) prepares the data for `seconds` under a 2 s process group
    timeout; rank 1 waits (and gets a SIGTERM after `term_after` seconds). Puts (rank,
    outcome, what rank 1 logged)."""
    import datetime
    import logging

    import torch.distributed as torch_dist
    from omegaconf import OmegaConf

    from fastload import dist
    from fastload.dist import DistContext
    from fastload.pipeline import prepare_data

    torch_dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                  timeout=datetime.timedelta(seconds=60))  # fmt: skip
    torch_dist.barrier()  # both started: from here on a collective waits 2 s at most
    torch_dist.set_timeout(datetime.timedelta(seconds=2))
    dist.BEAT_S, dist.STALL_S = 0.5, 3.0
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("fastload").addHandler(handler)
    logging.getLogger("fastload").setLevel(logging.INFO)
    cfg = OmegaConf.create({"dataset": {
        "prepare": None, "train_split": "train", "val_split": "val", "skip_corrupt": False,
        "layout": {"_target_": "builtins.dict"}}})  # fmt: skip
    ctx = DistContext(rank=rank, local_rank=rank, world_size=world, local_world_size=world)
    if term_after is not None and rank == 1:
        import os
        import signal
        import threading

        threading.Timer(term_after, os.kill, (os.getpid(), signal.SIGTERM)).start()
    try:
        prepare_data(cfg, ctx, storage=_SlowStorage(seconds, die))
        outcome = "prepared"
    except BaseException as exc:  # Terminated is a KeyboardInterrupt
        outcome = f"{type(exc).__name__}: {exc}"
    out.put((rank, outcome, lines))
    if outcome == "prepared":
        torch_dist.destroy_process_group()


def test_ranks_wait_for_a_data_preparation_longer_than_the_collective_timeout(tmp_path, capfd):
    """Local rank 0's staging may take hours; the other ranks wait for it without the
    process group's deadline (which would end the run with gloo's or NCCL's timeout), and
    say what they wait for, without c10d's timeout warnings at every poll of the TCP store
    (torchrun's)."""
    import torch.multiprocessing as mp
    from conftest import free_port

    spawn = mp.get_context("spawn")
    out = spawn.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [spawn.Process(target=_prepare_on_ranks, args=(r, 2, init, tmp_path, out))
             for r in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        got = {rank: rest for rank, *rest in (out.get(timeout=120) for _ in procs)}
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            p.kill()
    assert got[0][0] == got[1][0] == "prepared"
    assert any("waiting for local rank 0 to prepare the data" in line for line in got[1][1])
    assert "likely a timeout" not in capfd.readouterr().err


def test_a_rank_killed_while_preparing_the_data_stops_the_waiting_ranks(tmp_path):
    """The ranks waiting without a deadline still stop when the rank they wait for is
    killed: its heartbeat stops."""
    import functools

    import torch.multiprocessing as mp

    spawn = mp.get_context("spawn")
    out = spawn.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    target = functools.partial(_prepare_on_ranks, seconds=2.0, die=True)
    procs = [spawn.Process(target=target, args=(r, 2, init, tmp_path, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        rank, outcome, _ = out.get(timeout=120)
        procs[0].join(60)
    finally:
        for p in procs:
            p.kill()
    assert procs[0].exitcode == 3
    assert rank == 1 and outcome.startswith(
        "RankLost: rank 1 waited for the other ranks while "
        "preparing the data: 1 of 2 ranks are not done"
    )


def test_a_sigterm_to_a_rank_waiting_for_the_data_preparation_stops_it_as_ctrl_c_does(
    tmp_path,
):
    """Slurm or torchrun ends every rank with SIGTERM: one that waits for local rank 0's
    staging ends like the staging rank (Terminated: one line, exit 143 in train.py), not
    killed without a word."""
    import functools

    import torch.multiprocessing as mp

    spawn = mp.get_context("spawn")
    out = spawn.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    target = functools.partial(_prepare_on_ranks, seconds=20.0, term_after=2.0)
    procs = [spawn.Process(target=target, args=(r, 2, init, tmp_path, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        rank, outcome, _ = out.get(timeout=120)
    finally:
        for p in procs:
            p.kill()
    assert rank == 1 and outcome.startswith("Terminated"), outcome


def _resume_different_checkpoints(ctx):
    from pathlib import Path

    from omegaconf import OmegaConf

    from fastload.engine import same_checkpoint

    cfg = OmegaConf.create({"resume": "auto", "output_root": "outputs"})
    same = (Path("outputs/r/1/checkpoints/last.pt"), {})
    same_checkpoint(same, cfg, ctx)  # the same file everywhere: nothing said
    try:  # rank 1's node-local output_root holds no checkpoint
        same_checkpoint(same if ctx.rank == 0 else None, cfg, ctx)
        return "went on"
    except FastloadError as exc:
        return f"{type(exc).__name__}: {exc}"


def test_ranks_that_found_different_checkpoints_stop_instead_of_drifting(tmp_path):
    got = on_gloo_ranks(_resume_different_checkpoints, tmp_path)
    assert got[1].startswith("CheckpointError: resume=auto: rank 0 continues outputs/r/1/")
    assert "rank 1 found no checkpoint" in got[1] and "file system all nodes share" in got[1]
    assert got[0].startswith("RankFailed: rank 1 stopped with an error while checking")


def test_the_scaler_skipped_steps_of_ddp_ranks_are_one_count(tmp_path):
    """Every rank's scaler skips the same updates (it looks at the reduced gradients), so
    two ranks that each skipped 3 updates report 3, not 6; samples still add up."""
    assert on_gloo_ranks(_count_overflows, tmp_path) == {0: (3, 16), 1: (3, 16)}


@pytest.mark.parametrize("value", ["nan", "-1", "0", "true"])
def test_a_gradient_clip_that_cannot_work_is_refused(value):
    cfg = compose_config([f"optim.clip_grad_norm={value}"])
    with pytest.raises(ConfigError, match=r"optim\.clip_grad_norm=.*use null \(no clipping\)"):
        check_options(cfg.optim)
    check_options(compose_config(["optim.clip_grad_norm=1.0"]).optim)  # and a real one is not


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_a_learning_rate_that_cannot_train_is_refused(value):
    cfg = compose_config([f"optim.base_lr={value}"])
    with pytest.raises(ConfigError, match=r"optim\.base_lr=.*use a finite number > 0"):
        check_options(cfg.optim)


def test_bad_numbers_are_one_line_naming_the_option(tmp_path):
    root = make_image_folder(tmp_path / "d")
    for extra, needle in (
        (["optim.base_lr=-1"], "optim.base_lr=-1"),
        (["loader.num_workers=1", "loader.prefetch_factor=0"], "loader.prefetch_factor=0"),
        (["dataset.max_skipped_share=2"], "dataset.max_skipped_share=2"),
    ):
        out = run_train(tiny_overrides(root, tmp_path / "run", *extra))
        assert_clean_failure(out, needle)
        assert out.returncode == 2


def test_skipping_more_than_the_bound_stops_the_run(tmp_path):
    """A shard or folder whose samples are all undecodable must not "succeed" with a train
    loss of 0: dataset.max_skipped_share bounds what skip_corrupt may leave out."""
    root = make_image_folder(tmp_path / "d")
    for bad in sorted((root / "train").rglob("*.jpg"))[:10]:  # 10 of 18
        bad.write_bytes(b"\xff\xd8 truncated")
    run_dir = tmp_path / "run"
    out = run_train(tiny_overrides(root, run_dir, "dataset.skip_corrupt=true"))
    assert_clean_failure(out, "could not be decoded", "dataset.max_skipped_share=0.01")
    assert "100.0 %" in out.stderr and str(root / "train") in out.stderr  # names the files
    assert out.returncode == 2 and not (run_dir / "summary.json").exists()


def test_the_skip_budget_is_a_share_of_the_epoch():
    budget = SkipBudget(0.1, epoch_samples=100)
    assert not budget.exceeded_early(10) and budget.exceeded_early(11)
    budget.check(0, "training", skipped=1, used=9, files=[])  # 10 %: allowed
    with pytest.raises(TooManySkipped, match="2 of 10 validation samples .20.0 %"):
        budget.check(0, "validation", skipped=2, used=8, files=["a.jpg"])
    SkipBudget(0.0, 10).check(0, "training", skipped=0, used=10, files=[])
    # a part of an epoch (stopped by a signal, or resumed inside): one bad file in its first
    # 8 samples is 12.5 % of them, which stopped a preempted run without its checkpoint;
    # only more skips than the whole epoch may have stop it
    budget.check(1, "training", skipped=1, used=7, files=["a.jpg"], part=True)
    budget.check(1, "training", skipped=10, used=7, files=["a.jpg"], part=True)
    with pytest.raises(TooManySkipped, match="11 of 18 training samples .61.1 %"):
        budget.check(1, "training", skipped=11, used=7, files=["a.jpg"], part=True)


@pytest.mark.parametrize("value", ["1.5", "0", "abc"])
def test_num_classes_is_a_whole_number_before_a_model_is_built(value, tmp_path):
    from fastload.tasks.base import build_task

    cfg = compose_config(tiny_overrides(tmp_path, tmp_path / "run", f"dataset.num_classes={value}"))
    with pytest.raises(ConfigError, match=r"dataset\.num_classes=.*use a whole number >= 1"):
        build_task(cfg).build_model(cfg)


def test_a_resume_refuses_a_model_setting_that_changes_what_is_computed(tmp_path):
    """srcnn's model.residual (or its filters) loads the same weights into another
    computation: refused with the key, as any result-shaping change. The initial weights'
    settings shape nothing on a resume, and another arch or class count is left to the
    model check (its own message)."""
    from fastload import checkpoint as ckpt
    from fastload.errors import CheckpointError
    from fastload.train_state import check_same_run

    def run_config(*extra):
        overrides = ["experiment=srcnn_div2k", f"output_root={tmp_path}", *extra]
        return ckpt.run_config(compose_config(overrides))

    saved = {"run_config": run_config()}
    with pytest.raises(CheckpointError, match=r"model.residual: True -> False"):
        check_same_run(saved, run_config("model.residual=false"), tmp_path / "last.pt")
    check_same_run(saved, run_config("+model.weights=/w/srcnn.pt"), tmp_path / "last.pt")
    check_same_run(saved, run_config("model.arch=other"), tmp_path / "last.pt")


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.device=gpu", "trainer.device='gpu': use one of auto, cpu, cuda"),
        ("trainer.device=cuda:1", "CUDA_VISIBLE_DEVICES"),
        ("trainer.compile=maybe", "trainer.compile='maybe': use one of true, false"),
        ("trainer.channels_last=no", "trainer.channels_last='no': use one of auto, true, false"),
        ("loader.pin_memory=yes", "loader.pin_memory='yes'"),
        ("dataset.skip_corrupt=off", "dataset.skip_corrupt='off'"),
        ("dataset.train_transform.size=0", "dataset.train_transform.size=0: use a whole number"),
        ("dataset.val_transform.size=-4", "dataset.val_transform.size=-4"),
        ("dataset.val_transform.resize=1.5", "dataset.val_transform.resize=1.5"),
        ("dataset.train_transform.scale=[1.5,0.2]", "scale=[1.5, 0.2]: use [low, high] with 0 <"),
        ("dataset.train_transform.ratio=[0,1]", "dataset.train_transform.ratio=[0, 1]"),
        ("dataset.train_transform.hflip=2", "dataset.train_transform.hflip=2: use a probability"),
        ("logger.mode=ofline", "logger.mode='ofline': use one of offline, online, disabled"),
        ("logger.init_timeout_s=0", "logger.init_timeout_s=0: use a number of seconds > 0"),
        ("logger.init_timeout_s=soon", "logger.init_timeout_s='soon': use a number of seconds"),
        ("logger.tags=5", "logger.tags=5: use one tag (logger.tags=baseline) or a list"),
        ("logger.tags=[[a]]", "logger.tags: ['a'] is not a tag"),
    ],
)
def test_an_option_out_of_its_values_is_refused_by_name(override, message):
    """trainer.device=gpu trained on the CPU, trainer.compile=maybe compiled; a crop of
    size 0 or an empty scale range failed every image and the run blamed the images
    ("cannot decode ... remove or replace the file"); val size -4 failed after an epoch."""
    from fastload.engine import check_config

    with pytest.raises(ConfigError) as err:
        check_config(compose_config([override]))
    assert message in err.value.user_message


@pytest.mark.parametrize("dataset", ["synthetic", "imagenet", "coco", "div2k"])
def test_every_shipped_dataset_config_passes_the_option_checks(dataset):
    from fastload.data.transforms import check_transforms
    from fastload.engine import check_choices

    cfg = compose_config([f"dataset={dataset}"])
    check_choices(cfg)
    check_transforms(cfg.dataset)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["backend=pil", "backend.draft=no"], "backend.draft='no': use one of true, false"),
        (["storage.cold_cache=off"], "storage.cold_cache='off': use one of true, false"),
        (["loader.reuse_batch_memory=maybe"], "loader.reuse_batch_memory='maybe'"),
        (["backend=turbo", "backend.dct_scale=maybe"], "backend.dct_scale='maybe'"),
        (["backend=turbo", "backend.fastdct=maybe"], "backend.fastdct='maybe'"),
        (["backend=turbo", "backend.fastupsample=yes"], "backend.fastupsample='yes'"),
        (["storage=lmdb", "storage.verify=maybe"], "storage.verify='maybe'"),
        (["storage=shards", "storage.auto_pack=no"], "storage.auto_pack='no'"),
        (["storage=tmpfs", "storage.cleanup=yes"], "storage.cleanup='yes'"),
        (["storage=tmpfs", "storage.progress=off"], "storage.progress='off'"),
        (["storage=tmpfs", "storage.cold_cache=on"], "storage.cold_cache='on'"),
        (["storage=webdataset", "storage.cold_cache=no"], "storage.cold_cache='no'"),
        (["storage=webdataset", "storage.skip_corrupt=no"], "storage.skip_corrupt='no'"),
        (["model.zero_init_residual=no"], "model.zero_init_residual='no'"),
        (["model=srcnn", "dataset=div2k", "model.residual=off"], "model.residual='off'"),
        (["optim.no_weight_decay_on_bn_and_bias=no"], "optim.no_weight_decay_on_bn_and_bias"),
        (["optim.optimizer.nesterov=off"], "optim.optimizer.nesterov='off'"),
        (["doctor.preflight=no"], "doctor.preflight='no'"),
        (["loader=auto", "loader.auto.cache=no"], "loader.auto.cache='no'"),
        (["loader=auto", "loader.auto.pin_memory=[yes]"], "loader.auto.pin_memory=['yes']"),
        (["loader=auto", "loader.auto.budget_s=0"], "loader.auto.budget_s=0"),
    ],
)
def test_a_switch_set_to_a_word_is_refused_by_name(overrides, message):
    """A true/false option read by its truth took any word for true: backend.draft=no and
    storage.cold_cache=off ran with both on. Every switch of every group is refused, naming
    the option and its value, before any work."""
    from fastload.engine import check_config

    with pytest.raises(ConfigError) as err:
        check_config(compose_config(overrides))
    assert message in err.value.user_message


@pytest.mark.parametrize(
    "overrides",
    [
        *([f"storage={s}"] for s in ("disk", "slow_disk", "tmpfs", "lmdb", "shards", "webdataset")),
        *([f"backend={b}"] for b in ("pil", "pillow-simd", "turbo", "nvjpeg", "accimage")),
        *([f"loader={x}"] for x in ("baseline", "bg", "prefetch", "prefetch+bg", "auto")),
        *([f"variant={v}"] for v in ("lmdb_lz4", "preresized_shards", "raw_shards")),
        ["model=srcnn", "dataset=div2k", "optim=adam"],
        ["loader=auto", "loader.auto.gpu_decode=true", "loader.auto.pin_memory=[]"],
        ["loader.pin_memory=auto", "trainer.channels_last=auto", "storage.cold_cache=true"],
    ],
)
def test_every_shipped_group_config_passes_the_switch_checks(overrides):
    from fastload.engine import check_config

    check_config(compose_config(overrides))


def apex_importable() -> bool:
    try:
        import apex  # noqa: F401
    except ImportError:
        return False
    return True


NO_APEX = pytest.mark.skipif(apex_importable(), reason="apex is installed here")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["loader=bg", "loader.max_prefetch=abc"], "loader.max_prefetch='abc': use a whole"),
        (["loader=bg", "loader.max_prefetch=2.7"], "loader.max_prefetch=2.7: use a whole number"),
        (["loader=prefetch+bg", "loader.max_prefetch=0"], "loader.max_prefetch=0: use a whole"),
        (["storage=shards", "storage.max_side=abc"], "storage.max_side='abc': use a whole number"),
        (["storage=lmdb", "storage.max_side=1.5"], "storage.max_side=1.5: use a whole number"),
        (["storage=lmdb", "storage.size=big"], "storage.size='big': use a whole number or null"),
        (["loader.prefetch_factor=0"], "loader.prefetch_factor=0: use a whole number >= 1"),
        (["loader.timeout=-1"], "loader.timeout=-1: use 0 (wait forever) or seconds > 0"),
        (["loader.timeout=soon"], "loader.timeout='soon': use 0 (wait forever)"),
        (["loader.balanced_tail=maybe"], "loader.balanced_tail='maybe': use auto"),
        (["loader.pin_memory_max_mb=lots"], "loader.pin_memory_max_mb='lots': use a number"),
        (["loader.num_workers=2.7"], "loader.num_workers=2.7: use a whole number >= 0 or 'auto'"),
        (["loader.num_workers=abc"], "loader.num_workers='abc': use a whole number >= 0"),
        (["loader.num_workers=true"], "loader.num_workers=True: use a whole number >= 0"),
        (["storage=webdataset", "storage.quality=abc"], "storage.quality='abc': use a JPEG"),
        (["storage=lmdb", "storage.quality=0"], "storage.quality=0: use a JPEG quality from 1"),
        (["storage=webdataset", "storage.shard_mb=abc"], "storage.shard_mb='abc': use a number"),
        (["storage=shards", "storage.shard_mb=abc"], "storage.shard_mb='abc': use a number"),
        (["storage=shards", "storage.max_side=-5"], "storage.max_side=-5: use null"),
        pytest.param(["optim=apex_sgd"], "optim=apex_sgd needs NVIDIA apex", marks=NO_APEX),
    ],
)
def test_a_loader_storage_or_optimizer_option_is_refused_before_any_work(overrides, message):
    """loader.max_prefetch=abc and storage.max_side=abc failed with a traceback (2.7 was
    cut to 2, as loader.num_workers=2.7 was); the loader's, the packed storages' (quality,
    shard_mb) and optim=apex_sgd's own checks ran only when the loader, the storage or the
    optimiser was built."""
    from fastload.engine import check_config

    with pytest.raises(ConfigError) as err:
        check_config(compose_config(overrides))
    assert message in err.value.user_message


@pytest.mark.parametrize(
    "extra, message",
    [
        pytest.param(["optim=apex_sgd"], "optim=apex_sgd needs NVIDIA apex", marks=NO_APEX),
        (["loader.num_workers=1", "loader.prefetch_factor=0"], "loader.prefetch_factor=0: use"),
        (["storage.max_side=abc"], "storage.max_side='abc': use a whole number or null"),
    ],
)
def test_refused_options_stop_the_run_before_the_packing(extra, message, tiny_folder, tmp_path):
    packs = tmp_path / "packs"
    args = ["storage=shards", f"storage.path={packs}", *extra]
    out = run_train(tiny_overrides(tiny_folder, tmp_path / "out" / "x" / "run", *args))
    assert_clean_failure(out, message)
    assert not packs.exists()


def wandb_logged_out(tmp_path) -> dict:
    """An environment in which W&B finds no credentials (no key, no netrc, no settings)."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {"HOME": str(home), "NETRC": str(home / "netrc"), "WANDB_API_KEY": "",
            "WANDB_CONFIG_DIR": str(home / "wandb"), "WANDB_IDENTITY_TOKEN_FILE": ""}  # fmt: skip


def test_logger_mode_online_without_a_wandb_login_is_refused(tmp_path, monkeypatch):
    """Looked up as wandb does, without a network call: the environment variable, or the
    netrc entry `wandb login` writes."""
    wandb = pytest.importorskip("wandb")
    from fastload.telemetry.wandb_sink import check_login

    for var, value in wandb_logged_out(tmp_path).items():
        monkeypatch.setenv(var, value)
    online = compose_config(["logger=wandb", "logger.mode=online"]).logger
    wandb.teardown()  # settings read afresh from this environment
    try:
        with pytest.raises(ConfigError) as err:
            check_login(online)
        message = err.value.user_message
        assert "`wandb login`" in message and "WANDB_API_KEY" in message, message
        assert "logger.mode=offline" in message
        check_login(compose_config(["logger=wandb"]).logger)  # offline: no login needed
        netrc = tmp_path / "home" / "netrc"
        netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {'k' * 40}\n")
        netrc.chmod(0o600)
        check_login(online)
        netrc.unlink()
        monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
        check_login(online)
    finally:
        wandb.teardown()


@pytest.mark.parametrize("override", ["logger.mode=ofline", "logger.mode=online"])
def test_a_bad_logger_option_stops_train_py_before_any_work(tmp_path, override):
    """logger.mode=ofline was refused when the sink was built: after the data preparation,
    the loader=auto probe, the model and the loaders (26 s on a tiny dataset, the staging
    and packing on a real one), leaving a run folder with an empty metrics.jsonl."""
    root = make_image_folder(tmp_path / "d", classes=("a", "b", "c"), per_split=(1, 1))
    run_dir = tmp_path / "out" / "x" / "run"
    out = run_train(tiny_overrides(root, run_dir, "logger=wandb", override),
                    env=wandb_logged_out(tmp_path))  # fmt: skip
    assert_clean_failure(out, "logger.mode=")
    assert out.returncode == 2
    assert not (run_dir / "metrics.jsonl").exists()


def test_a_misnamed_device_stops_train_py_before_any_work(tmp_path):
    root = make_image_folder(tmp_path / "d")
    out = run_train(tiny_overrides(root, tmp_path / "run", "trainer.device=gpu"))
    assert_clean_failure(out, "trainer.device='gpu': use one of auto, cpu, cuda")
    assert out.returncode == 2


@pytest.mark.parametrize(
    "override, message",
    [
        ("loader=prefetchh", "Could not find 'loader/prefetchh'; Available options in 'loader':"),
        ("trainer.epoch=3", "Could not override 'trainer.epoch'"),
    ],
)
def test_a_misspelt_option_or_choice_is_one_line_exit_2(tmp_path, override, message):
    """Hydra's own report was several lines (its config search path included), exit 1."""
    root = make_image_folder(tmp_path / "d", classes=("a", "b", "c"), per_split=(1, 1))
    out = run_train(tiny_overrides(root, tmp_path / "run", override))
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
