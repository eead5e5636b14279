"""ROI decode in backend=turbo: decoding only the crop's region (either region decoder:
fastload's C extension over Pillow's libjpeg-turbo, or nvImageCodec's CPU decoder) gives the
crop the whole-image decode gives, for every JPEG layout and every box position; what cannot
be ROI-decoded takes the whole-image path and is counted, per batch and per epoch.

Bound: the ROI crop equals the whole-image crop exactly (MAX_LEVEL_DIFF = 0): the region is
decoded at the scale of the whole-image decode, so the box maps to the same pixels in it. A
region with no margin around the crop gives a few levels along the crop's edge (the region's
outer columns lack their upsampling neighbour), which this bound catches.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_backends import MIN_PSNR_DB, epoch_counts, psnr

from fastload.data.dataset import sample_rng
from fastload.data.synthetic import render_image
from fastload.data.transforms import RandomResizedCropFlip, resized_crop
from fastload.decode import roi, roi_decoders, roi_libjpeg, roi_nvimgcodec
from fastload.decode.base import open_rgb
from fastload.decode.jpeg_header import dct_scale, jpeg_info
from fastload.decode.pil import PILBackend
from fastload.decode.turbo import TurboBackend
from fastload.errors import ConfigError

MAX_LEVEL_DIFF = 0


@pytest.fixture(params=roi_decoders.KINDS)
def kind(request) -> str:
    """Each region decoder (both are installed by `make setup` here: test_libjpeg_decoder_
    is_built_where_the_machine_can says so for the C extension)."""
    reason = roi_decoders.status()[request.param]
    if reason:
        pytest.skip(f"{request.param}: {reason}")
    return request.param


def jpeg(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


@pytest.fixture(scope="module")
def layouts() -> dict[str, bytes]:
    """Baseline JPEGs of every chroma layout (MCU widths 8, 16, 16, 8), odd sizes (the last
    MCU column and row partial) and restart intervals (per MCU row, every 5 MCUs)."""
    photo = render_image(0, 0, 3, 11, 400, 500)
    odd = render_image(1, 1, 3, 12, 301, 333)
    out = {
        "420": jpeg(photo, subsampling=2),
        "422": jpeg(photo, subsampling=1),
        "444": jpeg(photo, subsampling=0),
        "grayscale": jpeg(photo.convert("L")),
        "odd_420": jpeg(odd, subsampling=2),
        "odd_444": jpeg(odd.crop((0, 0, 299, 201)), subsampling=0),
        "small_odd": jpeg(odd.resize((97, 61)), subsampling=2),
        "restart_rows_420": jpeg(photo, subsampling=2, restart_marker_rows=1),
        "restart_blocks_444": jpeg(odd, subsampling=0, restart_marker_blocks=5),
    }
    assert b"\xff\xdd" in out["restart_rows_420"]  # a DRI segment: restart markers are in
    assert len({jpeg_info(d).width for d in out.values()}) > 2
    return out


def edge_boxes(width: int, height: int) -> list[tuple[int, int, int, int]]:
    """Boxes touching each edge and corner, the whole image, thin and tall ones, and ones
    whose left edge sits just right of an MCU boundary."""
    w, h = max(8, width // 3), max(8, height // 3)
    r, b = width - w, height - h
    return [
        (0, 0, width, height),
        (0, 0, w, h),
        (r, 0, w, h),
        (0, b, w, h),
        (r, b, w, h),
        (r // 2, 0, w, height),
        (0, b // 2, width, h),
        (17, 9, w, h),
        (33, 41, max(8, width // 8), height - 41),
        (width - 9, height - 9, 9, 9),
    ]


def compare(backend, whole, data, box, flip, size):
    """(ROI crop, whole-image crop, PIL reference crop) for one box, both decodes at full
    size."""
    info = jpeg_info(data)
    region, local_box = backend._decode_roi(data, info, box, size)
    got = backend._resized_crop(region, local_box, size, flip)
    t = RandomResizedCropFlip(size)
    want = whole._load_whole(data, info, box, flip, t, 1)
    pil = np.asarray(resized_crop(open_rgb(data), box, size, flip), dtype=np.uint8)
    return got, want, pil


@pytest.mark.parametrize("size", [224, 48])
def test_roi_crop_matches_whole_image_crop_on_every_layout_and_edge(kind, layouts, size):
    roi_on, whole = TurboBackend(roi=kind), TurboBackend(roi="off")
    checked = 0
    for name, data in layouts.items():
        info = jpeg_info(data)
        boxes = edge_boxes(info.width, info.height)
        rng = np.random.default_rng(7)
        t = RandomResizedCropFlip(size)
        boxes += [t.sample(info.width, info.height, rng)[0] for _ in range(12)]
        for k, box in enumerate(boxes):
            flip = bool(k % 2)
            got, want, pil = compare(roi_on, whole, data, box, flip, size)
            assert got.shape == want.shape == (size, size, 3), (name, box)
            diff = int(np.abs(got.astype(int) - want).max())
            assert diff <= MAX_LEVEL_DIFF, (name, box, flip, diff)
            assert psnr(got, pil) >= MIN_PSNR_DB, (name, box, psnr(got, pil))
            checked += 1
    counts = roi_on.pop_counts()
    assert counts["decode_roi"] == checked


@pytest.mark.parametrize("size", [112, 40])  # DCT scales 1/2, and up to 1/8
def test_boxes_twice_the_output_decode_dct_scaled(kind, layouts, size):
    """A box >= 2x the output both ways decodes at 1/s: a region at 1/s with the libjpeg
    decoder, the whole image at 1/s (simplejpeg) with nvImageCodec, which cannot DCT-scale.
    Either way counted as DCT-scaled, not as a fallback; the same pixels as roi=off."""
    roi_on, whole = TurboBackend(roi=kind), TurboBackend(roi="off")
    t = RandomResizedCropFlip(size)
    scaled = regions = 0
    scales = set()
    for seed in range(40):
        for data in (layouts["420"], layouts["444"]):
            info = jpeg_info(data)
            box, _ = t.sample(info.width, info.height, sample_rng(0, 0, seed))
            scales.add(dct_scale(box, size))
            scaled += dct_scale(box, size) > 1
            regions += dct_scale(box, size) == 1
            got = roi_on.load(data, t, sample_rng(0, 0, seed))
            assert np.array_equal(got, whole.load(data, t, sample_rng(0, 0, seed)))
    counts = roi_on.pop_counts()
    assert scaled > 0 and (regions > 0 or size < 56)  # at 40 px every box is >= 2x
    assert size > 100 or max(scales) >= 4, scales
    assert counts["decode_dct_scaled"] == scaled
    assert counts["decode_roi"] == regions + (scaled if kind == "libjpeg" else 0)
    assert sum(v for k, v in counts.items() if "fallback" in k) == 0


def test_region_is_aligned_inside_and_covers_the_crop():
    for mcu in (8, 16, 32):
        for box in [(0, 0, 500, 400), (123, 45, 200, 150), (480, 380, 20, 20), (7, 0, 9, 400)]:
            (x, y, w, h), (lx, ly, lw, lh) = roi.region_for(box, 500, 400, 32, mcu)
            assert x % mcu == 0 and x >= 0 and y >= 0, (box, mcu)
            assert x + w <= 500 and y + h <= 400, (box, mcu)
            assert lx >= 0 and ly >= 0 and lx + lw <= w and ly + lh <= h, (box, mcu)
            assert (lw, lh) == (box[2], box[3])


def test_progressive_takes_the_whole_image_path_counted(kind, layouts):
    photo = render_image(0, 0, 3, 11, 400, 500)
    data = jpeg(photo, progressive=True)
    roi_on, whole = TurboBackend(roi=kind), TurboBackend(roi="off")
    for seed in range(4):
        t = RandomResizedCropFlip(224)
        got = roi_on.load(data, t, sample_rng(0, 0, seed))
        want = whole.load(data, t, sample_rng(0, 0, seed))
        assert np.array_equal(got, want)
    counts = roi_on.pop_counts()
    assert counts["decode_roi_fallback_progressive"] == 4 and counts["decode_roi"] == 0


def test_roi_error_falls_back_to_the_whole_image_with_the_same_box(kind, layouts, monkeypatch):
    roi_on, whole = TurboBackend(roi=kind), TurboBackend(roi="off")

    def broken(*a, **k):
        raise roi.RoiDecodeError("region (0, 0, 8, 8): nvImageCodec could not decode it")

    monkeypatch.setattr(roi_on.roi, "region", broken)
    t = RandomResizedCropFlip(224)
    got = roi_on.load(layouts["420"], t, sample_rng(0, 0, 5))
    assert np.array_equal(got, whole.load(layouts["420"], t, sample_rng(0, 0, 5)))
    counts = roi_on.pop_counts()
    assert counts["decode_roi_fallback_error"] == 1 and counts["decode_roi"] == 0


def test_truncated_jpeg_fails_as_the_whole_image_path_does(kind, layouts):
    """A damaged file reaches the dataset's skip_corrupt handling with PIL's error, for
    every crop: a region decode stops reading below its box, so crops above the cut decoded
    (a file cut at 80 %: 9 of 40 draws) and the rest failed, the file trained on now and
    then or the run stopped epochs in. A file cut short goes to PIL, counted."""
    for cut in (0.5, 0.8, 0.95):
        data = layouts["420"][: int(len(layouts["420"]) * cut)]
        roi_on, reference = TurboBackend(roi=kind), PILBackend()
        for seed in range(40):
            with pytest.raises(OSError, match="truncated") as got:
                roi_on.load(data, RandomResizedCropFlip(224), sample_rng(0, 0, seed))
            with pytest.raises(OSError) as want:
                reference.load(data, RandomResizedCropFlip(224), sample_rng(0, 0, seed))
            assert str(got.value) == str(want.value)
        with pytest.raises(OSError, match="truncated"):
            roi_on.decode_rgb(data)  # a whole-image decode (detection) alike
        assert roi_on.pop_counts()["decode_fallback_unterminated"] == 41
    padded = layouts["420"] + b"\x00" * 64  # bytes after the end marker are no damage
    roi_on = TurboBackend(roi=kind)
    roi_on.load(padded, RandomResizedCropFlip(224), sample_rng(0, 0, 1))
    counts = roi_on.pop_counts()
    assert counts["decode_roi"] == 1 and counts["decode_fallback_unterminated"] == 0


def test_missing_library_auto_counts_and_on_says_how_to_install(layouts, monkeypatch):
    for module, reason in [
        (roi_libjpeg, roi_libjpeg.BUILD_HINT),
        (roi_nvimgcodec, "nvImageCodec is not installed: pip install nvidia-nvimgcodec-cu13"),
    ]:
        monkeypatch.setattr(module, "load", lambda: None)
        monkeypatch.setattr(module, "UNAVAILABLE_REASON", reason)
    with pytest.raises(ConfigError, match="backend.roi=on: libjpeg: .*apt-get install gcc "
                       "libjpeg62-turbo-dev.*; nvimgcodec: .*pip install nvidia"):  # fmt: skip
        TurboBackend(roi="on")
    with pytest.raises(ConfigError, match="backend.roi=libjpeg: libjpeg: .*not built"):
        TurboBackend(roi="libjpeg")
    with pytest.raises(ConfigError, match="backend.roi='sometimes': use one of auto, on, off"):
        TurboBackend(roi="sometimes")
    auto = TurboBackend(roi="auto")
    assert auto.roi is None and "no ROI: libjpeg: " in auto.info()["decoder"]
    auto.load(layouts["420"], RandomResizedCropFlip(224), sample_rng(0, 0, 1))
    assert auto.pop_counts()["decode_roi_fallback_no_library"] == 1
    off = TurboBackend(roi="off")
    off.load(layouts["420"], RandomResizedCropFlip(224), sample_rng(0, 0, 1))
    assert off.pop_counts()["decode_roi_fallback_no_library"] == 0  # asked for nothing


def test_roi_counts_reach_the_batches_through_worker_processes(kind, layouts):
    """ROI decodes and their fallbacks travel worker -> collate -> batch["counts"], which the
    engine sums into every epoch row like the other decode counters."""
    progressive = jpeg(render_image(0, 0, 3, 11, 200, 240), progressive=True)
    items = [(k, d) for k, d in layouts.items()] * 2 + [("progressive", progressive)] * 3
    totals = epoch_counts(items, TurboBackend(roi=kind), size=224)
    assert totals["decode_roi"] + totals["decode_whole_tall"] == 2 * len(layouts)
    assert totals["decode_roi"] > 0
    assert totals["decode_roi_fallback_progressive"] == 3
    assert totals["decode_roi_fallback_error"] == totals["decode_roi_fallback_no_library"] == 0


def test_roi_batches_resize_into_the_batch_slot_with_the_items_pixels(kind, layouts, monkeypatch):
    """The loader's batch path over JPEGs (`load_batch`): ROI-decoded samples come back as
    the region (`PendingCrop`) that collate resizes into the batch slot; the batch equals the
    per-item samples collated, bit for bit, fallbacks (progressive) included."""
    from test_backends import BytesStorage
    from test_storage import collate_in_worker_slot

    from fastload.data.batch import collate
    from fastload.data.dataset import ImageDataset, PendingCrop

    progressive = jpeg(render_image(0, 0, 3, 11, 200, 240), progressive=True)
    items_in = list(layouts.items()) + [("progressive", progressive)]
    ds = ImageDataset(
        BytesStorage(items_in), TurboBackend(roi=kind), RandomResizedCropFlip(224), seed=3
    )
    keys = [(e, i) for e in (1, 2) for i in range(len(items_in))]
    items = [ds[k] for k in keys]
    lazy = ds.load_batch(keys)
    kinds = [type(s[0]).__name__ for s in lazy]
    counts = collate(ds.load_batch(keys))["counts"]
    # the region decodes come back pending; the progressive and the tall boxes finished
    assert kinds.count("PendingCrop") == counts["decode_roi"] > 0
    assert not isinstance(lazy[len(layouts)][0], PendingCrop)
    want = collate(items)
    assert torch.equal(collate(lazy)["image"], want["image"])
    assert torch.equal(collate_in_worker_slot(ds.load_batch(keys), monkeypatch), want["image"])
    assert counts["decode_roi"] + counts["decode_whole_tall"] == 2 * len(layouts)
    assert counts["decode_roi_fallback_progressive"] == 2


def test_fast_idct_and_upsampling_apply_to_regions_too(kind, layouts):
    """backend.fastdct / fastupsample change the region decode as they change the whole-image
    one (libjpeg-turbo's fast integer IDCT, merged upsampling): the same crop as roi=off with
    the same options, and not the accurate crop."""
    data = layouts["420"]
    info = jpeg_info(data)
    for options in ({"fastupsample": True}, {"fastdct": True}):
        fast, whole = TurboBackend(roi=kind, **options), TurboBackend(roi="off", **options)
        accurate = TurboBackend(roi=kind)
        differs = 0
        for k, box in enumerate(edge_boxes(info.width, info.height)):
            got, want, _ = compare(fast, whole, data, box, bool(k % 2), 224)
            assert np.array_equal(got, want), (options, box)
            differs += not np.array_equal(got, compare(accurate, whole, data, box, k % 2, 224)[0])
        assert differs > 0, options  # the option reached the decoder


def test_nvimgcodec_tall_boxes_decode_whole_wide_ones_whole_rows_narrow_ones_a_region(layouts):
    """Which boxes get a region with nvImageCodec, and which one (roi_nvimgcodec.py's
    measured rule): a box spanning TALL_SHARE of the rows decodes the whole image (counted
    decode_whole_tall); a region at least BAND_SHARE of the width becomes whole rows; a
    narrow one starts on an iMCU boundary. Every way gives the roi=off crop."""
    if roi_decoders.status()["nvimgcodec"]:
        pytest.skip(roi_decoders.status()["nvimgcodec"])
    data = layouts["420"]  # 500 x 400
    roi_on, whole = TurboBackend(roi="nvimgcodec"), TurboBackend(roi="off")
    t = RandomResizedCropFlip(224)
    tall, wide, narrow = (50, 10, 120, 380), (40, 100, 400, 150), (300, 100, 100, 150)
    band = roi_nvimgcodec.BAND_SHARE
    assert not roi.worth_a_region(tall, 400, 224, roi_nvimgcodec.TALL_SHARE)
    assert roi.region_for(wide, 500, 400, 224, 16, band)[0][::2] == (0, 500)  # x, width
    (x, _, w, _), _ = roi.region_for(narrow, 500, 400, 224, 16, band)
    assert x % 16 == 0 and 0 < x and x + w < 500 and w < band * 500
    for box in (tall, wide, narrow):
        got = roi_on._region_or_crop(data, jpeg_info(data), box, True, t)
        if isinstance(got, tuple):
            got = roi_on._resized_crop(got[0], got[1], 224, got[2])
        want = whole._region_or_crop(data, jpeg_info(data), box, True, t)
        assert np.array_equal(got, want), box
    counts = roi_on.pop_counts()
    assert counts["decode_whole_tall"] == 1 and counts["decode_roi"] == 2


def test_libjpeg_decodes_every_box_as_an_aligned_region(layouts):
    """The libjpeg decoder has no per-call set-up or copies to amortise: tall and wide boxes
    decode as regions too, starting on an iMCU boundary, no wider than the box needs."""
    if roi_decoders.status()["libjpeg"]:
        pytest.skip(roi_decoders.status()["libjpeg"])
    data = layouts["420"]  # iMCU 16 px wide
    width, height = jpeg_info(data).width, jpeg_info(data).height
    dec = roi_libjpeg.Decoder()
    tall, wide, narrow = (50, 10, 120, height - 20), (30, 100, width - 60, 150), (200, 100, 90, 150)
    for box in [tall, wide, narrow, (0, 0, width, height)]:
        pixels, (lx, ly, lw, lh) = dec.region(data, width, height, box, 224)
        x, y = box[0] - lx, box[1] - ly
        assert x % 16 == 0 and box[0] - x < 16 + 4 and y <= box[1], box
        assert pixels.shape[1] <= box[2] + 16 + 8 and pixels.shape[0] <= box[3] + 8, box
        assert lx + lw <= pixels.shape[1] and ly + lh <= pixels.shape[0], box
        assert pixels.flags.c_contiguous and pixels.dtype == np.uint8
    backend = TurboBackend(roi="libjpeg")
    backend.load(data, RandomResizedCropFlip(224), sample_rng(0, 0, 1))
    assert backend.pop_counts()["decode_whole_tall"] == 0


def test_libjpeg_warnings_are_errors_and_print_nothing(layouts, capfd):
    """libjpeg's warnings about damaged data end a region decode as an error naming the
    problem (the file then takes the whole-image path, which names it); nothing reaches the
    process's stderr (libjpeg's default handler prints them and returns a grey image)."""
    if roi_decoders.status()["libjpeg"]:
        pytest.skip(roi_decoders.status()["libjpeg"])
    dec = roi_libjpeg.Decoder()
    info = jpeg_info(layouts["444"])
    w, h = info.width, info.height
    data = bytearray(layouts["444"])
    data[len(data) // 2 : len(data) // 2 + 40] = b"\xff\xd9" * 20  # an EOI in the scan
    with pytest.raises(roi.RoiDecodeError, match="(?i)corrupt|premature|marker"):
        dec.region(bytes(data), w, h, (0, h // 2, w // 2, h // 2 - 10), 224)
    with pytest.raises(roi.RoiDecodeError, match="Not a JPEG"):
        dec.region(b"GIF89a" + bytes(100), w, h, (0, 0, 100, 100), 224)
    with pytest.raises(roi.RoiDecodeError, match=f"decoded {w}x{h} at 1/1, header {w + 1}x{h}"):
        dec.region(layouts["444"], w + 1, h, (0, 0, 100, 100), 224)
    assert capfd.readouterr().err == ""


def test_libjpeg_refuses_an_old_or_pre_release_library(monkeypatch):
    """Only a libjpeg-turbo release >= 3.0.0 is bound: libjpeg-turbo numbers its betas
    x.y.9x (the 3.0 beta reported 2.1.92), and 2.x is no longer maintained."""
    from PIL import features

    real = features.version
    for version in ("2.1.92", "2.1.5", "3.2.90"):
        monkeypatch.setattr(
            features, "version", lambda f, v=version: v if f == "libjpeg_turbo" else real(f)
        )
        with pytest.raises(ImportError, match=f"libjpeg-turbo is {version}, not a release >= 3"):
            roi_libjpeg.pillow_libjpeg()
    # a patch release with a fourth number (Pillow 12.3 ships 3.1.4.1) is a release
    monkeypatch.setattr(
        features, "version", lambda f: "3.1.4.1" if f == "libjpeg_turbo" else real(f)
    )
    assert roi_libjpeg.pillow_libjpeg()[1] == "3.1.4.1"
    monkeypatch.setattr(features, "version", real)
    path, version = roi_libjpeg.pillow_libjpeg()
    assert ".so.62" in path and version >= "3"


def test_libjpeg_decoder_is_built_where_the_machine_can():
    """`pip install -e .` builds the C extension wherever a C compiler and libjpeg's headers
    are present (the extension is optional, so a failed build would otherwise go unnoticed)."""
    import shutil
    import sysconfig

    headers = [p for p in ("/usr/include/jpeglib.h", "/usr/local/include/jpeglib.h")]
    python_h = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not (shutil.which("cc") and any(map(os.path.exists, headers)) and python_h.exists()):
        pytest.skip("no C compiler, jpeglib.h or Python.h here")
    assert roi_decoders.status()["libjpeg"] == ""
