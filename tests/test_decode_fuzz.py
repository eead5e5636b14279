"""Damaged JPEGs through the default backend: a few hundred mutations of real and synthetic
photos (bit flips, truncations, changed frame dimensions) each end decoded or with an error
naming the file, and nothing crashes the process (a native decoder's out-of-bounds write
would kill a worker, and with it the run). Run in a child process so that a crash is a
failed test, not a dead test session."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastload.data.synthetic import render_image
from fastload.decode import roi_decoders

REPO = Path(__file__).resolve().parents[1]

# The child: the default backend (conf/backend/turbo.yaml as it is, with the region decoder
# named first), then every file through the dataset's decode at two output sizes (a region
# decode and a DCT-scaled decode) and both upsampling modes; one JSON line per file: "ok" or
# the error message.
CHILD = textwrap.dedent(
    """
    import json, sys
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from fastload.data.dataset import ImageDataset
    from fastload.data.transforms import RandomResizedCropFlip

    class Files:
        def __init__(self, paths):
            self.paths = paths
        def __len__(self):
            return len(self.paths)
        def get(self, i, name):
            with open(self.paths[i], "rb") as f:
                return f.read()
        def column(self, name):
            return [0] * len(self.paths)
        def describe(self, i):
            return self.paths[i]

    roi, paths = sys.argv[1], sys.argv[2:]
    totals = {}
    for fast in (False, True):
        cfg = OmegaConf.load("conf/backend/turbo.yaml")
        cfg.fastupsample = fast
        cfg.roi = roi
        backend = instantiate(cfg)
        for size in (224, 64):
            ds = ImageDataset(Files(paths), backend, RandomResizedCropFlip(size), seed=size)
            for i, path in enumerate(paths):
                try:
                    out = ds[i]
                    result = "ok" if tuple(out[0].shape) == (3, size, size) else "bad shape"
                    for k, v in (out[2] if len(out) > 2 else {}).items():
                        totals[k] = totals.get(k, 0) + v
                except Exception as e:
                    result = str(e)
                print(json.dumps([path, result]))
    print(json.dumps(["counts", totals]))
    """
)


def jpeg_bytes(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", **kw)
    return buf.getvalue()


def sources() -> list[bytes]:
    """A real photograph (matplotlib's sample data) at two chroma layouts, progressive too,
    and synthetic photo-like images at odd sizes."""
    import matplotlib.cbook

    photo = Image.open(matplotlib.cbook.get_sample_data("grace_hopper.jpg")).convert("RGB")
    return [
        jpeg_bytes(photo, quality=90),
        jpeg_bytes(photo, quality=85, subsampling=0),
        jpeg_bytes(photo.resize((301, 333)), quality=95, progressive=True),
        jpeg_bytes(render_image(0, 0, 3, 11, 400, 500), quality=90, subsampling=1),
        jpeg_bytes(render_image(1, 1, 3, 12, 190, 260), quality=90, restart_marker_rows=1),
        jpeg_bytes(render_image(2, 2, 3, 13, 240, 320).convert("L"), quality=90),
    ]


def sof_offset(data: bytes) -> int:
    """Where the frame header's height field starts (after FFC0/FFC2, length, precision)."""
    for marker in (b"\xff\xc0", b"\xff\xc2"):
        at = data.find(marker)
        if at >= 0:
            return at + 5
    raise AssertionError("no SOF marker")


def mutations(data: bytes, rng: np.random.Generator, n: int) -> list[bytes]:
    out = []
    for k in range(n):
        b = bytearray(data)
        kind = k % 3
        if kind == 0:  # bit flips, anywhere after the SOI marker
            for _ in range(int(rng.integers(1, 12))):
                at = int(rng.integers(2, len(b)))
                b[at] ^= 1 << int(rng.integers(0, 8))
        elif kind == 1:  # truncated
            b = b[: int(rng.integers(2, len(b)))]
        else:  # changed frame dimensions: larger, smaller, zero, or absurd
            at = sof_offset(data)
            h, w = struct.unpack_from(">HH", b, at)
            choice = int(rng.integers(0, 4))
            new = [
                (h * 2, w * 2),
                (max(1, h // 3), max(1, w // 3)),
                (0, w),
                (65000, 65000),
            ][choice]
            struct.pack_into(">HH", b, at, *new)
        out.append(bytes(b))
    return out


@pytest.mark.parametrize("roi", roi_decoders.KINDS)
def test_mutated_jpegs_decode_or_name_the_file_and_nothing_crashes(tmp_path, roi):
    if roi_decoders.status()[roi]:
        pytest.skip(roi_decoders.status()[roi])
    rng = np.random.default_rng(2026)
    paths = []
    for s, data in enumerate(sources()):
        for m, mutated in enumerate(mutations(data, rng, 50)):
            path = tmp_path / f"src{s}-mut{m}.jpg"
            path.write_bytes(mutated)
            paths.append(str(path))
    child = subprocess.run(
        [sys.executable, "-c", CHILD, roi, *paths],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, (child.returncode, child.stderr[-3000:])
    lines = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("[")]
    counts = lines.pop()[1]
    assert len(lines) == 4 * len(paths)  # every file, at both sizes, both upsampling modes
    decoded = failed = 0
    for path, result in lines:
        if result == "ok":
            decoded += 1
        else:
            failed += 1
            assert path in result and "Remove or replace the file" in result, result
    # The mutations reach both outcomes, and the region decoder saw them (not only the
    # whole-image fallback).
    assert decoded > 100 and failed > 20, (decoded, failed)
    assert counts["decode_roi"] > 100 and counts["decode_dct_scaled"] > 50, counts
    assert child.stderr.strip() == "", child.stderr[-3000:]  # no native library noise


# The child for backend=nvjpeg's C batch call (nvImageCodec's CPU decoder here, the same calls
# as on a GPU): batches of 32 files into 640 x 640 slots of one canvas with guard bytes after
# it; one JSON line per batch: its codes, whether the guard and every unparsed or oversized
# image's slot stayed untouched.
BATCH_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from fastload.decode import nvimgcodec_batch as nb

    ext = nb.choose("c")
    dec = ext.Decoder(nb.DEVICE_CPU_ONLY, 1, [(nb.CPU_ONLY, 1.0)], "")
    datas = [open(p, "rb").read() for p in sys.argv[1:]]
    side, guard = 640, 4096
    slot = side * side * 3
    for start in range(0, len(datas), 32):
        chunk = datas[start : start + 32]
        data = np.frombuffer(b"".join(chunk), dtype=np.uint8)
        offsets = np.cumsum([0] + [len(d) for d in chunk]).astype(np.int64)
        canvas = np.full(len(chunk) * slot + guard, 7, dtype=np.uint8)
        codes = list(dec.decode(data, offsets, canvas.ctypes.data, slot, side * 3, side, side, 0))
        slots = canvas[: len(chunk) * slot].reshape(len(chunk), slot)
        untouched = all((slots[k] == 7).all() for k, c in enumerate(codes) if c in (1, 2))
        print(json.dumps([codes, bool((canvas[-guard:] == 7).all()), bool(untouched)]))
    """
)


def test_mutated_jpegs_through_the_c_batch_call_stay_in_their_slots(tmp_path):
    """backend=nvjpeg's C call over the same kind of damaged files: every image gets a code,
    nothing is written past the canvas or into the slot of an image it refused before
    decoding, and the process survives (a crash is a failed test: it runs in a child)."""
    rng = np.random.default_rng(7)
    paths = []
    for s, data in enumerate(sources()):
        for m, mutated in enumerate([data, *mutations(data, rng, 30)]):
            path = tmp_path / f"src{s}-mut{m}.jpg"
            path.write_bytes(mutated)
            paths.append(str(path))
    child = subprocess.run([sys.executable, "-c", BATCH_CHILD, *paths], cwd=REPO,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert child.returncode == 0, (child.returncode, child.stderr[-3000:])
    batches = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("[")]
    codes = [c for batch, _, _ in batches for c in batch]
    assert len(codes) == len(paths) and set(codes) <= {0, 1, 2, 3}
    assert all(guard and untouched for _, guard, untouched in batches), batches
    # the undamaged sources that fit a slot decode; the mutations reach the other outcomes
    assert codes.count(0) > 50 and len(codes) - codes.count(0) > 10, codes
