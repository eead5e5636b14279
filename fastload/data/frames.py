"""Which pixel frame a COCO image's boxes are in: the image as shown (EXIF orientation
applied, what every decode here gives) or as stored in the file.

A photo taken with the camera turned carries an EXIF orientation tag; its stored pixels lie
on their side and viewers turn them. Annotation tools differ: a browser-based one turns the
image before the boxes are drawn, older tools and COCO's own files (pycocotools, torchvision's
`CocoDetection`, which never apply the tag) keep the stored frame. Decoded in the wrong frame,
the boxes sit on other pixels and the model learns from them, silently.

The annotation file's `width` and `height` say which frame it used when the tag turns the
image by 90 degrees (orientations 5-8): the shown size is the stored one transposed. So
every image is checked against them, as Detectron2 checks (`check_image_size`), but an image
whose stored size matches is decoded in its stored frame instead of refused (counted per
epoch as `stored_frame_images`). A size neither frame has is an error naming the image.
Tags that only mirror or turn by 180 degrees (2-4) leave the size as it is, so nothing tells
the frames apart there: those images are decoded as shown, as Detectron2, MMDetection and
Ultralytics decode them.
"""

from __future__ import annotations

import io

from PIL import Image

from fastload.errors import DatasetError

TRANSPOSING = (5, 6, 7, 8)  # EXIF orientations that turn the image by 90 degrees


def in_stored_frame(data: bytes, stated: tuple[int, int], where: str, shown=None) -> bool:
    """True when the annotation file's `stated` (width, height) is the image's stored size
    and not its shown one (its boxes are then in the stored frame); False when the shown
    size matches, or the file states no size (0). `shown`: the decoded (width, height), when
    the caller has it (else read from the header). Raises DatasetError naming `where` when
    neither frame has the stated size."""
    width, height = (int(v) for v in stated)
    if width <= 0 or height <= 0:
        return False
    if shown is not None and tuple(shown) == (width, height):
        return False
    img = Image.open(io.BytesIO(data))  # the header only: no pixels decoded
    stored = img.size
    orientation = img.getexif().get(0x0112, 1)  # what open_rgb turns the image by
    turned = orientation in TRANSPOSING
    shown = stored[::-1] if turned else stored
    if shown == (width, height):
        return False
    if turned and stored == (width, height):
        return True
    how = f", shown turned by its EXIF orientation {orientation}" if orientation != 1 else ""
    raise DatasetError(
        f"{where} is {shown[0]}x{shown[1]} pixels{how}, but the annotation file says width "
        f"{width}, height {height}: its boxes would not land on its objects. Correct the "
        f"image's width, height and boxes in the annotation file, or replace the image with "
        f"the one that was annotated."
    )
