"""backend=nvjpeg's crop + block mean + bilinear resize + flip of a whole batch as ONE Triton
kernel on the GPU: each output pixel reads its four bilinear taps, each tap the kx x ky block
mean of the decoded image, straight out of the padded canvas.

Why a kernel: the same maths in torch ops (batched_crop.resize_regions_torch, the reference and
the CPU path) materialises every group's regions (a gather with an int64 index per source pixel,
a float copy, the block mean, a relayout) before it samples them: gigabytes of memory traffic
and dozens of launches per batch of 256 ImageNet crops, on the SMs the model is using. Here the
only traffic is the taps' reads (cached: neighbouring outputs share them) and the output.

Same arithmetic as the reference: output pixel i of a box (start, length) in averaged pixels
samples `start + (i + 0.5) * length / size - 0.5` (PIL's centres), mirrored where flipped, its
taps clamped to the region; rounding is floor(x + 0.5). Coordinates are float32 here (float64
in the reference), so a value may differ by 1 where a sample lands on a rounding edge.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path and the torch reference do not need it
    triton = None

BLOCK = 256  # output pixels per program


if triton is not None:

    @triton.jit
    def _crop_resize(
        canvas, slot_stride, pitch, ints, floats, out, size, inv_size, BLOCK: tl.constexpr
    ):
        s = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < size * size
        p = ints + s * 8  # x0, y0, kx, ky, extent_x, extent_y, flip, unused
        x0, y0 = tl.load(p + 0), tl.load(p + 1)
        kx, ky = tl.load(p + 2), tl.load(p + 3)
        ext_x, ext_y, flip = tl.load(p + 4), tl.load(p + 5), tl.load(p + 6)
        q = floats + s * 4  # the box in averaged region pixels: left, top, w, h
        left, top = tl.load(q + 0), tl.load(q + 1)
        bw, bh = tl.load(q + 2), tl.load(q + 3)

        oy = offs // size
        ox = offs % size
        ox = tl.where(flip != 0, size - 1 - ox, ox)
        sy = top + (oy.to(tl.float32) + 0.5) * (bh * inv_size) - 0.5
        sx = left + (ox.to(tl.float32) + 0.5) * (bw * inv_size) - 0.5
        fy0 = tl.floor(sy)
        fx0 = tl.floor(sx)
        wy = sy - fy0
        wx = sx - fx0
        ya = tl.minimum(tl.maximum(fy0.to(tl.int32), 0), ext_y - 1)
        yb = tl.minimum(tl.maximum(fy0.to(tl.int32) + 1, 0), ext_y - 1)
        xa = tl.minimum(tl.maximum(fx0.to(tl.int32), 0), ext_x - 1)
        xb = tl.minimum(tl.maximum(fx0.to(tl.int32) + 1, 0), ext_x - 1)

        base = canvas + s.to(tl.int64) * slot_stride
        row_a = base + (y0 + ya * ky).to(tl.int64) * pitch
        row_b = base + (y0 + yb * ky).to(tl.int64) * pitch
        channel = tl.arange(0, 4)  # RGB and one masked lane: a power of two
        col_a = ((x0 + xa * kx) * 3)[:, None] + channel[None, :]
        col_b = ((x0 + xb * kx) * 3)[:, None] + channel[None, :]
        mask = inside[:, None] & (channel[None, :] < 3)
        # The four taps, each summed over its kx x ky block, all channels at once.
        aa = tl.zeros([BLOCK, 4], tl.float32)
        ab = tl.zeros([BLOCK, 4], tl.float32)
        ba = tl.zeros([BLOCK, 4], tl.float32)
        bb = tl.zeros([BLOCK, 4], tl.float32)
        for dy in range(0, ky):
            ra = (row_a + dy * pitch)[:, None]
            rb = (row_b + dy * pitch)[:, None]
            for dx in range(0, kx):
                aa += tl.load(ra + col_a + dx * 3, mask=mask, other=0).to(tl.float32)
                ab += tl.load(ra + col_b + dx * 3, mask=mask, other=0).to(tl.float32)
                ba += tl.load(rb + col_a + dx * 3, mask=mask, other=0).to(tl.float32)
                bb += tl.load(rb + col_b + dx * 3, mask=mask, other=0).to(tl.float32)
        scale = 1.0 / (kx * ky).to(tl.float32)
        wy = wy[:, None]
        wx = wx[:, None]
        pixel = (
            (aa * (1.0 - wx) + ab * wx) * (1.0 - wy) + (ba * (1.0 - wx) + bb * wx) * wy
        ) * scale
        pixel = tl.minimum(tl.maximum(tl.floor(pixel + 0.5), 0.0), 255.0)
        dst = out + s.to(tl.int64) * size * size * 3 + (offs * 3)[:, None] + channel[None, :]
        tl.store(dst, pixel.to(tl.uint8), mask=mask)


def available() -> bool:
    return triton is not None


def crop_resize(canvas, regions, factors, boxes, flips, size: int, out=None):
    """resize_regions' contract (fastload/decode/batched_crop.py) in one kernel launch:
    canvas (n, H, W, 3) uint8 contiguous; the per-sample plans as host tensors. Writes
    (n, size, size, 3) uint8 into `out` (new by default), returns it as (n, 3, size, size)."""
    if triton is None:
        raise RuntimeError(
            "crop_kernel.crop_resize needs triton (it ships with torch's CUDA wheels)"
        )
    n, height, width, _ = canvas.shape
    if out is None:
        out = torch.empty((n, size, size, 3), dtype=torch.uint8, device=canvas.device)
    if n == 0:
        return out.permute(0, 3, 1, 2)
    assert canvas.is_contiguous() and out.is_contiguous()
    factors = factors.to(torch.int64)
    ints = torch.zeros((n, 8), dtype=torch.int32)
    ints[:, 0:2] = regions[:, 0:2]
    ints[:, 2:4] = factors
    ints[:, 4] = regions[:, 2] // factors[:, 0]
    ints[:, 5] = regions[:, 3] // factors[:, 1]
    ints[:, 6] = flips.to(torch.int32)
    floats = boxes.to(torch.float32)
    if canvas.is_cuda:  # one small pinned copy each; the stream orders it before the kernel
        ints = ints.pin_memory().to(canvas.device, non_blocking=True)
        floats = floats.pin_memory().to(canvas.device, non_blocking=True)
    grid = (n, triton.cdiv(size * size, BLOCK))
    _crop_resize[grid](
        canvas, height * width * 3, width * 3, ints, floats, out, size, 1.0 / size, BLOCK=BLOCK
    )
    return out.permute(0, 3, 1, 2)
