"""checkpoints/best.pt and best_ema.pt: the weights of the best evaluation, written as it
happens (tests/test_train.py: a run's and a resumed run's), carried over to a resumed run's
folder, and refused as a state to resume."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import compose_config, make_image_folder, run_torchrun, run_train, tiny_overrides
from omegaconf import open_dict

from fastload import checkpoint as ckpt
from fastload.dist import DistContext
from fastload.engine import RunRecord, evaluate_only, find_resume
from fastload.errors import CheckpointError, FastloadError
from fastload.tasks.base import build_task


def weights_file(path, epoch: int, value: float, of: str = "model", run: dict | None = None):
    model = torch.nn.Linear(2, 3)
    ckpt.save_atomic(ckpt.weights_payload(model, of, epoch, "val_acc1", value, run or {}), path)
    return model


def test_a_best_weights_file_is_refused_as_a_state_to_resume(tmp_path):
    best = tmp_path / "run" / "checkpoints" / ckpt.BEST
    weights_file(best, 1, 50.0)
    cfg = compose_config(tiny_overrides(tmp_path, tmp_path / "new", f"resume={best}"))
    with pytest.raises(CheckpointError) as err:
        find_resume(cfg)
    message = err.value.user_message
    assert str(best) in message and f"resume={best.with_name(ckpt.LAST)}" in message
    assert "torch.load(path, weights_only=True)['model']" in message
    with pytest.raises(CheckpointError, match="check the evaluate= path"):
        ckpt.load(tmp_path / "missing.pt", option="evaluate")


def test_evaluate_takes_state_dicts_saved_elsewhere_and_names_what_it_cannot_use(tmp_path):
    weights = {"fc.weight": torch.ones(3, 2), "fc.bias": torch.zeros(3)}
    ddp = {f"module.{k}": v for k, v in weights.items()}
    for name, saved in (("plain.pth", weights), ("timm.pth", {"state_dict": weights}),
                        ("ddp.pth", {"model": ddp})):  # fmt: skip
        torch.save(saved, tmp_path / name)
        got = ckpt.load_weights(tmp_path / name)["model"]
        assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in got)
    torch.save({"epoch": 3, "notes": "no tensors"}, tmp_path / "junk.pth")
    with pytest.raises(CheckpointError) as err:
        ckpt.load_weights(tmp_path / "junk.pth")
    assert str(tmp_path / "junk.pth") in err.value.user_message
    assert "torch.save(model.state_dict(), path)" in err.value.user_message


@pytest.mark.parametrize("kept", [True, False])
def test_a_resumed_run_carries_the_best_weights_its_history_holds(tmp_path, kept):
    old = tmp_path / "out" / "exp" / "r1" / "checkpoints"
    model = weights_file(old / ckpt.BEST, 0, 50.0)
    weights_file(old / ckpt.BEST_EMA, 1, 61.0, of="ema")
    run_dir = tmp_path / "out" / "exp" / "r2"
    cfg = compose_config(tiny_overrides(tmp_path, run_dir, f"trainer.keep_best={kept}"), run_dir)
    with open_dict(cfg):
        del cfg["hydra"]  # as train.py's run sees it
    record = RunRecord(cfg, DistContext(), run_dir, [], build_task(cfg))
    # best.pt's evaluation is in the history; best_ema.pt's is not (an attempt that ended
    # after evaluating epoch 1, before its checkpoint)
    history = [{"epoch": 0, "val_acc1": 50.0, "ema_val_acc1": 40.0},
               {"epoch": 1, "val_acc1": 45.0, "ema_val_acc1": 60.0}]  # fmt: skip
    record.carry_best(old / ckpt.LAST, history)
    carried = run_dir / "checkpoints" / ckpt.BEST
    assert carried.is_file() == kept
    assert not (run_dir / "checkpoints" / ckpt.BEST_EMA).exists()
    if kept:
        payload = ckpt.load(carried)  # intact: the checksum holds
        assert (payload["epoch"], payload["value"]) == (0, 50.0)
        assert torch.equal(payload["model"]["weight"], model.weight.detach())


def test_a_new_best_is_best_pt_once_a_checkpoint_holds_it(tmp_path):
    """best.pt is written as best.pt.pending and renamed by the next checkpoint: a run killed
    in between (trainer.checkpoint_every=2, a SIGKILL) and resumed in its own folder (a
    torchrun restart) kept a best.pt of an evaluation its history does not hold, with a
    value above the summary's best. The resume removes such a pending file, and keeps one
    whose evaluation the checkpoint holds (killed just after writing last.pt)."""
    from fastload.train_state import TrainState

    run_dir = tmp_path / "out" / "exp" / "r1"
    cfg = compose_config(tiny_overrides(tmp_path, run_dir), run_dir)
    with open_dict(cfg):
        del cfg["hydra"]
    record = RunRecord(cfg, DistContext(), run_dir, [], build_task(cfg))
    best = record.checkpoint_path.with_name(ckpt.BEST)
    pending = best.with_name(ckpt.BEST + ".pending")
    record.save_best(torch.nn.Linear(2, 3), "model", 0, 40.0)
    assert pending.is_file() and not best.exists()
    state = TrainState.create(cfg, torch.device("cpu"), 1, 1, amp=None, channels_last=False)
    record.save(state)  # the checkpoint holds epoch 0's evaluation: it becomes best.pt
    assert ckpt.load(best)["value"] == 40.0 and not pending.exists()
    history = [{"epoch": 0, "val_acc1": 40.0}]
    record.save_best(torch.nn.Linear(2, 3), "model", 2, 55.0)  # then killed before a checkpoint
    record.carry_best(record.checkpoint_path, history)  # the restart, in the same folder
    assert not pending.exists() and ckpt.load(best)["value"] == 40.0
    record.save_best(torch.nn.Linear(2, 3), "model", 1, 45.0)  # killed right after last.pt
    record.carry_best(record.checkpoint_path, [*history, {"epoch": 1, "val_acc1": 45.0}])
    assert not pending.exists() and ckpt.load(best)["value"] == 45.0


def test_evaluate_refuses_before_any_data_work(tmp_path):
    """The weights of another model, and evaluate= with resume= (the numbers the weights give:
    tests/test_train.py's SIGTERM test evaluates the files its run wrote)."""
    best = tmp_path / "run" / "checkpoints" / ckpt.BEST
    weights_file(best, 0, 50.0, run={"model_config": {"arch": "resnet18", "num_classes": 3}})
    missing = tmp_path / "no-data"  # nothing is read: a refusal comes before the data
    refused = tmp_path / "out" / "x" / "r"
    for extra, needles in ((["model=resnet50"], [str(best), "resnet18", "resnet50"]),
                           (["resume=auto"], ["set one of them"])):  # fmt: skip
        cfg = compose_config(tiny_overrides(missing, refused, f"evaluate={best}", *extra))
        with pytest.raises(FastloadError) as err:
            evaluate_only(cfg, DistContext(), refused)
        assert all(n in err.value.user_message for n in needles), err.value.user_message


def test_a_rank_without_a_validation_sample_does_not_hang_the_others(tmp_path):
    """2 validation images on 3 ranks: the third rank has none and made no forward, while
    DDP's first forward after training broadcasts the buffers on the others: they waited
    for it until the process group's timeout. Every rank now broadcasts them before the
    evaluation, whose forwards make no collective."""
    root = make_image_folder(tmp_path / "data", ("a", "b"), per_split=(12, 1))
    out = run_torchrun(root, tmp_path, f"output_root={tmp_path / 'out'}", "name=few",
                       "dataset.num_classes=2", "trainer.batch_size=2", "trainer.epochs=1",
                       nproc=3, timeout=240)  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    (metrics,) = (tmp_path / "out" / "few").glob("*/metrics.jsonl")
    (row,) = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert row["val_acc1"] is not None and row["world_size"] == 3


def test_evaluate_under_torchrun_gives_the_numbers_of_one_process(tiny_folder, tmp_path):
    """evaluate= on two ranks: each evaluates its share of the 9 validation images (5 and 4,
    the first rank's last batch short), and the numbers summed over both are the ones a
    single process gets: no image left out, none counted twice (no sampler padding)."""
    from tests.helpers import build_small_resnet

    torch.manual_seed(3)
    weights = tmp_path / "weights.pth"  # of the model the tiny runs train
    torch.save(build_small_resnet(num_classes=3).state_dict(), weights)
    one_dir = tmp_path / "out" / "one" / "r"
    one = run_train(tiny_overrides(tiny_folder, one_dir, f"evaluate={weights}"))
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_torchrun(tiny_folder, tmp_path, f"output_root={tmp_path / 'two'}", "name=e",
                       f"evaluate={weights}")  # fmt: skip
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    (two_json,) = (tmp_path / "two" / "e").glob("*/evaluation.json")  # one folder, rank 0's
    a = json.loads((one_dir / "evaluation.json").read_text())
    b = json.loads(two_json.read_text())
    assert a["val_images"] == b["val_images"] == 9 and b["val_skipped_corrupt"] == 0
    assert b["val_acc1"] == a["val_acc1"] and b["val_acc5"] == a["val_acc5"]
    assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-6)  # summed in another order


