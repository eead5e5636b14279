"""dataset=coco: the synthetic COCO, the detection transforms and batches, every storage's
targets, COCO mAP, the bad-input errors, and train.py end to end on the CPU."""

from __future__ import annotations

import json
import logging
import re
import shutil

import numpy as np
import pytest
import torch
from conftest import compose_config, run_train
from PIL import Image

from fastload.data.batch import IMAGE, SKIPPED, TARGET
from fastload.data.dataset import Normalize
from fastload.data.detection import (
    DetectionDataset,
    ResizeFlip,
    category_ids,
    collate_detection,
    dropped_counts,
)
from fastload.data.layouts import CocoLayout
from fastload.data.synthetic_coco import CATEGORY_IDS, ensure_synthetic_coco
from fastload.decode.pil import PILBackend
from fastload.errors import ConfigError, DatasetError
from fastload.loaders.device_prep import DevicePrep
from fastload.storage.disk import DiskStorage
from fastload.storage.lmdb_store import LmdbStorage
from fastload.storage.shards import ShardStorage
from fastload.storage.tmpfs import TmpfsStorage
from fastload.tasks.base import build_task
from fastload.tasks.detection import GroundTruth, coco_map
from tests.helpers import sample, targets

# What the synthetic splits hold on purpose (fastload/data/synthetic_coco.py).
DROPPED = {"crowd": 1, "degenerate": 2, "images_without_boxes": 1, "of_no_image": 0}
VAL_DROPPED = {"crowd": 1, "degenerate": 0, "images_without_boxes": 1, "of_no_image": 0}
FIELDS = {"boxes", "labels", "image_id", "orig_size"}


@pytest.fixture(scope="module")
def coco_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("coco") / "synthetic"
    return ensure_synthetic_coco(root, train_images=12, val_images=6, workers=1, progress=False)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def coco_run_args(root, run_dir, *extra):
    return [
        "dataset=coco",
        "model=fcos_tiny",
        "debug=fast",
        f"dataset.root={root}",
        "dataset.prepare=null",
        "trainer.device=cpu",
        "trainer.progress=false",
        f"hydra.run.dir={run_dir}",
        f"output_root={run_dir.parent}",
        *extra,
    ]


def assert_one_line_error(out, *needles):
    assert out.returncode == 2, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert "Traceback" not in text, text
    for needle in needles:
        assert needle in text, text


# -- the synthetic COCO ------------------------------------------------------------------


def test_synthetic_coco_is_valid_and_deterministic(coco_root, tmp_path):
    source = CocoLayout(str(coco_root)).source("train")
    assert source.dropped == DROPPED
    assert source.category_ids.tolist() == list(CATEGORY_IDS[:3])  # not contiguous
    coco = json.loads((coco_root / "annotations" / "instances_train.json").read_text())
    assert {"images", "annotations", "categories"} <= set(coco)
    for a in coco["annotations"]:
        assert {"id", "image_id", "bbox", "area", "iscrowd", "category_id"} <= set(a)
    # the boxes are the drawn objects: inside the image, and the pixels differ there
    boxes, labels = source.boxes(0)
    assert len(boxes) and set(labels.tolist()) <= set(CATEGORY_IDS[:3])
    again = ensure_synthetic_coco(tmp_path / "again", train_images=12, val_images=6,
                                  workers=2, progress=False)  # fmt: skip
    for split in ("train", "val"):
        name = f"annotations/instances_{split}.json"
        assert (again / name).read_bytes() == (coco_root / name).read_bytes()
    assert (again / "train" / "000003.jpg").read_bytes() == (
        coco_root / "train" / "000003.jpg"
    ).read_bytes()


def test_synthetic_coco_refuses_a_foreign_folder(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "photo.jpg").write_bytes(b"x")
    with pytest.raises(DatasetError, match="not a synthetic COCO"):
        ensure_synthetic_coco(tmp_path / "mine", train_images=2, val_images=2, progress=False)


# -- transforms and batches --------------------------------------------------------------


def test_resize_and_flip_move_the_boxes():
    img = np.zeros((100, 200, 3), np.uint8)
    img[20:50, 30:90] = 255  # the object: x 30..90, y 20..50
    boxes = np.array([[30, 20, 90, 50]], np.float32)
    rng = np.random.default_rng(0)
    out, moved = ResizeFlip(min_size=50, max_size=1000, hflip=0.0)(img, boxes, rng)
    assert out.shape == (50, 100, 3)
    np.testing.assert_allclose(moved, [[15, 10, 45, 25]])
    out, moved = ResizeFlip(min_size=200, max_size=300, hflip=1.0)(img, boxes, rng)
    assert out.shape == (150, 300, 3)  # max_size wins over min_size
    np.testing.assert_allclose(moved, [[300 - 135, 30, 300 - 45, 75]])
    x0, y0, x1, y1 = moved[0].astype(int)
    assert out[y0 + 2 : y1 - 2, x0 + 2 : x1 - 2].min() > 200  # the pixels moved with it
    assert out[:, : x0 - 3].max() < 30 and out[:, x1 + 3 :].max() < 30


def test_multi_scale_training_draws_a_min_size_per_image(coco_root):
    """dataset.train_transform.min_size=[...] (multi-scale training, as ResizeFlip's docstring
    says) was refused by the config check; one size is drawn per image from its (seed, epoch,
    index) RNG. Evaluation takes one size; min_size above max_size is said by the option."""
    from fastload.data.transforms import check_transforms
    from fastload.tasks.detection import DetectionTask

    cfg = compose_config(["dataset=coco", f"dataset.root={coco_root}",
                          "dataset.train_transform.min_size=[48,64,80]"])  # fmt: skip
    check_transforms(cfg.dataset)
    task = DetectionTask(data=cfg.dataset, seed=0)
    reader = DiskStorage().open(CocoLayout(str(coco_root)), "train")
    ds = task.dataset("train", reader, PILBackend())
    shorter = [min(ds[(e, i)][0].shape[1:]) for e in range(3) for i in range(len(ds))]
    assert set(shorter) == {48, 64, 80}
    task.check_storage(ShardStorage(kind="raw"))  # compares the stored size with the largest
    assert [min(ds[(e, i)][0].shape[1:]) for e in range(3) for i in range(len(ds))] == shorter
    with pytest.raises(ConfigError, match=r"val_transform.min_size=\[48, 64\]: evaluation"):
        check_transforms(
            compose_config(["dataset=coco", "dataset.val_transform.min_size=[48,64]"]).dataset
        )
    with pytest.raises(
        ConfigError, match=r"train_transform.min_size=900 is larger than its max_size=224"
    ):
        check_transforms(
            compose_config(["dataset=coco", "dataset.train_transform.min_size=900"]).dataset
        )


