"""Resume on another world size: an interrupted epoch goes on with exactly the samples it had
left, each once, over the new ranks; the epochs after it are a fresh run's at that size."""

from __future__ import annotations

import json
import logging
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import compose_config, make_image_folder, run_torchrun, run_train, tiny_overrides
from torch.utils.data import DistributedSampler

from fastload.data import elastic
from fastload.data.sampling import EpochSampler, ShardStreamSampler
from tests.helpers import recorded


@pytest.mark.parametrize("n", [1, 5, 17, 48])
@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_rank_orders_are_distributed_samplers(n, world):
    sampler = EpochSampler(n, rank=0, world_size=1, shuffle=True, seed=4)
    for r, order in enumerate(sampler.rank_orders(3, world)):
        torch_sampler = DistributedSampler(range(n), num_replicas=world, rank=r, seed=4)
        torch_sampler.set_epoch(3)
        assert order.tolist() == list(torch_sampler)


def trained(plan: elastic.RestPlan, steps: int | None = None) -> list[int]:
    return [int(i) for rank in plan.batches for b in rank[:steps] for i in b]


def check_plan(plan: elastic.RestPlan, world: int, batch: int, continued: bool = True) -> None:
    """What DDP needs: every rank the same number of steps; what BatchNorm needs: at least
    two samples per rank and step (batch size 1: one); and never more than batch_size."""
    assert len(plan.batches) == world
    assert {len(rank) for rank in plan.batches} <= {plan.steps}
    least = min(elastic.MIN_BATCH, batch) if continued else 1  # fresh: the user's drop_last
    assert all(least <= len(b) <= batch for rank in plan.batches for b in rank)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(
    "n,batch,chain",
    [
        (48, 2, [(2, 10), (1, None)]),
        (48, 2, [(2, 10), (3, None)]),  # 8 left over 3 ranks: 6, 2 left out
        (96, 4, [(2, 10), (3, None)]),  # 16 left over 3 ranks: 4+3+3, then 2+2+2
        (48, 2, [(1, 5), (2, None)]),
        (50, 4, [(3, 2), (5, 1), (2, None)]),  # continued twice; 50 pads to 51 on 3 ranks
        (23, 3, [(4, 1), (7, None)]),
        (23, 1, [(2, 3), (3, None)]),  # batch 1: a remainder smaller than the ranks
    ],
)
def test_a_continued_epoch_trains_what_was_left_each_once(n, batch, chain, drop_last):
    sampler = EpochSampler(n, rank=0, world_size=1, shuffle=True, seed=1)
    fresh = elastic.fresh_plan(sampler.rank_orders(2, chain[0][0]), batch, drop_last)
    planned = set(trained(fresh))  # what the uninterrupted epoch trains
    seen: list[int] = []
    stretches = []
    for world, steps in chain:
        plan = elastic.epoch_plan(
            lambda w: sampler.rank_orders(2, w), stretches, world, batch, drop_last
        )
        check_plan(plan, world, batch, continued=bool(stretches))
        seen += trained(plan, steps)
        if steps is not None:
            stretches.append((world, steps))
    counts = Counter(seen)
    assert set(counts) <= planned
    assert max(counts.values()) == 1, [i for i, c in counts.items() if c > 1]
    assert len(planned) - len(counts) == plan.left_out  # only what could not be shared out
    assert plan.left_out < 2 * min(elastic.MIN_BATCH, batch) * chain[-1][0]


