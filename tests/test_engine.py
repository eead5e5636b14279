"""Engine pieces that the end-to-end runs cannot reach on a CPU machine."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from conftest import compose_config, tiny_overrides
from omegaconf import OmegaConf

from fastload import checkpoint as ckpt
from fastload.config import run_id
from fastload.dist import DistContext, wrap_ddp
from fastload.engine import GracefulStop, amp_dtype, check_config
from fastload.errors import CheckpointError, ConfigError
from fastload.optim import apex_fused_sgd, param_groups, warmup_cosine


def test_precision_choices():
    cpu = torch.device("cpu")
    assert amp_dtype("auto", cpu) is None and amp_dtype("bf16", cpu) is torch.bfloat16
    with pytest.raises(ConfigError, match="trainer.precision=fp16 needs CUDA"):
        amp_dtype("fp16", cpu)
    with pytest.raises(ConfigError, match="trainer.precision='fp8'"):
        amp_dtype("fp8", cpu)
    assert amp_dtype("bf16", cpu, "bf16") is torch.bfloat16  # the input of autocast's dtype
    with pytest.raises(ConfigError, match="loader.input_dtype=fp16 needs autocast"):
        amp_dtype("auto", cpu, "fp16")  # auto is fp32 on a CPU


def test_apex_options_explain_how_to_get_apex():
    pytest.importorskip("torch")
    try:
        import apex  # noqa: F401

        pytest.skip("apex is installed here")
    except ImportError:
        pass
    cfg = OmegaConf.create({"trainer": {"ddp": "apex"}})
    with pytest.raises(ConfigError, match="trainer.ddp=apex needs NVIDIA apex.*trainer.ddp=native"):
        wrap_ddp(torch.nn.Linear(2, 2), cfg, DistContext(world_size=2))
    # before any work, also in a single process (which wraps nothing): it passed silently
    full = compose_config(["trainer.ddp=apex"])
    with pytest.raises(ConfigError, match="trainer.ddp=apex needs NVIDIA apex"):
        check_config(full)
    with pytest.raises(ConfigError, match="optim=apex_sgd needs NVIDIA apex"):
        apex_fused_sgd([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def test_no_weight_decay_on_bn_and_bias():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    decay, no_decay = param_groups(model, 1e-4, skip_bn_and_bias=True)
    assert [p.ndim for p in decay["params"]] == [4]
    assert no_decay["weight_decay"] == 0 and len(no_decay["params"]) == 3


def test_warmup_then_cosine():
    f = warmup_cosine(total_steps=100, warmup_steps=10, min_ratio=0.0)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.5) and f(100) == pytest.approx(0.0)
    assert all(f(i) >= f(i + 1) for i in range(10, 100))


def test_checkpoint_write_is_atomic_and_loads_without_pickle(tmp_path):
    path = tmp_path / "c" / "last.pt"
    ckpt.save_atomic({"format": ckpt.FORMAT, "x": torch.ones(2), "rng": ckpt.rng_state()}, path)
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]
    state = ckpt.load(path)  # weights_only=True inside
    ckpt.set_rng_state(state["rng"])
    path.write_bytes(path.read_bytes()[:100])  # damaged
    with pytest.raises(CheckpointError, match=str(path)):
        ckpt.load(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        ckpt.load(tmp_path / "missing.pt")


def test_resume_takes_a_run_folder_for_its_last_checkpoint(tmp_path):
    """resume=<run folder> said the folder "does not exist"."""
    from omegaconf import OmegaConf

    from fastload.engine import find_resume

    run = tmp_path / "out" / "n" / "2026-11-27_05-00-00"
    last = run / "checkpoints" / "last.pt"
    ckpt.save_atomic({"format": ckpt.FORMAT, "x": torch.ones(2)}, last)
    for given in (run, run / "checkpoints", last):
        cfg = OmegaConf.create({"resume": str(given), "output_root": str(tmp_path / "out")})
        assert find_resume(cfg)[0] == last
    with pytest.raises(CheckpointError, match=r"is a folder without a checkpoint.*resume=auto"):
        ckpt.load(tmp_path / "out")
    with pytest.raises(CheckpointError, match=r"is a folder: pass one of its files, .*last\.pt"):
        ckpt.load_weights(run)  # evaluate=<a folder>: the weight files it holds
    with pytest.raises(CheckpointError, match=r"checkpoints/best\.pt or <run>"):
        ckpt.load_weights(tmp_path / "out")  # none there: which files to pass


def test_an_option_added_since_a_checkpoint_and_off_is_no_config_difference():
    saved = {"optim.base_lr": 0.2}  # written before optim.clip_grad_norm existed
    assert (
        ckpt.config_differences(saved, {"optim.base_lr": 0.2, "optim.clip_grad_norm": None}) == []
    )
    assert ckpt.config_differences(saved, {"optim.base_lr": 0.2, "optim.clip_grad_norm": 1.0}) == [
        "optim.clip_grad_norm: '(unset)' -> 1.0"
    ]
    assert ckpt.config_differences({"a": None}, {}) == ["a: None -> '(unset)'"]


def test_find_latest_checkpoint(tmp_path):
    for i, run in enumerate(["a", "b"]):
        p = tmp_path / "exp" / run / "checkpoints" / "last.pt"
        p.parent.mkdir(parents=True)
        p.write_bytes(b"x")
        os.utime(p, (time.time() + i, time.time() + i))
    assert ckpt.find_latest(tmp_path, "exp").parts[-3] == "b"
    assert ckpt.find_latest(tmp_path, "other") is None


def test_a_killed_checkpoint_writers_file_is_removed_by_the_next_run(tmp_path, caplog):
    """SIGKILL during a checkpoint write leaves .last.pt.tmp-<host>~<pid ns>-<pid> (as large
    as a checkpoint); the next run of the same name removes those of dead writers only."""
    import subprocess
    import sys

    from fastload.atomic import temp_path

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folders = [tmp_path / "exp" / run / "checkpoints" for run in ("r1", "r2")]
    last = [f / ckpt.LAST for f in folders]
    for f in folders:
        f.mkdir(parents=True)
    stale = temp_path(last[0], pid=dead.pid)
    live = temp_path(last[1], pid=os.getpid())  # a run writing right now
    other = tmp_path / "exp" / "r1" / "checkpoints" / "notes.txt"
    # best weights are written the same way (best.pt.pending, then copies of best.pt)
    bests = [temp_path(folders[1] / n, pid=dead.pid)
             for n in ("best.pt.pending", "best_ema.pt.pending", "best.pt")]  # fmt: skip
    for p in (stale, live, other, *bests):
        p.write_bytes(b"partial")
    with caplog.at_level("INFO", logger="fastload"):
        assert sorted(ckpt.remove_dead_temps(tmp_path, "exp")) == sorted([stale, *bests])
    assert not stale.exists() and live.exists() and other.exists()
    assert not any(p.exists() for p in bests)
    assert str(stale) in caplog.text


class CountingStep:
    """The parts of a task step train_one_epoch uses, doing no work."""

    train_sums, settled = 2, True

    def train_mode(self): ...
    def begin(self, steps): ...
    def after_step(self): ...
    def finish(self): ...

    def train(self, batch):
        return torch.tensor([1.0, float(len(batch["target"]))], dtype=torch.float64)

    def train_metrics(self, sums):
        return {"train_loss": sums[0] / sums[1]}


def test_the_evaluation_loaders_warm_start_counts_as_data_wait():
    """The hook that starts the evaluation loader's workers before training's last steps
    blocks the loop on the data path: data wait, as a worker start inside iter() is."""
    from fastload.engine import EpochSpan, train_one_epoch
    from fastload.telemetry.timer import StepTimer
    from fastload.train_checks import LossWatch, SkipBudget

    started = []

    def warm_start():
        time.sleep(0.3)
        started.append(True)

    ctx = DistContext()
    batches = [{"image": torch.zeros(2, 1), "target": torch.zeros(2), "skipped": 0}] * 4
    with GracefulStop() as stopper:
        done = train_one_epoch(
            CountingStep(), batches, ctx, EpochSpan(0, 0, 4), stopper=stopper, timer=StepTimer(),
            progress=False, watch=LossWatch(ctx.device), budget=SkipBudget(0.0, 8),
            hooks={2: warm_start},
        )  # fmt: skip
    assert started and done.steps == 4
    assert done.timing.data_wait_s >= 0.25 and done.timing.compute_s < 0.1


def test_the_doctors_feed_counts_a_slow_end_of_data_as_wait():
    """A DataLoader joins its workers when its data ends: the doctor's feed times that as
    data wait, inside its wall time, as the training loop's timer does."""
    from fastload.measure import feed

    def loader():
        yield from [{"image": torch.zeros(2, 1), "target": torch.zeros(2)}] * 3
        time.sleep(0.3)  # the workers' shutdown

    step = CountingStep()
    step.sync = lambda: None
    out = feed(loader(), step)
    assert out.batches == 3 and out.images == 6
    assert 0.25 <= out.wait_s <= out.wall_s