def test_collate_keeps_variable_sizes_and_device_prep_keeps_every_target_field(coco_root):
    reader = DiskStorage().open(CocoLayout(str(coco_root)), "train")
    ds = DetectionDataset(reader, PILBackend(), ResizeFlip(64, 96, 0.5), seed=0, train=True)
    batch = collate_detection([ds[(0, i)] for i in range(4)] + [None])
    assert batch[SKIPPED] == 1 and len(batch[IMAGE]) == len(batch[TARGET]) == 4
    assert len({tuple(x.shape) for x in batch[IMAGE]}) > 1  # sizes differ, not stacked
    for image, t in zip(batch[IMAGE], batch[TARGET], strict=True):
        assert set(t) == FIELDS and image.dtype == torch.uint8
        assert t["boxes"].dtype == torch.float32 and t["labels"].dtype == torch.int64
        assert t["labels"].min() >= 1 and t["labels"].max() <= 3  # contiguous 1..K
        assert (t["boxes"][:, 2:] > t["boxes"][:, :2]).all()
        assert t["boxes"][:, 2].max() <= image.shape[2] and t["boxes"][:, 3].max() <= image.shape[1]
    prepped = DevicePrep(torch.device("cpu"), Normalize([0.0] * 3, [1.0] * 3))(batch)
    for before, after in zip(batch[TARGET], prepped[TARGET], strict=True):
        assert set(after) == FIELDS
        for k in FIELDS:
            assert torch.equal(before[k], after[k])
    assert all(x.dtype == torch.float32 and x.max() <= 1.0 for x in prepped[IMAGE])


@pytest.mark.parametrize("loader", ["prefetch", "bg"])
def test_loaders_deliver_every_target_field(coco_root, loader):
    """The CUDA prefetcher (CPU fallback here; the cuda test below on a GPU) and the
    background loader move the list-of-dicts targets like any batch."""
    from fastload.pipeline import build_loader, build_plan

    cfg = compose_config(["dataset=coco", f"dataset.root={coco_root}", "dataset.prepare=null",
                          f"loader={loader}", "loader.num_workers=1", "trainer.batch_size=3"])  # fmt: skip
    val = build_loader(build_plan(cfg), "val")
    got = [t for b in val for t in b[TARGET]]
    val.close()
    ds = val.dataset
    assert len(got) == len(ds) == 6  # evaluation keeps the image without boxes
    for t, i in zip(got, range(len(ds)), strict=True):
        want = ds[(0, i)][1]
        assert set(t) == FIELDS
        assert all(torch.equal(t[k].cpu(), want[k]) for k in FIELDS)


@pytest.mark.cuda
def test_cuda_prefetcher_moves_targets_to_the_gpu(coco_root):
    from fastload.pipeline import build_loader, build_plan

    cfg = compose_config(["dataset=coco", f"dataset.root={coco_root}", "dataset.prepare=null",
                          "loader=prefetch", "loader.num_workers=1", "trainer.batch_size=3"])  # fmt: skip
    val = build_loader(build_plan(cfg), "val", device="cuda")
    batch = next(iter(val))
    val.close()
    assert all(x.is_cuda and x.dtype == torch.float32 for x in batch[IMAGE])
    assert all(set(t) == FIELDS and all(v.is_cuda for v in t.values()) for t in batch[TARGET])


# -- every storage holds the same targets ------------------------------------------------


def test_packs_and_tmpfs_give_the_json_targets(coco_root, tmp_path):
    layout = CocoLayout(str(coco_root))
    disk = {s: DiskStorage().open(layout, s) for s in ("train", "val")}
    stores = [
        LmdbStorage(path=str(tmp_path / "lmdb")),
        ShardStorage(path=str(tmp_path / "shards")),
        TmpfsStorage(target_dir=str(tmp_path / "shm"), progress=False),
    ]
    for store in stores:
        store.prepare(layout, ["train", "val"])
        for split, want in disk.items():
            got = store.open(layout, split)
            assert len(got) == len(want) and np.array_equal(targets(got), targets(want))
            assert category_ids(got).tolist() == category_ids(want).tolist()
            assert dropped_counts(got) == dropped_counts(want)
            assert dropped_counts(got) == (DROPPED if split == "train" else VAL_DROPPED)
            for i in range(len(want)):
                for a, b in zip(
                    (got.get(i, "boxes"), got.get(i, "labels")),
                    (want.get(i, "boxes"), want.get(i, "labels")),
                    strict=True,
                ):
                    np.testing.assert_array_equal(a, b)
                assert sample(got, i) == sample(want, i)


