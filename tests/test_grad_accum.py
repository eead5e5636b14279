"""trainer.grad_accum_steps: A batches per optimizer update, as one batch of all of them would
make it, all-reduced once per update under DDP, stopped and checkpointed only between updates
(keeping the global batch on a resume at another world size: tests/test_elastic.py); and under
DDP a rank whose whole batch was skipped as corrupt still joins the step."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
from conftest import (
    compose_config,
    make_image_folder,
    run_gloo_ranks,
    run_torchrun,
    run_train,
    tiny_overrides,
)

from fastload.dist import DistContext
from fastload.tasks.classification import ClassificationStep
from fastload.train_state import TrainState


def norm_free_net() -> torch.nn.Module:
    """A small classifier without BatchNorm, whose update does not depend on how the samples
    are split into batches (BatchNorm normalises each batch by its own statistics)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 3),
    )


def batches(n: int, size: int, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"image": torch.randn(size, 3, 16, 16, generator=g),
         "target": torch.randint(0, 3, (size,), generator=g)}
        for _ in range(n)
    ]  # fmt: skip


def joined(parts: list[dict]) -> dict:
    return {k: torch.cat([p[k] for p in parts]) for k in ("image", "target")}


def make_step(tmp_path, accum: int, batch_size: int, steps_per_epoch: int, ctx=None):
    cfg = compose_config(tiny_overrides(tmp_path, tmp_path / "run", f"trainer.batch_size={batch_size}",
                                        f"trainer.grad_accum_steps={accum}"))  # fmt: skip
    ctx = ctx or DistContext()
    state = TrainState.create(cfg, ctx.device, ctx.world_size, steps_per_epoch, amp=None,
                              channels_last=False, model=norm_free_net())  # fmt: skip
    return state, ClassificationStep(state, cfg, ctx, None)


def train(step, data: list[dict]) -> list[bool]:
    """Every batch through the step as the engine's loop does; `settled` after each."""
    step.train_mode()
    step.begin(len(data))
    settled = []
    for batch in data:
        step.train(batch)
        step.after_step()
        settled.append(step.settled)
    step.finish()
    return settled


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)


def test_groups_of_batches_update_as_one_batch_of_them_would(tmp_path):
    # 7 batches of 4 with grad_accum_steps=3: updates after 3, 6 and 7 (the epoch's last group
    # is one batch). The same samples as batches of 12, 12 and 4 with no accumulation: the
    # same global batch (12), so the same LR and schedule, and the same weights after.
    data = batches(7, 4)
    state, step = make_step(tmp_path, 3, 4, steps_per_epoch=7)
    ref_state, ref_step = make_step(tmp_path, 1, 12, steps_per_epoch=3)
    assert ref_state.optimizer.param_groups[0]["lr"] == state.optimizer.param_groups[0]["lr"]
    settled = train(step, data)
    assert settled == [False, False, True, False, False, True, True]
    train(ref_step, [joined(data[0:3]), joined(data[3:6]), data[6]])
    assert state.scheduler.last_epoch == ref_state.scheduler.last_epoch == 3
    same_weights(state.model, ref_state.model)
    # a different split really gives different weights: the check above can fail
    other_state, other_step = make_step(tmp_path, 1, 12, steps_per_epoch=3)
    train(other_step, [joined(data[0:2]), joined(data[2:6]), data[6]])
    with pytest.raises(AssertionError):
        same_weights(state.model, other_state.model)


def test_optim_clip_grad_norm_caps_the_norm_of_each_update_s_gradients(tmp_path):
    def norm_at_update(clip) -> float:
        cfg = compose_config(tiny_overrides(tmp_path, tmp_path / "run", "trainer.grad_accum_steps=2",
                                            f"optim.clip_grad_norm={clip}"))  # fmt: skip
        state = TrainState.create(cfg, torch.device("cpu"), 1, 2, amp=None, channels_last=False,
                                  model=norm_free_net())  # fmt: skip
        seen = []
        state.optimizer.register_step_pre_hook(
            lambda opt, *_: seen.append(float(torch.nn.utils.get_total_norm(
                [p.grad for g in opt.param_groups for p in g["params"]]))))  # fmt: skip
        train(ClassificationStep(state, cfg, DistContext(), None), batches(2, 4))
        (norm,) = seen  # one update for the group of two
        return norm

    free = norm_at_update("null")
    assert free > 0.05  # so that the cap below cuts it
    assert norm_at_update(0.05) == pytest.approx(0.05, rel=1e-4)
    assert norm_at_update(10 * free) == pytest.approx(free, rel=1e-6)  # under the cap: as is


def test_no_gradient_is_left_behind_when_the_data_ends_inside_a_group(tmp_path):
    data = batches(5, 4)
    state, step = make_step(tmp_path, 4, 4, steps_per_epoch=5)
    step.begin(8)  # planned 8 batches, the loader gave 5
    for batch in data:
        step.train(batch)
        step.after_step()
    assert not step.settled
    step.finish()
    assert step.settled and state.scheduler.last_epoch == 2
    assert all(p.grad is None for p in state.model.parameters())


