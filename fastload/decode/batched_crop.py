"""Crop + resize + flip of a whole batch of decoded images in a few tensor ops (backend=nvjpeg's
second half, after the GPU decoded each image into one padded canvas).

The worker plans each sample (`plan`): for its crop box it picks integer pre-averaging factors
(kx, ky) (antialiasing, as turbo's cv2 path: exact block means while the downscale is >= 2), the
block-aligned region of the image that covers the box, and the box in the averaged region's
pixels. Device prep decodes every image into its slot of one (n, H, W, 3) uint8 canvas and
`resize_regions` does the rest for the whole batch: per group of samples with the same
factors, one gather of the regions, one block mean (avg_pool2d) and one 4-tap bilinear gather
whose taps are clamped to each sample's own region (PIL's pixel centres; the region's edge
repeats past it, as in PIL). No per-sample kernels: a batch of 256 ImageNet crops is a handful
of launches per group, and there are rarely more than four groups. On a GPU the same maths runs
as one fused Triton kernel instead (fastload/decode/crop_kernel.py), which reads the taps
straight from the canvas; these torch ops are its reference and the CPU path.
"""

from __future__ import annotations

import math

import torch


def plan(box, size: int, width: int, height: int):
    """For one crop box (left, top, w, h) of a width x height image, resized to size x size:
    ((kx, ky) pre-averaging factors, (x0, y0, rw, rh) the region to decode, a multiple of the
    factors that covers the box, (left, top, w, h) the box in the averaged region's pixels)."""
    left, top, w, h = box
    kx, ky = max(1, int(w // size)), max(1, int(h // size))
    x0, y0 = math.floor(left), math.floor(top)  # a box between pixels (the evaluation crop)
    nx, ny = math.ceil((left + w - x0) / kx), math.ceil((top + h - y0) / ky)
    nx, ny = min(nx, width // kx), min(ny, height // ky)
    x0 = max(0, min(x0, width - nx * kx))
    y0 = max(0, min(y0, height - ny * ky))
    local = ((left - x0) / kx, (top - y0) / ky, w / kx, h / ky)
    return (kx, ky), (x0, y0, nx * kx, ny * ky), local


def _taps(start, length, size: int, extent, flip=None):
    """Bilinear taps along one axis for every sample: output pixel i samples
    `start + (i + 0.5) * length / size - 0.5` (PIL's centres), flipped where asked, clamped to
    [0, extent - 1]. start, length, extent: (n,) tensors. Returns (lo, hi, frac), each (n, size)."""
    i = torch.arange(size, device=start.device, dtype=start.dtype) + 0.5
    src = start[:, None] + i[None, :] * (length / size)[:, None] - 0.5
    if flip is not None:
        src = torch.where(flip[:, None], src.flip(1), src)
    lo = src.floor()
    frac = (src - lo).to(torch.float32)
    top = (extent - 1)[:, None]
    lo = lo.long()
    return lo.clamp(min=0).minimum(top), (lo + 1).clamp(min=0).minimum(top), frac


def resize_regions(canvas, regions, factors, boxes, flips, size: int, out=None):
    """The batch's crops (the arguments of `resize_regions_torch`): on a GPU one Triton kernel
    (fastload/decode/crop_kernel.py), elsewhere, or without triton, the torch ops below."""
    from fastload.decode import crop_kernel

    if canvas.is_cuda and crop_kernel.available():
        return crop_kernel.crop_resize(canvas, regions, factors, boxes, flips, size, out=out)
    return resize_regions_torch(canvas, regions, factors, boxes, flips, size, out=out)


def resize_regions_torch(canvas, regions, factors, boxes, flips, size: int, out=None):
    """canvas: (n, H, W, 3) uint8, sample k's whole decoded image at the top-left of slot k;
    regions: (n, 4) int64 (x0, y0, rw, rh), the planned regions in those images; factors:
    (n, 2) int64 (kx, ky); boxes: (n, 4) float64 (left, top, w, h) in averaged region pixels;
    flips: (n,) bool. Writes (n, size, size, 3) uint8 into `out` (a new tensor by default) and
    returns it as (n, 3, size, size) with channels_last strides (the layout the decode writes)."""
    device, (n, height, width, _) = canvas.device, canvas.shape
    if out is None:
        out = torch.empty((n, size, size, 3), dtype=torch.uint8, device=device)
    # The grouping and the group's extent are read on the host copies (no device sync).
    regions_host, factors_host = regions.tolist(), factors.tolist()
    groups: dict[tuple, list[int]] = {}
    for k, f in enumerate(factors_host):
        groups.setdefault(tuple(f), []).append(k)
    to = dict(device=device, non_blocking=True)
    regions, boxes, flips = regions.to(**to), boxes.to(**to), flips.to(**to)
    pixels_of = canvas.reshape(n * height * width, 3)
    for (kx, ky), members in groups.items():
        hmax = max(regions_host[k][3] for k in members)
        wmax = max(regions_host[k][2] for k in members)
        idx = torch.tensor(members, device=device)
        # One gather: each member's region out of its whole image.
        x0, y0 = regions[idx, 0], regions[idx, 1]
        ys = (y0[:, None] + torch.arange(hmax, device=device)).clamp_(max=height - 1)
        xs = (x0[:, None] + torch.arange(wmax, device=device)).clamp_(max=width - 1)
        at = (idx * (height * width))[:, None, None] + ys[:, :, None] * width + xs[:, None, :]
        group = pixels_of[at]
        group = group.permute(0, 3, 1, 2).float()
        if kx > 1 or ky > 1:
            group = torch.nn.functional.avg_pool2d(group, (ky, kx))
        g, _, hq, wq = group.shape
        flat = group.permute(0, 2, 3, 1).reshape(g * hq * wq, 3)
        box, region = boxes.index_select(0, idx), regions.index_select(0, idx)
        ya, yb, fy = _taps(box[:, 1], box[:, 3], size, region[:, 3] // ky)
        xa, xb, fx = _taps(box[:, 0], box[:, 2], size, region[:, 2] // kx, flips[idx])
        base = (torch.arange(g, device=device) * (hq * wq))[:, None, None]
        rows_a, rows_b = base + (ya * wq)[:, :, None], base + (yb * wq)[:, :, None]
        xa, xb, fx = xa[:, None, :], xb[:, None, :], fx[:, None, :, None]
        top = flat[rows_a + xa] * (1 - fx) + flat[rows_a + xb] * fx
        bottom = flat[rows_b + xa] * (1 - fx) + flat[rows_b + xb] * fx
        fy = fy[:, :, None, None]
        pixels = top * (1 - fy) + bottom * fy
        out[idx] = pixels.add_(0.5).floor_().clamp_(0, 255).to(torch.uint8)
    return out.permute(0, 3, 1, 2)