def test_a_box_with_no_area_once_resized_is_left_out_and_counted(coco_root, tmp_path):
    """A box 1e-6 px wide has area in the file's float64 pixels but none in float32: it
    reached the model and torchvision's assertion stopped training mid-epoch, naming no
    file. It is left out of the sample's target and counted in the epoch row."""
    from models.detection import build_detector

    root = tmp_path / "coco"
    shutil.copytree(coco_root, root)
    path = root / "annotations" / "instances_train.json"
    ann = json.loads(path.read_text())
    sliver = next(a for a in ann["annotations"] if not a["iscrowd"] and a["bbox"][0] > 20)
    sliver["bbox"][2] = 1e-6
    path.write_text(json.dumps(ann))
    reader = DiskStorage().open(CocoLayout(str(root)), "train")
    ds = DetectionDataset(reader, PILBackend(), ResizeFlip(64, 96, 0.0), seed=0, train=True)
    samples = {int(s[1]["image_id"]): s for s in (ds[(0, i)] for i in range(len(ds)))}
    assert sum(c["dropped_degenerate_resized"] for _, _, c in samples.values()) == 1
    image, target, _ = samples[sliver["image_id"]]
    boxes = target["boxes"]
    assert len(boxes) == len(target["labels"]) and (boxes[:, 2:] > boxes[:, :2]).all()
    model = build_detector("fcos_tiny", 3).train()
    model([image.float() / 255], [target])  # torchvision's degenerate-box check passes


def test_a_coco_subset_packs_beside_the_whole_set_not_over_it(coco_root, tmp_path):
    """dataset.layout.subset=N and the whole set of one root: each its own default pack
    folder, so neither finds the other's pack out of date and packs over it."""
    root = tmp_path / "coco"
    shutil.copytree(coco_root, root)
    whole, subset = CocoLayout(str(root)), CocoLayout(str(root), subset=3)
    store = ShardStorage()
    assert store.pack_root(whole) == tmp_path / "coco.packs" / "shards-jpeg-orig"
    assert store.pack_root(subset) == tmp_path / "coco.packs" / "shards-jpeg-orig-subset3"
    for layout in (whole, subset):
        store.prepare(layout, ["train"])
    marks = {p: p.stat().st_mtime_ns for p in (tmp_path / "coco.packs").rglob("*") if p.is_file()}
    for layout in (whole, subset):
        store.prepare(layout, ["train"])  # both packs are current: nothing re-packed
        assert len(store.open(layout, "train")) == len(DiskStorage().open(layout, "train"))
    assert {p: p.stat().st_mtime_ns for p in marks} == marks
    assert len(store.open(subset, "train")) == 3 < len(store.open(whole, "train"))


def test_the_pack_command_a_subset_run_gives_packs_its_subset(coco_root, tmp_path):
    """storage.auto_pack=false names the command that packs the split; for a subset it
    packed the whole split into the subset's folder, which the run then found out of date
    and named the same command again."""
    from fastload.pack import main as pack_main

    layout, store = CocoLayout(str(coco_root), subset=3), ShardStorage(auto_pack=False)
    root = tmp_path / "packs"
    args = layout.pack_args("train", root)
    assert args[args.index("--subset") + 1] == "3"
    assert pack_main(["shards", *args]) == 0
    store = ShardStorage(path=str(root), auto_pack=False)
    store.prepare(layout, ["train"])  # current: not refused as out of date
    assert len(store.open(layout, "train")) == 3


def test_annotations_of_no_listed_image_are_counted(coco_root, tmp_path):
    from fastload.data.sources import CocoSource

    root = tmp_path / "coco"
    shutil.copytree(coco_root, root)
    ann = root / "annotations" / "instances_train.json"
    data = json.loads(ann.read_text())
    stray = {**data["annotations"][0], "id": 10**6, "image_id": 10**6}
    data["annotations"].append(stray)
    ann.write_text(json.dumps(data))
    assert CocoSource(ann, root / "train").dropped == {**DROPPED, "of_no_image": 1}


def test_a_smaller_pack_needs_the_images_sizes_to_score_in_their_frame(coco_root, tmp_path):
    """Without width/height in the annotation file, a pack stored at a max side was scored
    with its detections in the smaller pixels against boxes in the original ones: mAP ~0,
    silently. Packing so is refused naming the file; an unresized pack still works."""
    root = tmp_path / "coco"
    shutil.copytree(coco_root, root)
    ann = root / "annotations" / "instances_train.json"
    data = json.loads(ann.read_text())
    for im in data["images"]:
        del im["width"], im["height"]
    ann.write_text(json.dumps(data))
    layout = CocoLayout(str(root))
    with pytest.raises(DatasetError, match=r"instances_train.json: 12 image\(s\) without width"):
        ShardStorage(path=str(tmp_path / "small"), max_side=32).prepare(layout, ["train"])
    assert not (tmp_path / "small" / "train").exists()
    ShardStorage(path=str(tmp_path / "orig")).prepare(layout, ["train"])


def test_a_flipping_evaluation_transform_is_refused(coco_root):
    """Detections of a flipped image were scored against the unflipped annotations."""
    from omegaconf import open_dict

    cfg = compose_config(["dataset=coco", f"dataset.root={coco_root}"])
    with open_dict(cfg):
        cfg.dataset.val_transform.hflip = 0.5
    task = build_task(cfg)
    reader = DiskStorage().open(CocoLayout(str(coco_root)), "val")
    with pytest.raises(ConfigError, match=r"dataset.val_transform.hflip=0.5: .*hflip=0"):
        task.dataset("val", reader, PILBackend())
    assert len(task.dataset("train", DiskStorage().open(CocoLayout(str(coco_root)), "train"),
                            PILBackend())) > 0  # fmt: skip


def test_a_pack_stored_smaller_than_the_training_resize_is_said(coco_root, caplog, tmp_path):
    """storage=shards storage.kind=raw keeps 256 px by default (an ImageNet size): a COCO
    run on it upscaled every image 3x or more (min_size 800), without a word."""
    from fastload.storage.lmdb_store import LmdbStorage

    cfg = compose_config(["dataset=coco", f"dataset.root={coco_root}",
                          "dataset.train_transform.min_size=800"])  # fmt: skip
    task = build_task(cfg)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        task.check_storage(ShardStorage(kind="raw"))
    assert "(storage.size=256), but dataset.train_transform.min_size=800" in caplog.text
    assert "upscaled 3.1x or more" in caplog.text and "storage.size=null" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastload"):
        task.check_storage(LmdbStorage(max_side=320))
        assert "(storage.max_side=320)" in caplog.text
        caplog.clear()
        for fine in (ShardStorage(kind="raw", size=None), ShardStorage(max_side=1333),
                     ShardStorage(), DiskStorage()):  # fmt: skip
            task.check_storage(fine)
    assert caplog.text == ""
    # said by the run, before any work (the data path it builds)
    from fastload.dist import DistContext
    from fastload.pipeline import build_data, build_plan

    cfg = compose_config(["dataset=coco", f"dataset.root={coco_root}", "dataset.prepare=null",
                          "storage=shards", "storage.kind=raw", "storage.size=64",
                          f"storage.path={tmp_path / 'raw'}", "loader.num_workers=0",
                          "trainer.batch_size=2"])  # fmt: skip
    plan = build_plan(cfg)
    plan.storage.prepare(plan.layout, ["train", "val"])
    with caplog.at_level(logging.WARNING, logger="fastload"):
        build_data(plan, DistContext(), channels_last=False).close()
    assert "(storage.size=64), but dataset.train_transform.min_size=" in caplog.text