def test_evaluate_refuses_weights_that_do_not_fit_or_were_trained_with_other_model_options(
    tmp_path,
):
    """A plain state dict of another head was refused after the data work, in torch's list
    of keys; SRCNN weights evaluated with another residual/scale loaded and computed another
    function (8.6 against 32.1 dB)."""
    from fastload.engine import check_fits, check_model_options
    from tests.helpers import build_small_resnet

    small = build_small_resnet(num_classes=3)
    other = build_small_resnet(num_classes=5).state_dict()
    with pytest.raises(CheckpointError, match=r"2 of other shapes \(e\.g\. fc\.weight: the file"):
        check_fits(tmp_path / "w.pth", other, small)
    check_fits(tmp_path / "w.pth", small.state_dict(), small)
    trained = compose_config(["dataset=div2k", f"hydra.run.dir={tmp_path}"], tmp_path)
    payload = {"run_config": ckpt.run_config(trained)}
    check_model_options(tmp_path / "best.pt", payload, trained)
    changed = compose_config(["dataset=div2k", "model.residual=false",
                              f"hydra.run.dir={tmp_path}"], tmp_path)  # fmt: skip
    with pytest.raises(
        CheckpointError, match=r"model.residual: True -> False.*model.residual=True"
    ):
        check_model_options(tmp_path / "best.pt", payload, changed)
    check_model_options(tmp_path / "w.pth", {}, changed)  # a state dict from elsewhere


def test_evaluate_given_a_run_folder_names_its_weight_files(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for name in ("best.pt", "last.pt"):
        (run / "checkpoints" / name).write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"is a folder: pass one of its files, .*best\.pt"):
        ckpt.load_weights(run)
    (tmp_path / "w.safetensors").write_bytes(b"not torch")
    with pytest.raises(CheckpointError, match="pip install safetensors"):
        ckpt.load_weights(tmp_path / "w.safetensors")


def test_top5_is_null_with_five_classes_or_fewer():
    from fastload.tasks.classification import ClassificationStep

    assert ClassificationStep.val_metrics([2.0, 1.0, float("nan"), 2.0])["val_acc5"] is None
    assert ClassificationStep.val_metrics([2.0, 1.0, 2.0, 2.0])["val_acc5"] == 100.0
