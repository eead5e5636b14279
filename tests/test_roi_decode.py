"""ROI decode in backend=turbo (issue 16): decoding only the crop's region gives the crop the
whole-image decode gives, for every JPEG layout and every box position; what cannot be
ROI-decoded takes the whole-image path and is counted, per batch and per epoch.

Bound: the ROI crop equals the whole-image crop exactly for whole-pixel boxes (no DCT
downscale); with a DCT downscale the box is sub-pixel and the warp's origin moves by the
region offset, so floating-point rounding may change a pixel by one level (measured: 1 pixel
in 400 crops at 224, none at 64). MAX_LEVEL_DIFF = 1 catches region errors: a region with
no margin around the crop gives 3 levels along the crop's edge (the region's outer columns
lack their upsampling neighbour); an unaligned region is refused by TurboJPEG and shows up
as a fallback instead of a `decode_roi` count. (The margin is kx + 2 pixels; kx + 0 still
passes here, so the margin has a pixel or two to spare.)
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from test_backends import MIN_PSNR_DB, epoch_counts, psnr

from fastload.data.dataset import sample_rng
from fastload.data.synthetic import render_image
from fastload.data.transforms import RandomResizedCropFlip, resized_crop
from fastload.decode import tj3
from fastload.decode.base import open_rgb
from fastload.decode.jpeg_header import dct_scale, jpeg_info
from fastload.decode.turbo import TurboBackend
from fastload.errors import ConfigError

pytestmark = pytest.mark.skipif(
    tj3.load() is None, reason=f"libturbojpeg 3 not loadable: {tj3.UNAVAILABLE_REASON}"
)
MAX_LEVEL_DIFF = 1


def jpeg(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


@pytest.fixture(scope="module")
def layouts() -> dict[str, bytes]:
    """Baseline JPEGs of every chroma layout (MCU widths 8, 16, 16, 8) and odd sizes (the
    last MCU column and row partial)."""
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
    }
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
    """(ROI crop, whole-image crop, PIL reference crop) for one box."""
    info = jpeg_info(data)
    s = dct_scale(box, size)
    region, local_box = backend._decode_roi(data, info, box, size, s)
    got = backend._resized_crop(region, local_box, size, flip)
    t = RandomResizedCropFlip(size)
    want = whole._load_whole(data, info, box, flip, t, s)
    pil = np.asarray(resized_crop(open_rgb(data), box, size, flip), dtype=np.uint8)
    return got, want, pil


@pytest.mark.parametrize("size", [224, 48])
def test_roi_crop_matches_whole_image_crop_on_every_layout_and_edge(layouts, size):
    roi, whole = TurboBackend(roi="on"), TurboBackend(roi="off")
    checked = scaled = 0
    for name, data in layouts.items():
        info = jpeg_info(data)
        boxes = edge_boxes(info.width, info.height)
        rng = np.random.default_rng(7)
        t = RandomResizedCropFlip(size)
        boxes += [t.sample(info.width, info.height, rng)[0] for _ in range(12)]
        for k, box in enumerate(boxes):
            flip = bool(k % 2)
            got, want, pil = compare(roi, whole, data, box, flip, size)
            assert got.shape == want.shape == (size, size, 3), (name, box)
            diff = int(np.abs(got.astype(int) - want).max())
            assert diff <= MAX_LEVEL_DIFF, (name, box, flip, diff)
            assert psnr(got, pil) >= MIN_PSNR_DB, (name, box, psnr(got, pil))
            checked += 1
            scaled += dct_scale(box, size) > 1
    counts = roi.pop_counts()
    assert counts["decode_roi"] == checked
    assert scaled > 0 if size == 48 else True  # the DCT-scaled regions are exercised too


def test_region_is_aligned_inside_and_covers_the_crop():
    for subsamp, scale in [(0, 1), (2, 1), (1, 2), (2, 4), (5, 8), (3, 2)]:
        mcu = tj3.scaled_mcu_width(subsamp, scale)
        for box in [(0, 0, 500, 400), (123, 45, 200, 150), (480, 380, 20, 20), (7, 0, 9, 400)]:
            (x, y, w, h), (lx, ly, lw, lh) = tj3.region_for(box, scale, 500, 400, 32, mcu)
            assert x % mcu == 0 and x >= 0 and y >= 0, (box, scale)
            assert x + w <= -(-500 // scale) and y + h <= -(-400 // scale), (box, scale)
            assert lx >= 0 and ly >= 0 and lx + lw <= w and ly + lh <= h, (box, scale)
            assert (lw, lh) == (box[2] / scale, box[3] / scale)


def test_progressive_takes_the_whole_image_path_counted(layouts):
    photo = render_image(0, 0, 3, 11, 400, 500)
    data = jpeg(photo, progressive=True)
    roi, whole = TurboBackend(roi="on"), TurboBackend(roi="off")
    for seed in range(4):
        t = RandomResizedCropFlip(64)
        got = roi.load(data, t, sample_rng(0, 0, seed))
        want = whole.load(data, t, sample_rng(0, 0, seed))
        assert np.array_equal(got, want)
    counts = roi.pop_counts()
    assert counts["decode_roi_fallback_progressive"] == 4 and counts["decode_roi"] == 0


def test_roi_error_falls_back_to_the_whole_image_with_the_same_box(layouts, monkeypatch):
    roi, whole = TurboBackend(roi="on"), TurboBackend(roi="off")

    def broken(*a, **k):
        raise tj3.RoiDecodeError("decompress: Corrupt JPEG data")

    monkeypatch.setattr(roi.roi, "decode", broken)
    t = RandomResizedCropFlip(64)
    got = roi.load(layouts["420"], t, sample_rng(0, 0, 5))
    assert np.array_equal(got, whole.load(layouts["420"], t, sample_rng(0, 0, 5)))
    counts = roi.pop_counts()
    assert counts["decode_roi_fallback_error"] == 1 and counts["decode_roi"] == 0


def test_truncated_jpeg_fails_as_the_whole_image_path_does(layouts):
    """A damaged file reaches the dataset's skip_corrupt handling with the same error as
    without ROI decode (TurboJPEG's warning is not taken as a decoded crop)."""
    data = layouts["420"][: len(layouts["420"]) // 2]
    roi, whole = TurboBackend(roi="on"), TurboBackend(roi="off")
    with pytest.raises(OSError, match="truncated") as got:
        roi.load(data, RandomResizedCropFlip(32), sample_rng(0, 0, 1))
    with pytest.raises(OSError) as want:
        whole.load(data, RandomResizedCropFlip(32), sample_rng(0, 0, 1))
    assert str(got.value) == str(want.value)
    assert roi.pop_counts()["decode_roi_fallback_error"] == 1


def test_missing_library_auto_counts_and_on_says_how_to_install(layouts, monkeypatch):
    monkeypatch.setattr(tj3, "_LOADED", True)
    monkeypatch.setattr(tj3, "_LIB", None)
    monkeypatch.setattr(tj3, "UNAVAILABLE_REASON", "no libturbojpeg >= 3.0 found")
    with pytest.raises(ConfigError, match="backend.roi=on.*libturbojpeg"):
        TurboBackend(roi="on")
    with pytest.raises(ConfigError, match="backend.roi='sometimes'"):
        TurboBackend(roi="sometimes")
    auto = TurboBackend(roi="auto")
    assert auto.roi is None and "no ROI" in auto.info()["decoder"]
    auto.load(layouts["420"], RandomResizedCropFlip(32), sample_rng(0, 0, 1))
    assert auto.pop_counts()["decode_roi_fallback_no_library"] == 1
    off = TurboBackend(roi="off")
    off.load(layouts["420"], RandomResizedCropFlip(32), sample_rng(0, 0, 1))
    assert off.pop_counts()["decode_roi_fallback_no_library"] == 0  # asked for nothing


def test_roi_counts_reach_the_batches_through_worker_processes(layouts):
    """ROI decodes and their fallbacks travel worker -> collate -> batch["counts"], which the
    engine sums into every epoch row like the other decode counters."""
    progressive = jpeg(render_image(0, 0, 3, 11, 200, 240), progressive=True)
    items = [(k, d) for k, d in layouts.items()] * 2 + [("progressive", progressive)] * 3
    totals = epoch_counts(items, TurboBackend(roi="on"))
    assert totals["decode_roi"] == 2 * len(layouts)
    assert totals["decode_roi_fallback_progressive"] == 3
    assert totals["decode_roi_fallback_error"] == totals["decode_roi_fallback_no_library"] == 0


def test_roi_batches_resize_into_the_batch_slot_with_the_items_pixels(layouts, monkeypatch):
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
        BytesStorage(items_in), TurboBackend(roi="on"), RandomResizedCropFlip(40), seed=3
    )
    keys = [(e, i) for e in (1, 2) for i in range(len(items_in))]
    items = [ds[k] for k in keys]
    lazy = ds.load_batch(keys)
    kinds = [type(s[0]).__name__ for s in lazy]
    assert kinds.count("PendingCrop") == 2 * len(layouts)  # the progressive ones: finished
    assert not isinstance(lazy[len(layouts)][0], PendingCrop)
    want = collate(items)
    assert torch.equal(collate(lazy)["image"], want["image"])
    assert torch.equal(collate_in_worker_slot(ds.load_batch(keys), monkeypatch), want["image"])
    counts = collate(ds.load_batch(keys))["counts"]
    assert (
        counts["decode_roi"] == 2 * len(layouts) and counts["decode_roi_fallback_progressive"] == 2
    )


def test_region_decode_never_uses_merged_upsampling(layouts):
    """backend.fastupsample stays off on the region path: merged upsampling with a cropping
    region segfaulted the bundled libjpeg-turbo 3.0 beta on real photos (a whole worker lost).
    The region crops with fastupsample=true are the accurate-upsampling ones."""
    fast = TurboBackend(roi="on", fastupsample=True)
    accurate = TurboBackend(roi="on")
    for seed in range(6):
        t = RandomResizedCropFlip(64)
        got = fast.load(layouts["420"], t, sample_rng(0, 0, seed))
        assert np.array_equal(got, accurate.load(layouts["420"], t, sample_rng(0, 0, seed)))
    assert fast.pop_counts()["decode_roi"] == 6