def test_evaluation_predicts_in_fp32_under_bf16_training(tmp_path):
    """trainer.precision=bf16 trains under autocast; evaluation does not: bf16 box decoding
    puts coordinates on 4-8 px steps at COCO sizes and costs mAP points."""
    from fastload.tasks.detection import DetectionStep
    from models.detection import build_detector

    torch.manual_seed(0)
    model = build_detector("fcos_tiny", 3).eval()
    step = DetectionStep.__new__(DetectionStep)  # predict needs none of the step's config
    step.amp, step.device = torch.bfloat16, torch.device("cpu")
    images = [torch.rand(3, 64, 96).to(torch.bfloat16)]  # loader.input_dtype=bf16 too
    with step.autocast():  # what training runs under
        under_autocast = model([images[0].float()])[0]
    got = step.predict(model, images)[0]
    assert under_autocast["boxes"].dtype == torch.bfloat16  # what evaluation used to give
    assert got["boxes"].dtype == got["scores"].dtype == torch.float32


def test_an_images_detections_do_not_depend_on_its_batch():
    """The model pads a batch to its largest image, and the padding changes the detections:
    the same weights scored another mAP with another batch size or world size (the tests'
    set: 32.6 at batch 1, 43.3 at 4, 43.7 at 4 on 3 ranks). Evaluation predicts per image."""
    from fastload.tasks.detection import DetectionStep
    from models.detection import build_detector

    torch.manual_seed(0)
    model = build_detector("fcos_tiny", 3).eval()
    model.score_thresh = 0.0  # untrained: keep its low-scoring detections to compare
    step = DetectionStep.__new__(DetectionStep)
    small, large = torch.rand(3, 64, 96), torch.rand(3, 160, 224)
    alone = step.predict(model, [small])[0]
    batched = step.predict(model, [small, large])[0]
    assert len(alone["boxes"]) == len(batched["boxes"]) > 0
    for key in ("boxes", "scores", "labels"):
        assert torch.equal(alone[key], batched[key]), key


# -- COCO mAP ----------------------------------------------------------------------------


def test_coco_map_of_a_perfect_and_an_empty_prediction(coco_root):
    ann = coco_root / "annotations" / "instances_val.json"
    truth = GroundTruth(np.array(CATEGORY_IDS[:3]), ann)
    source = CocoLayout(str(coco_root)).source("val")
    images = {}
    for i in range(len(source)):
        boxes, cats = source.boxes(i)  # crowd and degenerate ones are not in it
        dets = np.hstack([boxes, np.ones((len(boxes), 1)), cats[:, None]])
        gt = np.hstack([boxes, cats[:, None]])
        images[int(source.ids[i])] = (1, 1, gt, dets)
    sizes = {im["id"]: (im["height"], im["width"]) for im in json.loads(ann.read_text())["images"]}
    images = {k: (*sizes[k], gt, d) for k, (_, _, gt, d) in images.items()}
    perfect = coco_map(truth.coco(images), images)
    assert perfect["val_map"] == pytest.approx(100.0) and perfect["val_map50"] == 100.0
    empty = {k: (h, w, gt, d[:0]) for k, (h, w, gt, d) in images.items()}
    assert coco_map(truth.coco(empty), empty)["val_map"] == 0.0
    # the same from the boxes alone (a pack without its annotation file)
    no_file = GroundTruth(np.array(CATEGORY_IDS[:3]), None)
    assert coco_map(no_file.coco(images), images)["val_map"] == pytest.approx(100.0)
    # shifted by a third of each box: mAP falls (the metric looks at the boxes)
    off = {k: (h, w, gt, d + np.r_[0.33 * d[:, 2:3].T, np.zeros((5, len(d)))].T[:, :6])
           for k, (h, w, gt, d) in images.items()}  # fmt: skip
    assert coco_map(truth.coco(off), off)["val_map"] < 60


@pytest.mark.parametrize("unstated", [0, None])
def test_coco_map_of_images_whose_file_states_no_size(coco_root, tmp_path, unstated):
    """A width/height of 0 or null is "not stated" (as the source reads it): the detections
    stay in the decoded image's pixels. They were scaled to nothing by a 0 (mAP 0, silently)
    and failed with a TypeError on a null, after a whole training epoch."""
    data = json.loads((coco_root / "annotations" / "instances_val.json").read_text())
    for im in data["images"]:
        im["width"] = im["height"] = unstated
    ann = tmp_path / "instances_val.json"
    ann.write_text(json.dumps(data))
    truth = GroundTruth(np.array(CATEGORY_IDS[:3]), ann)
    source = CocoLayout(str(coco_root)).source("val")
    images = {}
    for i in range(len(source)):
        boxes, cats = source.boxes(i)
        h, w = 100 + i, 120 + i  # the decoded image's size
        dets = np.hstack([boxes, np.ones((len(boxes), 1)), cats[:, None]])
        images[int(source.ids[i])] = (h, w, np.hstack([boxes, cats[:, None]]), dets)
    assert coco_map(truth.coco(images), images)["val_map"] == pytest.approx(100.0)


# -- configuration errors ----------------------------------------------------------------