def test_a_continued_shard_stream_keeps_each_rank_on_a_run_of_shards():
    """storage=webdataset: a rank continues on one contiguous run of what was left, so it
    still reads few shards (the stream is laid out shard after shard)."""
    sizes = [8] * 12
    sampler = ShardStreamSampler(sizes, rank=0, world_size=1, seed=0, window=4)
    orders = lambda w: sampler.rank_orders(1, w)  # noqa: E731
    first = elastic.fresh_plan(orders(4), 3, False)
    left = elastic.rest(first, 5, np.zeros(96, bool))
    plan = elastic.epoch_plan(orders, [(4, 5)], 3, 3, False)
    check_plan(plan, 3, 3)
    runs = [np.concatenate(rank) for rank in plan.batches]
    assert np.concatenate(runs).tolist() == left.tolist()  # the rest, cut in 3 runs
    shards = [len(set((run // 8).tolist())) for run in runs]
    assert max(shards) <= 4, shards  # 96 - 60 = 36 left: 12 per rank, from 2-4 shards


# -- end to end: torchrun, SIGTERM, resume=<checkpoint> on another world size ----------------

N_TRAIN = 96  # 3 classes x 32: divisible by 1, 2 and 3 ranks, no padding
BATCH = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("elastic") / "data"
    return make_image_folder(root, per_split=(32, 2), size=(40, 32))


def common(out_root, name):
    return [
        f"output_root={out_root}",
        f"name={name}",
        f"trainer.batch_size={BATCH}",
        "loader.drop_last=false",
        "dataset.task._target_=tests.helpers.RecordingClassification",
        "storage._target_=tests.helpers.SigtermAfterReads",
    ]


def launch(world, folder, tmp_path, tag, *extra, env=None):
    """train.py on `world` rank(s) (torchrun above 1), recording what each rank trained under
    tmp_path/tag; returns (the process, the records, the run directory)."""
    record = tmp_path / tag
    record.mkdir()
    env = {"RECORD_SAMPLES": str(record), **(env or {})}
    out_root = tmp_path / "out"
    if world == 1:
        run_dir = out_root / tag / "run"
        args = tiny_overrides(folder, run_dir, *common(out_root, tag), *extra)
        out = run_train(args, env=env)
    else:
        out = run_torchrun(folder, tmp_path, *common(out_root, tag), *extra, nproc=world,
                           env=env)  # fmt: skip
        run_dir = next((out_root / tag).iterdir())
    return out, recorded(record), run_dir


def fresh_order(epoch: int, world: int, rank: int) -> list[int]:
    """What a fresh run at `world` ranks trains on `rank` in `epoch` (torch's own sampler)."""
    sampler = DistributedSampler(range(N_TRAIN), num_replicas=world, rank=rank, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


def pixel_hashes(folder, tmp_path) -> dict[tuple[int, int], str]:
    """(epoch, index) -> the hash of its training sample as the task's dataset builds it, in
    this process: what any uninterrupted run trains on (the same hash as `recorded`)."""
    import xxhash

    from fastload.pipeline import build_plan

    cfg = compose_config(tiny_overrides(folder, tmp_path / "probe", *common(tmp_path, "probe")))
    plan = build_plan(cfg)
    dataset = plan.task.dataset("train", plan.reader("train"), plan.backend)
    keys = [(e, i) for e in (0, 1) for i in range(N_TRAIN)]
    images = [s[0] for s in dataset.__getitems__(keys)]
    return {k: xxhash.xxh64(x.contiguous().numpy().tobytes()).hexdigest()
            for k, x in zip(keys, images, strict=True)}  # fmt: skip


def stopped_on_two_then_resumed(world: int, folder, tmp_path) -> None:
    """Two ranks stopped mid-epoch (SIGTERM), resumed on `world`: every sample of the
    interrupted epoch exactly once with its own augmentation, then a fresh run's epoch."""
    draws = pixel_hashes(folder, tmp_path)  # every (epoch, index)'s augmentation

    # SIGTERM on both ranks during step 8; DDP ranks agree to stop at step 10 of 12
    stopped, before, stopped_dir = launch(2, folder, tmp_path, "stopped",
                                          env={"SIGTERM_AFTER_READS": "30"})  # fmt: skip
    text = stopped.stdout + stopped.stderr
    assert stopped.returncode != 0 and "resume=auto" in text, text[-3000:]
    checkpoint = stopped_dir / "checkpoints" / "last.pt"
    state = torch.load(checkpoint, weights_only=True)
    assert (state["epoch"], state["step_in_epoch"], state["world_size"]) == (0, 10, 2)
    for r in (0, 1):
        assert [i for _, i, _ in before[r]] == fresh_order(0, 2, r)[: 10 * BATCH]
    # the stop: rank 0 says it, once
    assert (stopped_dir / "train.log").read_text().count("stopped by SIGTERM") == 1

    out, after, run_dir = launch(world, folder, tmp_path, f"on{world}", f"resume={checkpoint}")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "written by 2 rank(s)" in text and "it goes on with the samples" in text, text
    # the interrupted epoch: every index exactly once, with the draw it always has
    epoch0 = [(i, h) for rows in (*before.values(), *after.values())
              for e, i, h in rows if e == 0]  # fmt: skip
    assert sorted(i for i, _ in epoch0) == list(range(N_TRAIN))
    assert all(draws[(0, i)] == h for i, h in epoch0)
    # 16 samples left: 4 steps of 4 on 1 rank; on 3, 4 + 3 + 3 then 2 + 2 + 2
    left = [len([1 for e, _, _ in after[r] if e == 0]) for r in range(world)]
    assert left == ([16] if world == 1 else [6, 5, 5]), left
    # the next epoch: exactly a fresh run's at the new world size
    for r in range(world):
        epoch1 = [(i, h) for e, i, h in after[r] if e == 1]
        assert [i for i, _ in epoch1] == fresh_order(1, world, r)
        assert all(draws[(1, i)] == h for i, h in epoch1)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["world_size"]) for r in rows] == [(0, world), (1, world)]
    # the continued epoch says so (its plan starts at 0 here), so time / epoch leaves it out
    assert [r.get("resumed_at_step") for r in rows] == [0, None]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epoch_time_s_mean"] == rows[1]["epoch_time_s"]
    # one log: rank 0's, each line once (every rank appended to it, each line W times)
    log = (run_dir / "train.log").read_text()
    assert log.count("written by 2 rank(s)") == log.count("resumed from") == 1, log
    assert not list(run_dir.glob("train.rank*.log"))  # no rank warned


def test_two_ranks_stopped_mid_epoch_resume_on_one(folder, tmp_path):
    stopped_on_two_then_resumed(1, folder, tmp_path)


@pytest.mark.slow  # 3 ranks on the CPU cores of a test machine; on one is in the default suite
def test_two_ranks_stopped_mid_epoch_resume_on_three(folder, tmp_path):
    stopped_on_two_then_resumed(3, folder, tmp_path)


@pytest.mark.slow  # 1 -> 2 on storage=webdataset is in the default suite (test_webdataset.py)
def test_one_rank_stopped_mid_epoch_resumes_on_two(folder, tmp_path):
    stopped, before, stopped_dir = launch(1, folder, tmp_path, "stopped",
                                          env={"SIGTERM_AFTER_READS": "18"})  # fmt: skip
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    checkpoint = stopped_dir / "checkpoints" / "last.pt"
    state = torch.load(checkpoint, weights_only=True)
    assert (state["epoch"], state["step_in_epoch"], state["world_size"]) == (0, 5, 1)
    out, after, _ = launch(2, folder, tmp_path, "on2", f"resume={checkpoint}")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    epoch0 = [i for rows in (*before.values(), *after.values()) for e, i, _ in rows if e == 0]
    assert sorted(epoch0) == list(range(N_TRAIN))
    # 76 left on 2 ranks: 9 full steps of 2 x 4, then two samples each
    assert [len([1 for e, _, _ in after[r] if e == 0]) for r in (0, 1)] == [38, 38]
    for r in (0, 1):
        assert [i for e, i, _ in after[r] if e == 1] == fresh_order(1, 2, r)


def test_a_sigkilled_rank_restarts_under_torchrun_from_the_step_checkpoint(folder, tmp_path):
    """torchrun --max-restarts=1: rank 1 SIGKILLed during step 7 (no checkpoint of its own);
    the group restarts from the step-4 checkpoint and ends with the uninterrupted weights.
    The model draws dropout masks from each rank's RNG: each rank gets its own stream back."""
    out_root = tmp_path / "out"
    same = [f"output_root={out_root}", f"trainer.batch_size={BATCH}", "trainer.epochs=1",
            "storage._target_=tests.helpers.SigkillAfterReads",
            "model._target_=tests.helpers.build_dropout_resnet"]  # fmt: skip
    ref = run_torchrun(folder, tmp_path, *same, "name=ref")
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-3000:]
    out = run_torchrun(
        folder, tmp_path, *same, "name=killed", "resume=auto", "trainer.checkpoint_every_steps=4",
        env={"SIGKILL_AFTER_READS": str(6 * BATCH + 2), "SIGKILL_RANK": "1"},
        launcher=("--max-restarts=1",),
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "exitcode: -9" in text, text[-3000:]  # rank 1 did die of SIGKILL
    assert "rank 0 lost another rank of the run" in text and "Traceback" not in text, text
    assert "resumed from" in text and "at epoch 0 step 4" in text, text[-3000:]
    (run_dir,) = list((out_root / "killed").iterdir())  # the restart continued in its folder
    (ref_dir,) = list((out_root / "ref").iterdir())
    a = torch.load(ref_dir / "checkpoints" / "last.pt", weights_only=True)
    b = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert (b["epoch"], b["step_in_epoch"]) == (1, 0)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0]


def stopped_after_30_steps(tmp_path):
    """(the config, a 4-rank TrainState of batches of 8 stopped at epoch 0 step 30)."""
    from fastload.train_state import TrainState

    cfg = compose_config(tiny_overrides(tmp_path, tmp_path / "run", "trainer.batch_size=8"))
    old = TrainState.create(cfg, torch.device("cpu"), 4, 100, amp=None, channels_last=False)
    for _ in range(30):
        old.optimizer.step()
        old.scheduler.step()
    old.epoch, old.step = 0, 30
    return cfg, old


def test_the_learning_rate_follows_the_global_batch_and_the_schedule_the_samples(tmp_path):
    from fastload.train_state import TrainState

    cfg, old = stopped_after_30_steps(tmp_path)
    new = TrainState.create(cfg, torch.device("cpu"), 2, 200, amp=None, channels_last=False)
    new.load_state_dict(old.state_dict(), tmp_path / "last.pt")
    assert (new.epoch, new.step, new.stretches) == (0, 0, [(4, 30)])
    assert new.scheduler.last_epoch == 60  # 30 steps of 32 samples = 60 steps of 16
    base = cfg.optim.base_lr * 8 * 2 / 256  # the rule a fresh 2-rank run starts with
    assert new.scheduler.base_lrs == pytest.approx([base] * len(new.scheduler.base_lrs))
    fresh = TrainState.create(cfg, torch.device("cpu"), 2, 200, amp=None, channels_last=False)
    for _ in range(60):
        fresh.optimizer.step()
        fresh.scheduler.step()
    lrs = [g["lr"] for g in new.optimizer.param_groups]
    assert lrs == pytest.approx([g["lr"] for g in fresh.optimizer.param_groups])
    new.optimizer.step()
    new.scheduler.step()  # and it goes on from there as the fresh run does
    fresh.optimizer.step()
    fresh.scheduler.step()
    lrs = [g["lr"] for g in new.optimizer.param_groups]
    assert lrs == pytest.approx([g["lr"] for g in fresh.optimizer.param_groups])
    assert new.state_dict()["world_size"] == 2


def test_grad_accum_steps_keeps_the_global_batch_on_fewer_ranks_or_the_log_says_it(
    tmp_path, caplog
):
    from fastload.train_state import TrainState

    cfg, old = stopped_after_30_steps(tmp_path)
    saved = old.state_dict()
    lr = [g["lr"] for g in old.optimizer.param_groups]

    # 4 ranks -> 2 ranks x 2 accumulation steps: the same global batch (32), LR and update
    kept_cfg = compose_config(tiny_overrides(tmp_path, tmp_path / "run", "trainer.batch_size=8",
                                             "trainer.grad_accum_steps=2"))  # fmt: skip
    kept = TrainState.create(kept_cfg, torch.device("cpu"), 2, 200, amp=None, channels_last=False)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        kept.load_state_dict(saved, tmp_path / "last.pt")
    assert (kept.epoch, kept.step, kept.stretches) == (0, 0, [(4, 30)])
    assert kept.scheduler.last_epoch == 30
    assert [g["lr"] for g in kept.optimizer.param_groups] == lr
    assert "global batch stays 32" in caplog.text
    assert kept.state_dict()["grad_accum_steps"] == 2

    # 4 ranks -> 2 ranks without accumulation: half the global batch; the log says how to keep it
    caplog.clear()
    half = TrainState.create(cfg, torch.device("cpu"), 2, 200, amp=None, channels_last=False)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        half.load_state_dict(saved, tmp_path / "last.pt")
    assert half.scheduler.last_epoch == 60
    assert "from 32" in caplog.text and "trainer.grad_accum_steps=2 would keep it" in caplog.text

    # the same 4 ranks with grad_accum_steps=2: the epoch goes on at its step (same order),
    # the LR doubles with the global batch and the schedule is at the same samples seen
    same = TrainState.create(kept_cfg, torch.device("cpu"), 4, 100, amp=None, channels_last=False)
    same.load_state_dict(saved, tmp_path / "last.pt")
    assert (same.step, same.stretches, same.scheduler.last_epoch) == (30, [], 15)
    assert same.scheduler.base_lrs == pytest.approx([2 * b for b in old.scheduler.base_lrs])


def test_a_resume_on_fewer_ranks_goes_on_at_the_same_point_of_the_schedule(tmp_path):
    """1000 images in batches of 64: 7 steps a rank on 2 ranks, 15 on 1, so 8 updates of
    2 x 64 an epoch with grad_accum_steps=2 (the same global batch). Mapped by samples, the
    resume after 3 of 6 epochs began at update 21 of 48 and ended at 45, its LR 12x the
    schedule's last."""
    from fastload.train_state import TrainState

    def state(world, steps, *extra):
        cfg = compose_config(tiny_overrides(tmp_path, tmp_path / "run", "trainer.batch_size=64",
                                            "trainer.epochs=6", *extra))  # fmt: skip
        return TrainState.create(cfg, torch.device("cpu"), world, steps, amp=None,
                                 channels_last=False)  # fmt: skip

    def lrs(s, updates):
        out = []
        for _ in range(updates):
            out.append(s.optimizer.param_groups[0]["lr"])
            s.optimizer.step()
            s.scheduler.step()
        return out

    old = state(2, 7)
    lrs(old, 3 * 7)
    old.epoch, old.step = 3, 0
    saved = old.state_dict()
    new = state(1, 15, "trainer.grad_accum_steps=2")
    new.load_state_dict(saved, tmp_path / "last.pt")
    assert new.scheduler.last_epoch == 3 * 8
    fresh = state(1, 15, "trainer.grad_accum_steps=2")  # its epochs 3..5 are the resumed run's
    assert lrs(new, 3 * 8) == pytest.approx(lrs(fresh, 6 * 8)[3 * 8 :])
    del saved["updates_per_epoch"]  # a checkpoint that predates it: mapped by samples seen
    older = state(1, 15, "trainer.grad_accum_steps=2")
    older.load_state_dict(saved, tmp_path / "last.pt")
    assert older.scheduler.last_epoch == 21