def test_the_step_timings_of_the_doctor_and_loader_auto_include_the_update(tmp_path):
    from fastload.measure import feed, step_times

    state, step = make_step(tmp_path, 1, 4, steps_per_epoch=8)
    before = [p.detach().clone() for p in state.model.parameters()]
    step_times(step, batches(1, 4)[0], steps=2, warmup=1, sync=lambda: None)
    assert state.scheduler.last_epoch == 3  # three updates, not three backwards
    assert not all(torch.equal(a, b) for a, b in zip(before, state.model.parameters(), strict=True))
    feed(batches(4, 4), step, warmup=1, sync=lambda: None)
    assert state.scheduler.last_epoch == 7


def _ddp_rank(rank: int, world: int, init: str, tmp_path, out) -> None:
    torch_dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                  timeout=datetime.timedelta(seconds=60))  # fmt: skip
    try:
        ctx = DistContext(rank=rank, world_size=world)
        rounds = {}
        for accum in (1, 2):
            state, step = make_step(tmp_path / str(accum), accum, 4, steps_per_epoch=4, ctx=ctx)
            calls = [0]

            def counting(_, bucket, calls=calls):
                calls[0] += 1
                fut = torch_dist.all_reduce(bucket.buffer(), async_op=True).get_future()
                return fut.then(lambda f: f.value()[0] / world)

            step.model.register_comm_hook(None, counting)
            train(step, batches(4, 4, seed=10 + rank))  # each rank its own samples
            rounds[accum] = calls[0]
            flat = torch.cat([p.detach().flatten() for p in state.model.parameters()])
            out.put((rank, accum, rounds[accum], flat.tolist()))  # no tensor: the child exits
        # rank 0's second batch was all corrupt: it joins the group's all-reduce (and DDP's
        # buffer broadcast) with a zero-weight pass, and the ranks stay equal
        state, step = make_step(tmp_path / "empty", 2, 4, steps_per_epoch=4, ctx=ctx)
        step.train_mode()
        step.begin(4)
        for i, batch in enumerate(batches(4, 4, seed=20 + rank)):
            step.train_empty() if (rank, i) == (0, 1) else step.train(batch)
            step.after_step()
        flat = torch.cat([p.detach().flatten() for p in state.model.parameters()])
        out.put((rank, "empty", step.state.scheduler.last_epoch, flat.tolist()))
        # rank 1's first batch was all corrupt: no batch to take two samples from yet, so it
        # trains on the loader's spare ones (spare_batch) at weight 0, and nothing waits
        state, step = make_step(tmp_path / "first", 1, 4, steps_per_epoch=3, ctx=ctx)
        step.train_mode()
        step.begin(3)
        for i, batch in enumerate(batches(3, 4, seed=30 + rank)):
            if (rank, i) == (1, 0):
                step.train_empty(["a.jpg"], spare=lambda: batches(1, 4, seed=99)[0])
            else:
                step.train(batch)
            step.after_step()
        flat = torch.cat([p.detach().flatten() for p in state.model.parameters()])
        out.put((rank, "first", step.state.scheduler.last_epoch, flat.tolist()))
    finally:
        torch_dist.destroy_process_group()


def test_ddp_all_reduces_once_per_group_and_ranks_stay_equal(tmp_path):
    """Also with a rank whose batch held no decodable sample: a zero-weight pass on two
    samples of its first batch, or before it has one, on the loader's spare ones."""
    world = 2
    results = run_gloo_ranks(_ddp_rank, tmp_path, world, messages=4)
    by = {(rank, accum): (calls, torch.tensor(flat)) for rank, accum, calls, flat in results}
    # 4 batches: 4 all-reduce rounds without accumulation, 2 with groups of 2 (no_sync)
    assert by[0, 1][0] == by[1, 1][0] == 2 * by[0, 2][0] == 2 * by[1, 2][0]
    assert by[0, 2][0] >= 2
    torch.testing.assert_close(by[0, 2][1], by[1, 2][1], rtol=0, atol=0)  # in sync
    assert by[0, "empty"][0] == by[1, "empty"][0] == 2
    torch.testing.assert_close(by[0, "empty"][1], by[1, "empty"][1], rtol=0, atol=0)
    assert by[0, "first"][0] == by[1, "first"][0] == 3
    torch.testing.assert_close(by[0, "first"][1], by[1, "first"][1], rtol=0, atol=0)
    # and the update is the one the same samples make on one process in batches of 16
    state, step = make_step(tmp_path / "one", 1, 16, steps_per_epoch=2)  # the same schedule
    per_rank = [batches(4, 4, seed=10 + r) for r in range(world)]
    groups = [joined(per_rank[0][g : g + 2] + per_rank[1][g : g + 2]) for g in (0, 2)]
    train(step, groups)
    flat = torch.cat([p.detach().flatten() for p in state.model.parameters()])
    torch.testing.assert_close(by[0, 2][1], flat, rtol=1e-5, atol=1e-6)