def test_num_classes_must_match_the_categories(coco_root):
    from fastload.tasks.detection import DetectionTask

    cfg = compose_config(["dataset=coco", f"dataset.root={coco_root}", "dataset.num_classes=80"])
    reader = DiskStorage().open(CocoLayout(str(coco_root)), "train")
    with pytest.raises(ConfigError, match="set dataset.num_classes=3"):
        DetectionTask(data=cfg.dataset).check(reader, reader)


def test_a_normalising_mean_and_std_are_refused(coco_root):
    """The device prep normalised with dataset.mean/std, then the model's transform with
    its own: the images were normalised twice, silently."""
    from fastload.tasks.detection import DetectionTask

    cfg = compose_config(["dataset=coco", f"dataset.root={coco_root}",
                          "dataset.mean=[0.485,0.456,0.406]", "dataset.std=[0.229,0.224,0.225]"])  # fmt: skip
    reader = DiskStorage().open(CocoLayout(str(coco_root)), "train")
    with pytest.raises(ConfigError, match=r"dataset.mean=\[0.485, .* normalise it twice"):
        DetectionTask(data=cfg.dataset).check(reader, reader)


def test_classification_model_on_coco_is_refused(coco_root, tmp_path):
    out = run_train(coco_run_args(coco_root, tmp_path / "run", "model=resnet18"))
    assert_one_line_error(out, "model=resnet18 is a classification model", "fcos_tiny")


def test_malformed_json_and_missing_image_name_the_file(coco_root, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(coco_root, broken)
    ann = broken / "annotations" / "instances_train.json"
    ann.write_text(ann.read_text()[:-40])
    out = run_train(coco_run_args(broken, tmp_path / "run1"))
    assert_one_line_error(out, str(ann))
    shutil.copy(coco_root / "annotations" / "instances_train.json", ann)
    (broken / "train" / "000002.jpg").unlink()
    out = run_train(coco_run_args(broken, tmp_path / "run2"))
    assert_one_line_error(out, str(broken / "train" / "000002.jpg"))


# -- train.py end to end -----------------------------------------------------------------


def test_short_cpu_run_lowers_the_loss_and_reports_map(coco_root, tmp_path):
    run_dir = tmp_path / "run"
    # with the EMA of the weights: evaluated by COCOeval beside the model
    out = run_train(coco_run_args(coco_root, run_dir, "trainer.epochs=3", "trainer.ema.decay=0.5"))
    assert out.returncode == 0, out.stderr
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    for r in rows:
        assert {f"dropped_{k}": v for k, v in DROPPED.items()}.items() <= r.items()
        assert 0 <= r["val_map"] <= r["val_map50"] <= 100
        assert 0 <= r["ema_val_map"] <= r["ema_val_map50"] <= 100
        assert r["train_images"] == 8  # 11 images with boxes, batches of 4, drop_last
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["metric"] == "val_map"
    assert summary["best_map"] == max(r["val_map"] for r in rows)
    assert summary["best_ema_map"] == max(r["ema_val_map"] for r in rows)
    assert "best mAP" in out.stdout and "best mAP@[.5:.95] (EMA)" in out.stdout


@pytest.mark.slow
def test_longer_cpu_run_detects_objects(tmp_path):
    """The default synthetic COCO (512 train images), long enough for mAP > 0."""
    run_dir = tmp_path / "run"
    out = run_train(
        [
            "dataset=coco",
            "model=fcos_tiny",
            f"dataset.root={tmp_path / 'coco'}",
            "trainer.device=cpu",
            "trainer.progress=false",
            "trainer.batch_size=8",
            "trainer.epochs=2",
            "trainer.checkpoint_every=0",
            "logger=none",
            "loader.num_workers=1",
            f"hydra.run.dir={run_dir}",
            f"output_root={tmp_path}",
        ],
        timeout=1800,
    )
    assert out.returncode == 0, out.stderr
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert rows[-1]["val_map"] > 0 and rows[-1]["val_map50"] > rows[-1]["val_map"]


def test_local_weights_load_or_fail_naming_the_file(tmp_path):
    from fastload.models.detection import build_detector

    model = build_detector("fcos_tiny", 3)
    torch.save(model.state_dict(), tmp_path / "w.pth")
    again = build_detector("fcos_tiny", 3, weights=str(tmp_path / "w.pth"))
    got = again.state_dict()  # frozen batch norms keep no num_batches_tracked
    assert got and all(torch.equal(v, model.state_dict()[k]) for k, v in got.items())
    # trained as torchvision trains a pretrained detector: the trunk's batch norms frozen
    # with the weights' statistics, conv1 and layer1 fixed (trainable_backbone_layers=3)
    body = again.backbone.body
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in body.modules())
    assert not body.conv1.weight.requires_grad and not body.layer1[0].conv1.weight.requires_grad
    assert body.layer2[0].conv1.weight.requires_grad and next(again.head.parameters()).requires_grad
    # a training pass leaves the statistics as the weights have them
    images, targets = [torch.rand(3, 64, 96)], [{"boxes": torch.tensor([[4.0, 4, 40, 40]]),
                                                 "labels": torch.tensor([1])}]  # fmt: skip
    with torch.no_grad():
        again.train()(images, targets)
        assert torch.equal(again.eval()(images)[0]["scores"], model.eval()(images)[0]["scores"])
    with pytest.raises(ConfigError, match=f"{tmp_path / 'w.pth'} does not fit"):
        build_detector("fcos_tiny", 5, weights=str(tmp_path / "w.pth"))
    with pytest.raises(ConfigError, match="no such file"):
        build_detector("fcos_tiny", 3, weights=str(tmp_path / "missing.pth"))


@pytest.mark.parametrize("key, value", [("min_size", 800), ("max_size", 1333),
                                        ("fixed_size", [512, 512])])  # fmt: skip
