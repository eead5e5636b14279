"""trainer.ema: the moving average of the weights (fastload/ema.py), updated once per optimizer
update, evaluated beside the model, kept in the checkpoint (its bit-for-bit resume:
tests/test_train.py's SIGTERM test), and the same on every DDP rank."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as torch_dist
from conftest import compose_config, run_gloo_ranks, tiny_overrides
from test_grad_accum import batches, train

from fastload import checkpoint as ckpt
from fastload.dist import DistContext
from fastload.ema import ModelEma
from fastload.engine import check_trainer
from fastload.errors import ConfigError
from fastload.tasks.classification import ClassificationStep
from fastload.train_state import TrainState


def bn_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 3),
    )


def snapshot(model: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def moved(model: torch.nn.Module, by: float) -> None:
    """Every floating tensor of the model plus `by`, its integer buffers plus 5."""
    with torch.no_grad():
        for value in model.state_dict().values():
            value.add_(by if value.is_floating_point() else 5)


def test_each_update_keeps_decay_of_the_average_and_copies_integer_buffers():
    model = bn_net()
    ema = ModelEma(model, decay=0.9, warmup=False)
    start = snapshot(model)
    moved(model, 1.0)
    ema.update(model)
    now = snapshot(model)
    for k, v in ema.model.state_dict().items():
        if v.is_floating_point():
            torch.testing.assert_close(v, 0.9 * start[k] + 0.1 * now[k], msg=k)
        else:  # BatchNorm's num_batches_tracked: the model's, not an average
            assert torch.equal(v, now[k]), k
    assert ema.updates == 1
    assert not any(p.requires_grad for p in ema.model.parameters()) and not ema.model.training
    assert model.training  # the trained model is left as it was


def test_every_n_updates_it_moves_by_decay_to_the_n():
    model = bn_net()
    ema = ModelEma(model, decay=0.9, every=3, warmup=False)
    start = snapshot(model)
    moved(model, 1.0)
    ema.update(model)
    ema.update(model)
    for k, v in ema.model.state_dict().items():  # not yet
        assert torch.equal(v, start[k]), k
    ema.update(model)
    weight = 0.9**3  # the span of three updates of 0.9, in one
    for k, v in ema.model.state_dict().items():
        if v.is_floating_point():
            expected = weight * start[k] + (1 - weight) * snapshot(model)[k]
            torch.testing.assert_close(v, expected, msg=k)


def test_the_warmup_follows_the_model_first_and_reaches_decay_later():
    model = bn_net()
    ema = ModelEma(model, decay=0.999, warmup=True)
    assert ema.decay_at(0) == 0.0  # the first update is a copy
    assert ema.decay_at(99) == pytest.approx(1 - 100 ** (-2 / 3))  # 0.954
    assert ema.decay_at(10**6) == 0.999  # capped at trainer.ema.decay
    moved(model, 1.0)
    ema.update(model)
    for k, v in snapshot(model).items():
        torch.testing.assert_close(ema.model.state_dict()[k], v, msg=k)


def test_the_step_updates_the_ema_once_per_optimizer_update(tmp_path):
    # 7 batches, grad_accum_steps=3: updates after 3, 6 and 7 -> three EMA updates
    overrides = ["trainer.grad_accum_steps=3", "trainer.ema.decay=0.5", "trainer.ema.warmup=false"]
    cfg = compose_config(tiny_overrides(tmp_path, tmp_path / "run", *overrides))
    state = TrainState.create(cfg, torch.device("cpu"), 1, 7, amp=None, channels_last=False,
                              model=bn_net())  # fmt: skip
    start = snapshot(state.ema.model)
    train(ClassificationStep(state, cfg, DistContext(), None), batches(7, 4))
    assert state.ema.updates == state.scheduler.last_epoch == 3
    ema, model = snapshot(state.ema.model), snapshot(state.model)
    weight = next(k for k, v in ema.items() if v.is_floating_point())
    assert not torch.equal(ema[weight], start[weight]) and not torch.equal(
        ema[weight], model[weight]
    )
    # off by default: no EMA, no copy of the model
    plain = compose_config(tiny_overrides(tmp_path, tmp_path / "run"))
    assert TrainState.create(plain, torch.device("cpu"), 1, 7, amp=None, channels_last=False,
                             model=bn_net()).ema is None  # fmt: skip


def test_the_checkpoint_holds_the_ema_and_gives_it_back(tmp_path):
    cfg = compose_config(tiny_overrides(tmp_path, tmp_path / "run", "trainer.ema.decay=0.5"))
    state = TrainState.create(cfg, torch.device("cpu"), 1, 4, amp=None, channels_last=False,
                              model=bn_net())  # fmt: skip
    train(ClassificationStep(state, cfg, DistContext(), None), batches(4, 4))
    state.best_ema_metric = 42.0
    saved = state.state_dict()
    other = TrainState.create(cfg, torch.device("cpu"), 1, 4, amp=None, channels_last=False,
                              model=bn_net())  # fmt: skip
    other.load_state_dict(saved, "last.pt")
    assert other.ema.updates == 4 and other.best_ema_metric == 42.0
    for k, v in state.ema.model.state_dict().items():
        assert torch.equal(other.ema.model.state_dict()[k], v), k


@pytest.mark.parametrize(
    "override, option",
    [
        ("trainer.ema.decay=1.0", "trainer.ema.decay=1.0"),
        ("trainer.ema.decay=0", "trainer.ema.decay=0"),
        ("trainer.ema.decay=nan", "trainer.ema.decay=nan"),
        ("trainer.ema.decay=true", "trainer.ema.decay=True"),
        ("trainer.ema.every=0", "trainer.ema.every=0"),
        ("trainer.ema.every=2.5", "trainer.ema.every=2.5"),
        ("trainer.ema.warmup=sometimes", "trainer.ema.warmup='sometimes'"),
    ],
)
def test_bad_ema_settings_are_refused_naming_the_option(tmp_path, override, option):
    cfg = compose_config(tiny_overrides(tmp_path, tmp_path / "run", override))
    with pytest.raises(ConfigError) as err:
        check_trainer(cfg)
    assert option in err.value.user_message


def test_ema_settings_shape_the_run_only_while_it_is_on():
    old = {"optim.base_lr": 0.2}  # written before trainer.ema existed
    off = {"optim.base_lr": 0.2, "trainer.ema.decay": None, "trainer.ema.every": 1,
           "trainer.ema.warmup": True}  # fmt: skip
    assert ckpt.config_differences(old, off) == []
    assert ckpt.config_differences(off, {**off, "trainer.ema.every": 4}) == []
    on = {**off, "trainer.ema.decay": 0.999}
    assert ckpt.config_differences(old, on) == [
        "trainer.ema.decay: '(unset)' -> 0.999",
        "trainer.ema.every: '(unset)' -> 1",
        "trainer.ema.warmup: '(unset)' -> True",
    ]
    assert ckpt.config_differences(on, {**on, "trainer.ema.every": 4}) == [
        "trainer.ema.every: 1 -> 4"
    ]


def _ddp_rank(rank: int, world: int, init: str, tmp_path, out) -> None:
    torch_dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                  timeout=datetime.timedelta(seconds=60))  # fmt: skip
    try:
        ctx = DistContext(rank=rank, world_size=world)
        cfg = compose_config(tiny_overrides(tmp_path, tmp_path / "run", "trainer.ema.decay=0.5"))
        state = TrainState.create(cfg, ctx.device, world, 4, amp=None, channels_last=False,
                                  model=bn_net())  # fmt: skip
        train(ClassificationStep(state, cfg, ctx, None), batches(4, 4, seed=10 + rank))
        before = snapshot(state.ema.model)
        state.ema.sync(ctx)
        after = snapshot(state.ema.model)
        out.put((rank, {k: v.tolist() for k, v in before.items()},
                 {k: v.tolist() for k, v in after.items()}))  # fmt: skip
    finally:
        torch_dist.destroy_process_group()


def test_under_ddp_every_rank_evaluates_rank_0s_ema(tmp_path):
    results = {rank: (before, after) for rank, before, after in run_gloo_ranks(_ddp_rank, tmp_path)}
    (before0, after0), (before1, after1) = results[0], results[1]
    stats = "1.running_mean"  # BatchNorm's statistics: each rank's own batches
    assert before0[stats] != before1[stats]
    assert after1 == after0 == before0  # rank 0's, on both
    weight = "0.weight"  # the parameters: the same on every rank already (DDP)
    assert before0[weight] == before1[weight]