def test_a_preemption_inside_a_group_stops_at_its_end_and_resumes_bit_for_bit(
    tiny_folder, tmp_path
):
    # 18 images, batches of 4: 4 steps per epoch, groups of 3 and 1. SIGTERM during step 1
    # (5th read): the run trains on to the group's end and stops at step 3, not 2.
    common = ["trainer.epochs=2", "trainer.grad_accum_steps=3",
              "storage._target_=tests.helpers.SigtermAfterReads"]  # fmt: skip
    ref_dir = tmp_path / "out" / "ref" / "r"
    ref = run_train(tiny_overrides(tiny_folder, ref_dir, *common, "name=ref"))
    assert ref.returncode == 0, ref.stderr
    a = torch.load(ref_dir / "checkpoints" / "last.pt", weights_only=True)
    assert a["scheduler"]["last_epoch"] == 4 and a["grad_accum_steps"] == 3  # 2 updates/epoch

    killed_dir = tmp_path / "out" / "b" / "r1"
    killed = run_train(tiny_overrides(tiny_folder, killed_dir, *common, "name=b"),
                       env={"SIGTERM_AFTER_READS": "5"})  # fmt: skip
    assert killed.returncode == 143, killed.stderr
    state = torch.load(killed_dir / "checkpoints" / "last.pt", weights_only=True)
    assert (state["epoch"], state["step_in_epoch"]) == (0, 3)
    assert state["scheduler"]["last_epoch"] == 1

    resumed_dir = tmp_path / "out" / "b" / "r2"
    resumed = run_train(tiny_overrides(tiny_folder, resumed_dir, *common, "name=b", "resume=auto"))
    assert resumed.returncode == 0, resumed.stderr
    b = torch.load(resumed_dir / "checkpoints" / "last.pt", weights_only=True)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_a_rank_whose_whole_batch_is_corrupt_keeps_step_with_the_other_rank(tmp_path):
    # Two ranks, batches of 2, groups of 2: both files of rank 0's step 1 (the group's closing
    # batch, whose backward all-reduces) are corrupt. Rank 0 still joins the step's
    # collectives; without that, rank 1 waits in its all-reduce until the group's timeout.
    from torch.utils.data import DistributedSampler

    from fastload.data.sources import ImageFolderSource

    root = make_image_folder(tmp_path / "d")  # 18 training images
    order = DistributedSampler(range(18), num_replicas=2, rank=0, seed=0)
    order.set_epoch(0)
    source = ImageFolderSource(root / "train")
    bad = [Path(source.path(i)) for i in list(order)[2:4]]
    for path in bad:
        path.write_bytes(b"\xff\xd8 truncated")
    out_root = tmp_path / "out"
    out = run_torchrun(root, tmp_path, f"output_root={out_root}", "name=skip", "trainer.epochs=1",
                       "trainer.batch_size=2", "trainer.grad_accum_steps=2",
                       "dataset.skip_corrupt=true", "dataset.max_skipped_share=0.5",
                       timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run_dir,) = (out_root / "skip").iterdir()
    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert row["world_size"] == 2 and row["skipped_corrupt"] == 2
    listing = (run_dir / "skipped_files.txt").read_text()
    assert all(str(path) in listing for path in bad), listing


def test_label_smoothing_null_trains_without_smoothing(tmp_path):
    """check_options lets optim.label_smoothing=null through (off, as clip_grad_norm=null);
    the criterion took None and the first step failed with a TypeError."""
    cfg = compose_config(tiny_overrides(tmp_path, tmp_path / "run", "optim.label_smoothing=null"))
    state = TrainState.create(cfg, torch.device("cpu"), 1, 2, amp=None, channels_last=False,
                              model=norm_free_net())  # fmt: skip
    step = ClassificationStep(state, cfg, DistContext(), None)
    assert step.criterion.label_smoothing == 0.0
    train(step, batches(1, 4))


def test_validation_loss_is_plain_cross_entropy_whatever_the_smoothing(tmp_path):
    """Training minimises the smoothed loss; val_loss is plain cross-entropy (timm's), so it
    does not move with optim.label_smoothing."""
    cfg = compose_config(tiny_overrides(tmp_path, tmp_path / "run", "optim.label_smoothing=0.3"))
    state = TrainState.create(cfg, torch.device("cpu"), 1, 2, amp=None, channels_last=False,
                              model=norm_free_net())  # fmt: skip
    step = ClassificationStep(state, cfg, DistContext(), None)
    assert step.criterion.label_smoothing == 0.3
    (batch,) = batches(1, 4)
    loss_sum, _, _, n = step.eval_sums(state.model, batch).tolist()
    with torch.no_grad():
        out = state.model(batch["image"]).float()
    plain = torch.nn.functional.cross_entropy(out, batch["target"]).item()
    assert loss_sum / n == pytest.approx(plain, rel=1e-5)
    assert loss_sum / n != pytest.approx(step.criterion(out, batch["target"]).item(), rel=1e-3)