def test_the_models_resize_options_are_refused_for_the_datasets(key, value):
    """The model's transform does not resize here: model.min_size/max_size were accepted and
    did nothing, the input size came from dataset.*_transform."""
    from models.detection import build_detector

    with pytest.raises(ConfigError, match=rf"model.{key}=.*dataset.train_transform.min_size"):
        build_detector("fcos_tiny", 3, **{key: value})


def test_trainable_backbone_layers_without_weights_is_said(caplog):
    """As torchvision warns: from scratch every layer trains, whatever the option says."""
    from models.detection import build_detector

    with caplog.at_level(logging.WARNING, logger="fastload"):
        build_detector("fcos_tiny", 3, trainable_backbone_layers=1)
    assert "model.trainable_backbone_layers=1 has no effect without model.weights" in caplog.text
    with pytest.raises(ConfigError, match=r"model.trainable_backbone_layers=6: use 0 to 5"):
        build_detector("fcos_tiny", 3, trainable_backbone_layers=6)


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda a: a["annotations"][0].update(bbox=["a", "b", "c", "d"]), "has bbox ['a'"),
        (lambda a: a["annotations"][0].update(bbox=[1, 2]), "has bbox [1, 2]"),
        (lambda a: a["annotations"][0].update(bbox=[float("nan"), 2, 3, 4]), "has bbox [nan"),
        (lambda a: a.update(categories=[]), "'categories' is empty"),
        (lambda a: a.pop("categories"), "KeyError: 'categories'"),
        (lambda a: a["annotations"][0].update(id="x"), "ValueError: invalid literal"),
        (
            lambda a: [im.update(id=77) for im in a["images"][:2]],
            "repeated image id(s) 77: pycocotools",
        ),  # fmt: skip
        (
            lambda a: [an.update(id=99) for an in a["annotations"][:2]],
            "repeated annotation id(s) 99:",
        ),  # fmt: skip
        (
            lambda a: a["annotations"][1].update(category_id=12345),
            "has category_id 12345, which is not among its 'categories'",
        ),  # fmt: skip
    ],
)
def test_a_broken_annotation_file_is_named_not_trained_on(coco_root, tmp_path, change, needle):
    """Boxes that are not four finite numbers, or no categories: the file is named (a nan
    box would otherwise be dropped as "degenerate", and no categories advised
    dataset.num_classes=0). So are repeated ids (pycocotools kept the last image of an id:
    one file vanished and the other got both images' boxes) and an annotation of a category
    the file does not list (it failed only when its image was read, for a validation image
    after a whole training epoch)."""
    from fastload.data.sources import CocoSource

    ann = json.loads((coco_root / "annotations" / "instances_train.json").read_text())
    change(ann)
    path = tmp_path / "instances_train.json"
    path.write_text(json.dumps(ann))
    with pytest.raises(DatasetError) as err:
        CocoSource(path, coco_root / "train")
    assert str(path) in str(err.value) and needle in str(err.value)


def coco_source_arrays(source):
    """Everything a CocoSource read from its file, as exact bytes."""
    arrays = (source.ids, source.files, source.sizes, source.category_ids, source._boxes,
              source._labels, source._offsets)  # fmt: skip
    return [(a.dtype.str, a.shape, a.tobytes()) for a in arrays], source.dropped


def edge_case_annotations(tmp_path, images=1200):
    """An instances file of the cases the box reading distinguishes (crowd as 1, true or 0,
    boxes outside, on and across the image's sides, -0.0, ints, images without a stated
    size or with 0, annotations of an image it does not list), with the image files; ids
    not in order."""
    rng = np.random.default_rng(5)
    folder = tmp_path / "images"
    folder.mkdir()
    ims, anns = [], []
    for k, i in enumerate(rng.permutation(np.arange(10, 10 + images)).tolist()):
        im = {"id": i, "file_name": f"{i:06d}.jpg"}
        if k % 7:
            im["width"], im["height"] = [(64, 48), (0, 30), (None, 20), (33.5, 17.25)][k % 4]
        ims.append(im)
        (folder / im["file_name"]).touch()
        for _ in range(int(rng.integers(0, 4))):
            box = rng.choice([-10.0, -0.0, 0, 1, 5.5, 17.25, 33.5, 47, 64, 70.0], 4).tolist()
            if rng.random() < 0.5:
                box = rng.uniform(-20, 80, 4).tolist()
            a = {"id": len(anns) + 1, "image_id": i, "category_id": int(rng.choice([1, 3, 9]))}
            a["bbox"] = [int(v) if v == 47 else v for v in box]
            crowd = rng.integers(0, 4)
            if crowd < 3:
                a["iscrowd"] = [0, 1, True][crowd]
            anns.append(a)
    anns.append({"id": len(anns) + 1, "image_id": 5, "category_id": 1, "bbox": [1, 2, 3, 4]})
    rng.shuffle(anns)
    cats = [{"id": c, "name": f"c{c}"} for c in (9, 1, 3)]
    path = tmp_path / "instances_edge.json"
    path.write_text(json.dumps({"images": ims, "annotations": anns, "categories": cats}))
    return path, folder


@pytest.mark.parametrize("subset", [None, 700])
def test_the_array_read_of_an_annotation_file_equals_the_per_annotation_one(
    tmp_path, monkeypatch, subset
):
    """A file whose fields are all of their plain JSON types is read as arrays (_Columns);
    the boxes, labels, offsets, sizes and dropped counts are bit for bit those of the
    per-image, per-annotation reading that any other file gets."""
    from fastload.data import sources

    path, folder = edge_case_annotations(tmp_path)
    assert sources._Columns.read(json.loads(path.read_text())) is not None
    fast = coco_source_arrays(sources.CocoSource(path, folder, subset))
    monkeypatch.setattr(sources._Columns, "read", classmethod(lambda cls, data: None))
    slow = coco_source_arrays(sources.CocoSource(path, folder, subset))
    assert fast == slow
    dropped = fast[1]
    assert dropped["crowd"] and dropped["degenerate"] and dropped["images_without_boxes"]
    assert dropped["of_no_image"] == 1


