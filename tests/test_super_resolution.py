"""dataset=div2k, model=srcnn: aligned patch pairs, the stores agree, PSNR, clear errors, and
short CPU runs that learn (fastload/data/pairs.py, fastload/tasks/super_resolution.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, compose_config, run_train
from PIL import Image

from fastload.data import rawimage
from fastload.data.layouts import Div2kLayout
from fastload.data.pairs import PairDataset, bicubic_down, check_pair_size, collate_pairs
from fastload.data.synthetic_div2k import ensure_synthetic_div2k
from fastload.decode.base import open_rgb
from fastload.decode.pil import PILBackend
from fastload.errors import ConfigError, DatasetError
from fastload.storage.disk import DiskStorage
from fastload.storage.lmdb_store import LmdbReader, LmdbStorage
from fastload.storage.packing import stale_reason
from fastload.storage.shards import ShardStorage
from fastload.tasks.base import build_task
from fastload.tasks.super_resolution import PSNR_CAP_DB, psnr
from tests.helpers import sample

SPLITS = ["train", "valid"]


@pytest.fixture(scope="module")
def div2k(tmp_path_factory):
    """A tiny synthetic DIV2K (x2): 4 train + 2 valid pairs of ~100 px, PNG."""
    root = tmp_path_factory.mktemp("sr") / "div2k"
    return ensure_synthetic_div2k(
        root, train_count=4, val_count=2, min_long_side=96, max_long_side=128, workers=1,
        progress=False,
    )  # fmt: skip


def pair_dataset(reader, train=True, patch=16, repeat=2):
    return PairDataset(
        reader, PILBackend(), scale=2, patch_size=patch, train=train, seed=0, repeat=repeat
    )


def open_split(storage, root, split="train", lr="DIV2K_{split}_LR_bicubic/X{scale}"):
    layout = Div2kLayout(str(root), lr=lr)
    storage.prepare(layout, SPLITS)
    return storage.open(layout, split)


def interior_error(a: torch.Tensor, b: torch.Tensor, border: int = 2) -> float:
    """Mean absolute difference (grey levels) away from the patch edges, where a patch-level
    bicubic downscale cannot see the pixels outside the patch."""
    a, b = (
        a.float()[:, border:-border, border:-border],
        b.float()[:, border:-border, border:-border],
    )
    return (a - b).abs().mean().item()


# -- patches -----------------------------------------------------------------------------------


def test_patches_are_aligned_and_generated_lr_matches_stored(div2k):
    stored = pair_dataset(open_split(DiskStorage(), div2k))
    generated = pair_dataset(open_split(DiskStorage(), div2k, lr=None))
    assert stored.paired and not generated.paired
    for key in [(0, 0), (0, 3), (1, 5), (2, 7)]:
        lr, hr = stored[key]
        assert lr.shape == (3, 16, 16) and hr.shape == (3, 32, 32) and hr.dtype == torch.uint8
        # the stored LR patch is the bicubic downscale of the HR patch at the same place
        down = torch.from_numpy(np.array(bicubic_down(hr.permute(1, 2, 0).numpy(), 2))).permute(
            2, 0, 1
        )
        assert interior_error(down, lr) < 2.0
        # ... and one LR pixel off it is far worse: the pair really is aligned
        assert interior_error(down[:, :, 1:], lr[:, :, :-1]) > 2 * interior_error(down, lr)
        # generated LR: the same draw gives the same HR patch and ~the same LR patch
        lr_gen, hr_gen = generated[key]
        assert torch.equal(hr_gen, hr)
        assert interior_error(lr_gen, lr) < 2.0


def test_train_patches_vary_val_patches_are_fixed(div2k):
    train = pair_dataset(open_split(DiskStorage(), div2k))
    assert len(train) == 8  # 4 images x repeat 2
    assert not torch.equal(train[(0, 0)][1], train[(1, 0)][1])  # another epoch, another patch
    assert torch.equal(train[(0, 0)][1], train[(0, 0)][1])  # the key decides the patch
    val = pair_dataset(open_split(DiskStorage(), div2k, "valid"), train=False, repeat=1)
    assert torch.equal(val[(0, 1)][1], val[(5, 1)][1])  # the centre patch, every epoch
    batch = collate_pairs([val[(0, 0)], val[(0, 1)]])
    assert batch["image"].shape == (2, 3, 16, 16) and batch["target"].shape == (2, 3, 32, 32)
    assert batch["target"].dtype == torch.uint8 and batch["skipped"] == 0


def test_pair_sizes_follow_div2k_rounding():
    check_pair_size((101, 75), (50, 37), 2, "hr.png", "lrx2.png")  # floor (DIV2K, Pillow)
    check_pair_size((101, 75), (51, 38), 2, "hr.png", "lrx2.png")  # ceil (MATLAB imresize)
    with pytest.raises(DatasetError, match="lrx2.png is 37x50 px but its HR image hr.png"):
        check_pair_size((101, 75), (50, 37), 3, "hr.png", "lrx2.png")


# -- the stores agree ----------------------------------------------------------------------------


def test_png_folder_lmdb_lz4_and_raw_shards_give_the_same_samples(div2k, tmp_path):
    stores = {
        "disk": DiskStorage(),
        "lmdb-lz4": LmdbStorage(path=tmp_path / "lmdb", kind="raw", compression="lz4"),
        "lmdb-png": LmdbStorage(path=tmp_path / "lmdb-png"),
        "shards-raw": ShardStorage(path=tmp_path / "shards", kind="raw", size=None),
    }
    for split, train in (("train", True), ("valid", False)):
        readers = {name: open_split(s, div2k, split) for name, s in stores.items()}
        assert rawimage.is_raw(readers["shards-raw"].get(0, "image"))
        assert rawimage.is_raw(readers["lmdb-lz4"].get(0, "lr"))
        sets = {name: pair_dataset(r, train=train) for name, r in readers.items()}
        for key in [(0, i) for i in range(len(sets["disk"]))] + [(3, 1)]:
            want = sets["disk"][key]
            for name, ds in sets.items():
                got = ds[key]
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (name, key)


@pytest.mark.parametrize("kind", ["raw", "jpeg"])
def test_a_resized_pair_stays_exactly_scale_apart(div2k, tmp_path, kind):
    """Packed smaller (raw size / jpeg max_side 61: not a multiple of the scale), every LR
    image is exactly its HR image's size / 2, and it is the HR's bicubic downscale on the
    same grid, to the far edge. Resizing each to its own longer side rounded their sides
    apart (one pixel in some pairs), shifting the grids apart towards that edge. A pack of
    pairs from before is re-packed."""

    def pixels(data):
        return rawimage.pixels(data) if rawimage.is_raw(data) else np.asarray(open_rgb(data))

    opts = {"size": 61} if kind == "raw" else {"max_side": 61, "quality": 100}
    store = ShardStorage(path=tmp_path / "p", kind=kind, **opts)
    reader = open_split(store, div2k)
    for i in range(len(reader)):
        hr, lr = (pixels(reader.get(i, f)) for f in ("image", "lr"))
        assert max(hr.shape[:2]) <= 61 and hr.shape[:2] == (2 * lr.shape[0], 2 * lr.shape[1])
        # grey levels; Lanczos-resized grainy images, so not 0 (4.5 at most here; a pair one
        # pixel apart at the far edge: 8.8, one LR pixel apart throughout: 11-19)
        down = torch.from_numpy(np.array(bicubic_down(hr, 2))).permute(2, 0, 1)
        assert interior_error(down, torch.from_numpy(lr.copy()).permute(2, 0, 1)) < 6.0, i
    sidecar = tmp_path / "p" / "train" / "fastload-pack.json"
    record = json.loads(sidecar.read_text())
    del record["params"]["pairs_exact"]
    sidecar.write_text(json.dumps(record))
    reason = stale_reason(lambda: Div2kLayout(str(div2k)).source("train"), tmp_path / "p" / "train",
                          store.pack_options())  # fmt: skip
    assert reason and "pairs apart" in reason


def smooth_div2k(root, n=3, scale=2):
    """Flat colour steps (what lz4 can compress; the photo-like default's grain is not), with
    bicubic LR images."""
    hr_dir, lr_dir = root / "DIV2K_train_HR", root / "DIV2K_train_LR_bicubic" / f"X{scale}"
    hr_dir.mkdir(parents=True)
    lr_dir.mkdir(parents=True)
    y, x = np.mgrid[0:80, 0:120]
    for i in range(1, n + 1):
        img = np.stack([x // 16 * 40, y // 16 * 50, np.full_like(x, 40 * i)], -1).astype(np.uint8)
        img[20:50, 30:70] = (200, 30 * i, 10)
        Image.fromarray(img).save(hr_dir / f"{i:04d}.png")
        lr = bicubic_down(img, scale)
        Image.fromarray(lr).save(lr_dir / f"{i:04d}x{scale}.png")
    return root


def test_lmdb_lz4_values_are_compressed_and_read_back_exactly(tmp_path):
    root = smooth_div2k(tmp_path / "smooth")
    layout = Div2kLayout(str(root))
    plain = LmdbStorage(path=tmp_path / "plain", kind="raw")
    lz4 = LmdbStorage(path=tmp_path / "lz4", kind="raw", compression="lz4")
    for store in (plain, lz4):
        store.prepare(layout, ["train"])
    a, b = plain.open(layout, "train"), lz4.open(layout, "train")
    assert b.meta["compression"] == "lz4" and a.meta["compression"] is None
    assert b.meta["stored_bytes"] < 0.5 * b.meta["record_bytes"] == 0.5 * a.meta["stored_bytes"]
    mdb = [(tmp_path / p / "train" / "data.mdb").stat().st_size for p in ("plain", "lz4")]
    assert mdb[1] < mdb[0], mdb
    for i in range(3):
        assert sample(b, i) == sample(a, i) and b.get(i, "lr") == a.get(i, "lr")
    # a pack made without lz4 is not reused by a run that asks for it (re-packed instead)
    reason = stale_reason(lambda: layout.source("train"), tmp_path / "plain" / "train",
                          lz4.pack_options())  # fmt: skip
    assert reason and "compression" in reason


def test_lmdb_lz4_without_the_package_is_refused_naming_it(tmp_path, monkeypatch):
    from fastload.errors import StorageError

    monkeypatch.setitem(sys.modules, "lz4", None)  # `import lz4.block` raises ImportError
    monkeypatch.setitem(sys.modules, "lz4.block", None)
    with pytest.raises(StorageError, match=r"pip install lz4.*storage.compression=null"):
        LmdbStorage(path=tmp_path / "lz4", kind="raw", compression="lz4")
    assert not (tmp_path / "lz4").exists()  # refused before any packing


def test_lmdb_lz4_damage_is_reported_by_read_and_verify(tmp_path, capsys):
    import lmdb

    from fastload.pack import main as pack_main

    root = smooth_div2k(tmp_path / "smooth", n=2)
    layout = Div2kLayout(str(root))
    store = LmdbStorage(path=tmp_path / "lz4", kind="raw", compression="lz4")
    store.prepare(layout, ["train"])
    split = tmp_path / "lz4" / "train"
    env = lmdb.open(str(split), subdir=True)
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(b"0000000001.image"))
        value[-5] ^= 0xFF  # a flipped byte inside the compressed block
        txn.put(b"0000000001.image", bytes(value))
    env.close()
    with pytest.raises(Exception, match="corrupt record"):
        LmdbReader(split).get(1, "image")
    assert pack_main(["verify", str(split)]) == 1
    assert "record 1 (image" in capsys.readouterr().err


# -- PSNR ----------------------------------------------------------------------------------------


def test_psnr_formula_cap_border_and_luma():
    target = torch.full((2, 3, 16, 16), 0.5)
    assert psnr(target, target).tolist() == [PSNR_CAP_DB, PSNR_CAP_DB]  # identical: capped
    noise = torch.from_numpy(np.random.default_rng(0).normal(0, 0.05, (2, 3, 16, 16))).float()
    got = psnr(target + noise, target)
    want = 10 * torch.log10(1 / noise.double().pow(2).flatten(1).mean(1))
    assert torch.allclose(got, want, atol=1e-6)
    # border: an error only in the outer 2 pixels is cropped away
    edge = target.clone()
    edge[..., :2, :] = 0.0
    assert psnr(edge, target, border=2).tolist() == [PSNR_CAP_DB] * 2 and psnr(edge, target)[0] < 30
    # luma: a chroma-only change (R up, G down, Y kept) is invisible on Y
    wy = torch.tensor([65.481, 128.553, 24.966])
    shift = torch.zeros(1, 3, 8, 8)
    shift[:, 0], shift[:, 1] = 0.1, -0.1 * wy[0] / wy[1]
    assert psnr(0.5 + shift, torch.full((1, 3, 8, 8), 0.5), y_only=True)[0] > 90


# -- configuration and errors ------------------------------------------------------------------


def test_a_classification_model_for_div2k_is_refused_with_the_fix(tmp_path):
    cfg = compose_config(["dataset=div2k", "model=resnet18", f"hydra.run.dir={tmp_path}"],
                         tmp_path)  # fmt: skip
    with pytest.raises(ConfigError, match=r"classification model.*super_resolution.*srcnn"):
        build_task(cfg).build_model(cfg)
    cfg = compose_config(["dataset=div2k", f"hydra.run.dir={tmp_path}"], tmp_path)  # its own
    model = build_task(cfg).build_model(cfg)
    assert model(torch.rand(1, 3, 8, 8)).shape == (1, 3, 16, 16)
    cfg = compose_config(["model=srcnn", f"hydra.run.dir={tmp_path}"], tmp_path)
    with pytest.raises(ConfigError, match="dataset=synthetic trains classification|srcnn"):
        build_task(cfg).build_model(cfg)


def sr_args(root, run_dir, *extra):
    return [
        "dataset=div2k",
        "model=srcnn",
        "optim=adam",
        "debug=fast",
        "trainer.device=cpu",
        "trainer.progress=false",
        f"dataset.root={root}",
        f"hydra.run.dir={run_dir}",
        f"output_root={run_dir.parent}",
        *extra,
    ]


def test_lr_hr_size_mismatch_is_one_line_naming_the_file(div2k, tmp_path):
    root = tmp_path / "bad"
    shutil.copytree(div2k, root)
    lr = root / "DIV2K_train_LR_bicubic" / "X2" / "0002x2.png"
    img = Image.open(lr)
    img.resize((img.width - 3, img.height)).save(lr)  # not HR / 2 any more
    out = run_train(sr_args(root, tmp_path / "run", "dataset.prepare=null"))
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert str(lr) in lines[0] and "0002.png" in lines[0] and "dataset.scale" in lines[0]


def test_short_cpu_run_learns_and_reports_psnr(tmp_path):
    run_dir = tmp_path / "run"
    # with the EMA of the weights, evaluated beside the model
    out = run_train(sr_args(tmp_path / "data", run_dir, "trainer.epochs=3", "logger=none",
                            "trainer.ema.decay=0.5"))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    for key in ("train_loss", "train_psnr", "val_loss", "val_psnr", "val_psnr_bicubic",
                "ema_val_psnr", "ema_val_loss"):  # fmt: skip
        assert all(np.isfinite(r[key]) for r in rows), key
    assert rows[-1]["val_loss"] < rows[0]["val_loss"]
    assert rows[-1]["val_psnr"] > rows[0]["val_psnr"]
    assert all(r["images_per_s"] > 0 and 0 <= r["data_wait_share"] < 1 for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["metric"] == "val_psnr" and summary["best_psnr"] == max(
        r["val_psnr"] for r in rows
    )
    assert summary["best_ema_psnr"] == max(r["ema_val_psnr"] for r in rows)
    assert rows[-1]["ema_val_psnr"] != rows[-1]["val_psnr"]
    assert "best PSNR" in out.stdout and " dB" in out.stdout and "best PSNR (EMA)" in out.stdout


@pytest.mark.slow
def test_srcnn_beats_bicubic_on_the_builtin_dataset(tmp_path):
    """The synthetic default (64 + 16 pairs), 6 epochs x 32 steps of 16 LR 16-px patches on
    the CPU (~2.5 min on 2 cores; measured 34.02 dB vs bicubic 33.13 dB)."""
    run_dir = tmp_path / "run"
    args = sr_args(tmp_path / "data", run_dir, "trainer.epochs=6", "logger=none")
    args = [a for a in args if a != "debug=fast"]
    args += ["dataset.repeat=8", "dataset.patch_size=16", "trainer.batch_size=16"]
    out = run_train(args, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["val_psnr"] > rows[-1]["val_psnr_bicubic"] + 0.5, rows[-1]


@pytest.mark.slow
def test_two_process_ddp_super_resolution_on_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(REPO / "train.py"),
        *sr_args(tmp_path / "data", tmp_path / "unused"),
        "name=sr",
    ]
    cmd = [a for a in cmd if not a.startswith(("hydra.run.dir", "output_root"))]
    out = subprocess.run([*cmd, f"output_root={tmp_path / 'out'}"], capture_output=True,
                         text=True, timeout=600, env={**env, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (summary,) = (tmp_path / "out" / "sr").glob("*/summary.json")
    rows = [json.loads(x) for x in (summary.parent / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["world_size"] == 2 and np.isfinite(rows[-1]["val_psnr"])


def test_a_pack_that_resizes_or_re_encodes_the_pairs_is_said(tmp_path, caplog):
    """storage=shards storage.kind=raw keeps 256 px unless storage.size=null: every PSNR
    moved (33.4 -> 31.2 dB on the same pairs) without a word."""
    import logging

    cfg = compose_config(["dataset=div2k", f"hydra.run.dir={tmp_path}"], tmp_path)
    task = build_task(cfg)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        task.check_storage(ShardStorage(path=tmp_path / "p", kind="raw", size=256))
        assert "storage.size=256 resizes the super-resolution pairs" in caplog.text
        caplog.clear()
        task.check_storage(LmdbStorage(path=tmp_path / "l", max_side=1024))
        assert "storage.max_side=1024 resizes and re-encodes (JPEG)" in caplog.text
        caplog.clear()
        for kept in (ShardStorage(path=tmp_path / "q", kind="raw", size=None),
                     LmdbStorage(path=tmp_path / "m"), DiskStorage()):  # fmt: skip
            task.check_storage(kept)
        assert caplog.text == ""


def test_the_bicubic_baseline_is_of_the_exact_8_bit_lr_under_a_bf16_input(tmp_path):
    """loader.input_dtype=bf16 rounds the LR patch a little; the baseline upsampled that
    (31.945 dB against 31.934 from the same pixels in fp32)."""
    from fastload.dist import DistContext
    from fastload.tasks.super_resolution import SRStep
    from fastload.train_state import TrainState

    cfg = compose_config(["dataset=div2k", f"hydra.run.dir={tmp_path}"], tmp_path)
    state = TrainState.create(cfg, torch.device("cpu"), 1, 1, amp=None, channels_last=False,
                              model=build_task(cfg).build_model(cfg))  # fmt: skip
    step = SRStep(state, cfg, DistContext(), torch.bfloat16)  # the model under bf16 autocast
    g = torch.Generator().manual_seed(0)
    lr8 = torch.randint(0, 256, (2, 3, 16, 16), generator=g)
    hr = torch.randint(0, 256, (2, 3, 32, 32), generator=g, dtype=torch.uint8)
    sums = [step.eval_sums(state.model, {"image": (lr8 / 255).to(dtype), "target": hr})
            for dtype in (torch.float32, torch.bfloat16)]  # fmt: skip
    assert sums[0][2].item() == sums[1][2].item()  # the bicubic PSNR sum