def test_graceful_stop_turns_sigterm_into_a_flag():
    with GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert stop.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is not stop._handle  # handler restored


def test_run_id_agrees_across_torchrun_ranks(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.delenv("FASTLOAD_RUN_ID", raising=False)
    first = run_id()
    time.sleep(1.1)
    assert run_id() == first  # the agent's start time, not now
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")
    assert run_id() == "torchrun-job42"
    monkeypatch.setenv("FASTLOAD_RUN_ID", "mine")
    assert run_id() == "mine"


def test_more_local_ranks_than_gpus_is_one_clear_error(monkeypatch):
    from fastload import dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail("no device chosen"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ConfigError) as err:
        dist.setup("auto")
    msg = err.value.user_message
    assert "2 ranks on this node but 1 GPU(s) visible (CUDA_VISIBLE_DEVICES=0)" in msg
    assert "--nproc_per_node=1" in msg and "trainer.device=cpu" in msg


def test_a_slurm_task_bound_to_its_own_gpu_uses_it(monkeypatch):
    """srun --gpus-per-task=1: each of a node's 4 tasks sees one GPU (its own
    CUDA_VISIBLE_DEVICES) and uses it as device 0; under torchrun (its ranks share what they
    see) or as the only task, 4 local ranks on 1 visible GPU stay an error."""
    from fastload import dist

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for key in ("SLURM_PROCID", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ConfigError, match="--gpus-per-task=1"):
        dist.gpu_index(3, 4)
    monkeypatch.setenv("SLURM_PROCID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    assert dist.gpu_index(3, 4) == 0
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # torchrun inside an allocation
    with pytest.raises(ConfigError, match="4 ranks on this node but 1 GPU"):
        dist.gpu_index(3, 4)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert dist.gpu_index(3, 4) == 3  # one GPU per local rank: its own index


def test_ranks_of_a_node_on_one_gpu_are_one_clear_error_each(monkeypatch):
    """Each rank publishes its GPU's UUID in the rendezvous store: distinct ones pass; two
    local ranks bound to the same GPU each raise one error naming the ranks, the GPU and
    the Slurm options, before NCCL would fail; another node's keys are its own."""
    import threading

    import torch.distributed as tdist

    from fastload import dist

    monkeypatch.delenv("GROUP_RANK", raising=False)
    monkeypatch.setenv("SLURM_NODEID", "0")

    def ranks(uuids, store):
        errors = {}

        def one(i):
            try:
                dist.check_distinct_gpus(store, "node-a", i, len(uuids), uuids[i])
            except ConfigError as exc:
                errors[i] = exc.user_message

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(uuids))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        return errors

    assert ranks(["GPU-a", "GPU-b", "GPU-c"], tdist.HashStore()) == {}
    errors = ranks(["GPU-a", "GPU-b", "GPU-a"], tdist.HashStore())
    assert sorted(errors) == [0, 2]
    assert "local ranks 0, 2 on node-a all run on GPU GPU-a" in errors[0]
    assert "--gpus-per-task=1" in errors[2] and "trainer.device=cpu" in errors[2]
    store = tdist.HashStore()
    assert ranks(["GPU-a"], store) == {}
    monkeypatch.setenv("SLURM_NODEID", "1")  # a second node of the same name: its own keys
    assert ranks(["GPU-a"], store) == {}


@pytest.mark.parametrize(
    "env, want",
    [
        ({"SLURM_NTASKS_PER_NODE": "8", "SLURM_TASKS_PER_NODE": "4(x2)"}, 8),
        ({"SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "1"}, 4),
        ({"SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2"}, 3),
        ({"SLURM_TASKS_PER_NODE": "2,6", "SLURM_NODEID": "1"}, 6),
        ({}, 1),
    ],
)
def test_slurm_ranks_per_node_without_ntasks_per_node(monkeypatch, env, want):
    """`srun -N2 -n8` sets no SLURM_NTASKS_PER_NODE: the per-node task list says 4 ranks
    share each node (their workers, pinned memory and GPUs), not 1."""
    from fastload.dist import slurm_tasks_on_this_node

    for key in ("SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                "SLURM_NODEID"):  # fmt: skip
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert slurm_tasks_on_this_node() == want


def test_the_evaluation_loaders_early_start_is_not_shortened_by_a_compile_epoch(monkeypatch):
    """The lead (steps before training's end at which the evaluation loader starts) comes
    from the shortest step time so far: an epoch holding torch.compile's minute must not
    make the next epoch's lead two steps. Its steps after the warm start (timed from the
    hook to training's end) measure the compiled step."""
    from types import SimpleNamespace

    from fastload import engine
    from fastload.engine import EpochSpan, EvalWarmStart

    now = [100.0]
    monkeypatch.setattr(engine.time, "perf_counter", lambda: now[0])
    timer = SimpleNamespace(outside_s=0.0)  # no checkpoint inside these epochs
    done = SimpleNamespace(outside_s=0.0)
    warm, span = EvalWarmStart(timer), EpochSpan(epoch=1, first_step=0, max_steps=40)
    assert warm.at_step(span) == 38  # nothing measured: two steps
    started = []
    hooks = warm.hooks(span, lambda: started.append(now[0]))
    assert list(hooks) == [38]
    hooks[38]()  # the compile epoch's warm start: two steps of 40 ms each after it
    now[0] += 0.080
    warm.trained(40, done)
    val = SimpleNamespace(first_batch_s=0.5)
    warm.measured(SimpleNamespace(wall_s=46.0, steps=40), val)  # compilation: 1.15 s a step
    assert started and warm.at_step(span) == 40 - (13 + 1)
    # an epoch stopped before its warm start measures nothing from it
    fresh = EvalWarmStart(timer)
    fresh.hooks(span, lambda: None)
    fresh.trained(30, done)
    fresh.measured(SimpleNamespace(wall_s=46.0, steps=30), val)
    assert fresh.step_s == pytest.approx(46.0 / 30) and fresh.at_step(span) == 38
    warm = EvalWarmStart(timer)
    warm.measured(SimpleNamespace(wall_s=46.0, steps=40), val)  # the mean alone: 1.15 s
    assert warm.at_step(span) == 38
    warm.measured(SimpleNamespace(wall_s=1.6, steps=40), val)  # 40 ms a step
    assert warm.at_step(span) == 40 - (13 + 1)
    warm.measured(SimpleNamespace(wall_s=8.0, steps=40), val)  # a slower epoch: kept
    assert warm.at_step(span) == 40 - (13 + 1)
    assert warm.at_step(EpochSpan(epoch=2, first_step=30, max_steps=40)) == 30


def test_the_evaluation_loaders_lead_leaves_checkpoints_out_of_the_step_time(monkeypatch):
    """A checkpoint written among the steps after the warm start (trainer.
    checkpoint_every_steps) is not their time: counted in, a 3 s write over two 40 ms steps
    made a step 1.5 s and the next epoch's lead two steps."""
    from types import SimpleNamespace

    from fastload import engine
    from fastload.engine import EpochSpan, EvalWarmStart

    now = [100.0]
    monkeypatch.setattr(engine.time, "perf_counter", lambda: now[0])
    timer = SimpleNamespace(outside_s=1.0)  # a checkpoint earlier in the epoch
    warm, span = EvalWarmStart(timer), EpochSpan(epoch=1, first_step=0, max_steps=40)
    warm.hooks(span, lambda: None)[38]()
    now[0] += 0.080 + 3.0  # two 40 ms steps and a 3 s checkpoint between them
    warm.trained(40, SimpleNamespace(outside_s=4.0))
    assert warm.step_s == pytest.approx(0.040)
    warm.measured(SimpleNamespace(wall_s=46.0, steps=40), SimpleNamespace(first_batch_s=0.5))
    assert warm.at_step(span) == 40 - (13 + 1)


def test_an_epochs_lr_is_the_one_its_last_update_used(tmp_path):
    """The row's lr: the schedule steps after every update, so the optimizer's value at the
    epoch's end is the next update's (in warm-up, visibly larger)."""
    from fastload.train_state import TrainState

    cfg = compose_config(tiny_overrides(tmp_path, tmp_path / "run", "optim.warmup_epochs=2"))
    state = TrainState.create(cfg, torch.device("cpu"), 1, 10, amp=None, channels_last=False)
    assert state.last_update_lr() == state.optimizer.param_groups[0]["lr"]  # no update yet
    for _ in range(10):  # an epoch of 10 updates, in warm-up
        used = state.optimizer.param_groups[0]["lr"]
        state.optimizer.step()
        state.scheduler.step()
    assert state.last_update_lr() == pytest.approx(used)
    assert state.optimizer.param_groups[0]["lr"] > used * 1.05  # the next update's


def test_cpu_percent_is_null_when_unmeasured_and_a_mean_over_the_ranks_that_measured(
    monkeypatch,
):
    """The sampler measures CPU % every interval: an epoch shorter than one has no reading.
    It was reported as 0, and under DDP a rank without a reading halved the others' mean."""
    from types import SimpleNamespace

    from fastload import engine

    timing = SimpleNamespace(data_wait_s=0.1, compute_s=0.4, samples=8, wall_s=0.5, outside_s=0.0)
    one = DistContext(device=torch.device("cpu"))
    assert engine.reduce_timing(timing, {"cpu_percent": None}, one)["cpu_percent"] is None
    assert engine.reduce_timing(timing, {"cpu_percent": 80.0}, one)["cpu_percent"] == 80.0
    # rank 1 of two measured 80 %, this rank (0) nothing: the row says 80, not 40
    other = {"sum": [0.1, 0.4, 8, float("nan"), float("nan"), 80.0, 1.0], "max": [0.5, 0, 0, 0]}

    def two_ranks(values, ctx, op="sum"):
        return [a + b if op == "sum" else max(a, b) for a, b in zip(values, other[op], strict=True)]

    monkeypatch.setattr(engine.dist, "all_reduce", two_ranks)
    two = SimpleNamespace(world_size=2, distributed=True)
    row = engine.reduce_timing(timing, {"cpu_percent": None}, two)
    assert row["cpu_percent"] == 80.0 and row["train_images"] == 16


class EmptyTakingStep(CountingStep):
    def train_empty(self, skipped_files=(), spare=None): ...


def _an_epoch_where_rank_1_decodes_nothing(ctx):
    from fastload.engine import EpochSpan, train_one_epoch
    from fastload.telemetry.timer import StepTimer
    from fastload.train_checks import LossWatch, SkipBudget

    if ctx.rank == 0:
        batch = {"image": torch.zeros(2, 1), "target": torch.zeros(2), "skipped": 0,
                 "counts": {"decode_roi": 2, "decode_fallback_cmyk": 0}}  # fmt: skip
    else:  # every sample skipped as corrupt: a batch without the backend's counters
        batch = {"image": None, "target": None, "skipped": 2}
    with GracefulStop() as stopper:
        done = train_one_epoch(
            EmptyTakingStep(), [batch] * 3, ctx, EpochSpan(0, 0, 3), stopper=stopper,
            timer=StepTimer(), progress=False, watch=LossWatch(ctx.device),
            budget=SkipBudget(1.0, 12),
        )  # fmt: skip
    return done.metrics


def test_the_backend_counters_add_up_when_a_rank_decoded_nothing(tmp_path):
    """Only decoded samples carry the counters: the epoch's one all-reduce got one length
    from a rank that decoded something and another from one that did not."""
    from conftest import on_gloo_ranks

    got = on_gloo_ranks(_an_epoch_where_rank_1_decodes_nothing, tmp_path)
    for metrics in got.values():
        assert metrics["decode_roi"] == 6 and metrics["decode_fallback_cmyk"] == 0
        assert metrics["skipped_corrupt"] == 6