def test_a_missing_image_among_many_is_named_as_before(tmp_path):
    """Past 1000 images the folder is listed once instead of a stat per image; a file in a
    subfolder or behind a link is still found, and the first missing one still named."""
    from fastload.data.sources import CocoSource

    path, folder = edge_case_annotations(tmp_path)
    ann = json.loads(path.read_text())
    (folder / "sub").mkdir()
    (folder / "sub" / "x.jpg").touch()
    (folder / "linked.jpg").symlink_to(folder / ann["images"][0]["file_name"])
    ann["images"][3]["file_name"] = "sub/x.jpg"
    ann["images"][4]["file_name"] = "linked.jpg"
    path.write_text(json.dumps(ann))
    assert len(CocoSource(path, folder)) == 1200
    gone = sorted(ann["images"], key=lambda im: im["id"])[2:4]
    for im in gone:
        (folder / im["file_name"]).unlink()
    with pytest.raises(DatasetError) as err:
        CocoSource(path, folder)
    assert str(err.value).startswith(
        f"2 image(s) listed in {path} are missing from {folder}, first: "
        f"{folder / gone[0]['file_name']}. "
    )


def keep(pixels, boxes, rng):
    """A transform that keeps the decoded image and its boxes as they are."""
    return pixels, boxes


def turned_coco(coco_root, tmp_path):
    """A copy of the synthetic COCO whose train split holds two photos with EXIF orientation
    6 (turn 90 degrees clockwise to show): `stored` keeps the pixels its boxes were drawn on
    as stored (the file's width/height are the stored size), `shown` is stored turned the
    other way, so the tag shows the annotated pixels (the file's size is the shown one).
    Returns (root, {name: (image id, file, (width, height), annotated pixels)})."""
    root = tmp_path / "coco"
    shutil.copytree(coco_root, root)
    ann = json.loads((root / "annotations" / "instances_train.json").read_text())
    with_boxes = {a["image_id"] for a in ann["annotations"] if not a.get("iscrowd")}
    oblong = [im for im in ann["images"] if im["id"] in with_boxes and im["width"] != im["height"]]
    picked = {}
    for name, im in zip(("stored", "shown"), oblong[1:3], strict=True):
        path = root / "train" / im["file_name"]
        pixels = Image.open(path).convert("RGB")
        exif = Image.Exif()
        exif[0x0112] = 6
        kept = pixels if name == "stored" else pixels.rotate(90, expand=True)
        kept.save(path, quality=95, exif=exif)
        picked[name] = (im["id"], path, (im["width"], im["height"]), np.asarray(pixels))
    return root, picked


def decoded_by_id(dataset):
    """{image id: (HWC pixels, target, counts)} of every sample of a DetectionDataset."""
    out = {}
    for position in range(len(dataset)):
        image, target, *counts = dataset[position]
        out[int(target["image_id"])] = (image.permute(1, 2, 0).numpy(), target, *counts)
    return out


def test_boxes_stay_on_their_pixels_in_an_exif_turned_photo(coco_root, tmp_path):
    """A photo turned by its EXIF tag is decoded in the frame of its boxes, which the
    annotation file's width and height tell: the stored frame when they are its stored size
    (as pycocotools and torchvision's CocoDetection read COCO; before, it was decoded turned,
    its boxes on other pixels), the shown frame when they are its shown size. Counted per
    epoch; the same on disk and in every pack."""
    from fastload.decode.base import open_rgb

    root, picked = turned_coco(coco_root, tmp_path)
    layout = CocoLayout(str(root))
    disk = DetectionDataset(DiskStorage().open(layout, "train"), PILBackend(), keep, seed=0,
                            train=True)  # fmt: skip
    got = decoded_by_id(disk)
    for name, (image_id, path, (w, h), annotated) in picked.items():
        pixels, target = got[image_id][:2]
        assert pixels.shape == (h, w, 3) and target["orig_size"].tolist() == [h, w], name
        assert got[image_id][2]["stored_frame_images"] == (name == "stored"), name
        assert np.abs(pixels.astype(int) - annotated).mean() < 3, name  # JPEG's loss only
        exact = open_rgb(path.read_bytes(), exif=name == "shown")
        np.testing.assert_array_equal(pixels, np.asarray(exact))
    assert sum(c["stored_frame_images"] for _, _, c in got.values()) == 1
    packs = [
        ShardStorage(path=str(tmp_path / "shards")),  # the files' bytes, re-encoded if turned
        LmdbStorage(path=str(tmp_path / "lmdb"), kind="raw", size=48),  # pixels, smaller
    ]
    for store in packs:
        store.prepare(layout, ["train"])
        packed = decoded_by_id(DetectionDataset(store.open(layout, "train"), PILBackend(), keep,
                                                seed=0, train=True))  # fmt: skip
        for name, (image_id, _, (w, h), annotated) in picked.items():
            pixels, target = packed[image_id][:2]
            ph, pw = pixels.shape[:2]
            assert (ph < pw) == (h < w), (store, name)  # not turned
            small = np.asarray(Image.fromarray(annotated).resize((pw, ph), Image.BILINEAR))
            assert np.abs(pixels.astype(int) - small).mean() < 6, (store, name)
            scale = torch.tensor([pw / w, ph / h] * 2)
            want = got[image_id][1]["boxes"] * scale
            torch.testing.assert_close(target["boxes"], want, atol=0.01, rtol=1e-4)


def test_an_image_of_neither_stated_size_is_named_not_trained_on(coco_root, tmp_path):
    """An image whose size is neither the one the annotation file states nor that turned
    by its EXIF tag: its boxes would land elsewhere. Reading it and packing it both stop
    naming the file (not skipped as corrupt, even with skip_corrupt)."""
    root = tmp_path / "coco"
    shutil.copytree(coco_root, root)
    path = root / "annotations" / "instances_train.json"
    ann = json.loads(path.read_text())
    ids = {a["image_id"] for a in ann["annotations"]}
    wrong = next(im for im in ann["images"] if im["id"] in ids)
    wrong["width"] += 7
    path.write_text(json.dumps(ann))
    layout = CocoLayout(str(root))
    dataset = DetectionDataset(DiskStorage().open(layout, "train"), PILBackend(), keep,
                               seed=0, train=True, skip_corrupt=True)  # fmt: skip
    file = str(root / "train" / wrong["file_name"])
    with pytest.raises(DatasetError, match=rf"annotation file says width {wrong['width']}, "):
        decoded_by_id(dataset)
    with pytest.raises(DatasetError, match=re.escape(file)):
        ShardStorage(path=str(tmp_path / "p")).prepare(layout, ["train"], skip_corrupt=True)
    assert not (tmp_path / "p" / "train").exists()


def test_a_coco_pack_whose_frames_were_not_checked_is_packed_again(coco_root, tmp_path):
    from fastload.storage.packing import stale_reason

    layout, store = CocoLayout(str(coco_root)), ShardStorage(path=str(tmp_path / "p"))
    store.prepare(layout, ["val"])
    sidecar = tmp_path / "p" / "val" / "fastload-pack.json"
    record = json.loads(sidecar.read_text())
    assert stale_reason(lambda: layout.source("val"), sidecar.parent, store.pack_options()) is None
    del record["params"]["frames_checked"]
    sidecar.write_text(json.dumps(record))
    reason = stale_reason(lambda: layout.source("val"), sidecar.parent, store.pack_options())
    assert reason and "without checking them against the sizes" in reason


def opened_split(fmt, layout, tmp_path, split="train"):
    from fastload.storage.webdataset import WebDatasetStorage

    if fmt == "disk":
        return DiskStorage().open(layout, split)
    if fmt == "webdataset":  # several shards
        store = WebDatasetStorage(path=str(tmp_path / fmt), shard_samples=5)
    else:
        store = {"shards": ShardStorage, "lmdb": LmdbStorage}[fmt](path=str(tmp_path / fmt))
    store.prepare(layout, [split])
    return store.open(layout, split)


@pytest.mark.parametrize("fmt", ["disk", "shards", "webdataset", "lmdb"])
def test_training_finds_the_images_with_boxes_without_reading_every_record(
    coco_root, tmp_path, fmt
):
    """Training leaves out the images without a box: it asks the store which have one (the
    source's box offsets, a shard pack's index, a webdataset manifest) where reading every
    record's labels was a pass over the whole split on every rank (webdataset: every shard
    fetched and hashed). The answer is what reading each record gives; lmdb reads them."""
    reader = opened_split(fmt, CocoLayout(str(coco_root)), tmp_path)
    read = [len(reader.get(i, "labels")) > 0 for i in range(len(reader))]
    assert not all(read) and any(read)
    if fmt == "webdataset":
        reader = opened_split(fmt, CocoLayout(str(coco_root)), tmp_path)  # no shard open yet
    calls = []
    real_get = reader.get
    reader.get = lambda i, name: calls.append((i, name)) or real_get(i, name)
    ds = DetectionDataset(reader, PILBackend(), keep, seed=0, train=True)
    assert ds.indices.tolist() == np.flatnonzero(read).tolist()
    assert len(calls) == {"disk": 0, "shards": 1, "webdataset": 0, "lmdb": len(reader)}[fmt]
    if fmt == "webdataset":
        assert reader._maps is None  # not a shard opened
    if fmt != "lmdb":
        assert reader.nonempty("labels").tolist() == read
        assert reader.nonempty("boxes").tolist() == read
    evaluation = DetectionDataset(reader, PILBackend(), keep, seed=0, train=False)
    assert len(evaluation) == len(reader)


def test_a_shard_pack_whose_every_image_has_boxes_keeps_them_all(coco_root, tmp_path):
    """The shortest labels of a shard pack decide: here they hold a box, so every record
    does (no record is taken for empty because its .npy bytes are the shortest)."""
    root = tmp_path / "coco"
    shutil.copytree(coco_root, root)
    source = CocoLayout(str(root)).source("train")
    empty = set(source.ids[source.rows("labels") == 0].tolist())
    path = root / "annotations" / "instances_train.json"
    ann = json.loads(path.read_text())
    ann["images"] = [im for im in ann["images"] if im["id"] not in empty]
    path.write_text(json.dumps(ann))
    reader = opened_split("shards", CocoLayout(str(root)), tmp_path)
    assert empty and len(reader) == len(source) - len(empty)
    assert reader.nonempty("labels").all()
    assert all(len(reader.get(i, "labels")) for i in range(len(reader)))


def test_a_webdataset_manifest_without_box_counts_reads_the_records(coco_root, tmp_path):
    """Manifests written before they held `sizes` (or by hand): the records are read; one
    whose counts do not match its shards is refused where a sample is read."""
    from fastload.errors import StorageError

    layout = CocoLayout(str(coco_root))
    reader = opened_split("webdataset", layout, tmp_path)
    want = DetectionDataset(reader, PILBackend(), keep, seed=0, train=True).indices.tolist()
    path = tmp_path / "webdataset" / "train" / "manifest.json"
    manifest = json.loads(path.read_text())
    sizes = [s.pop("sizes") for s in manifest["shards"]]
    path.write_text(json.dumps(manifest))
    old = opened_split("webdataset", layout, tmp_path)
    assert old.nonempty("labels") is None
    assert DetectionDataset(old, PILBackend(), keep, seed=0, train=True).indices.tolist() == want
    assert old._maps  # the shards were opened to read the labels
    for s, size in zip(manifest["shards"], sizes, strict=True):
        s["sizes"] = size
    first = int(np.flatnonzero(reader.nonempty("labels"))[0])
    k, j = reader.locate(first)
    manifest["shards"][k]["sizes"]["labels"][j] = 0  # wrong: it has boxes
    path.write_text(json.dumps(manifest))
    wrong = opened_split("webdataset", layout, tmp_path)
    assert first not in DetectionDataset(wrong, PILBackend(), keep, seed=0, train=True).indices
    with pytest.raises(StorageError, match="the manifest was not written for these shards"):
        wrong.get(first, "labels")
