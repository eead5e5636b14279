"""What a stored record is: named fields, each with a codec. Stores know codecs, never tasks.

A source (fastload/data/sources.py) declares its `Schema`, e.g. an ImageFolder split's:

    Schema(Field("image", "encoded", ext=""), Field("label", "int", ext="", classes=True))

and each store writes and reads every field of a record by one loop over the schema; a
dataset asks its reader for the fields it needs by name (`reader.get(i, "image")`,
`reader.column("label")`). A new task declares its fields; a new kind of field is one
`Codec` subclass in `CODECS`, and every store holds it.

Codecs (how a value becomes bytes and back; a store adds its own checksum around them):

    encoded   an image file's bytes (JPEG, PNG, WebP), handed to the decoders as they are
    pixels    a fastload raw pixel record (fastload/data/rawimage.py), handed out as a
              read-only view of the store's memory map where it has one (no copy)
    int       a whole number >= 0 (class index, image id, position); a column: stores
              with an index keep all of a split's values in one int64 array, so training
              knows every label without reading a record (WebDataset: ASCII, `.cls`)
    array     a numpy array (boxes, labels), as .npy bytes (never pickled)
    json      a JSON document

`encoded` and `pixels` are image fields: packing reads such a field's file and stores it as
it is, re-encoded smaller, or decoded (storage.kind), so a pack's schema may say `pixels`
where its source's says `encoded`.

WebDataset member names: <key>.<ext>.<suffix>, where suffix is the codec's (jpg/png by the
bytes, cls, npy, json) and ext the field's `ext` (default: its name); ext "" gives the bare
suffix, the convention other WebDataset tools read (00000001.jpg, 00000001.cls).
"""

from __future__ import annotations

import dataclasses
import io
import json

import numpy as np

IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp")


class Codec:
    """One kind of field value; subclasses set the flags and the two conversions."""

    name: str
    column = False  # an int64 column in stores with an index
    image = False  # packing reads it from a file and may re-encode it (storage.kind)
    zero_copy = False  # a view of the store's map, not a copy
    suffixes: tuple[str, ...] = ()  # WebDataset extensions read as this codec

    def encode(self, value) -> bytes:
        return bytes(value)

    def decode(self, data):
        """The value of stored bytes (a bytes object or a read-only memoryview); ValueError
        when they are not one (the store names the record)."""
        return data

    def suffix(self, data) -> str:
        """The WebDataset extension written for these bytes."""
        return self.suffixes[0]


class Encoded(Codec):
    name, image, suffixes = "encoded", True, IMAGE_SUFFIXES

    def suffix(self, data) -> str:
        head = bytes(data[:8])
        if head.startswith(b"\x89PNG"):
            return "png"
        return "webp" if head.startswith(b"RIFF") else "jpg"


class Pixels(Codec):
    name, image, zero_copy, suffixes = "pixels", True, True, ("raw",)


class Int(Codec):
    name, column, suffixes = "int", True, ("cls",)

    def encode(self, value) -> bytes:
        return str(int(value)).encode()

    def decode(self, data) -> int:
        text = bytes(data).decode("utf-8", "replace").strip()
        if not text.isdigit():  # also refuses "-1", "1.7", "abc", ""
            raise ValueError(f"{text[:20]!r} is not a whole number >= 0")
        return int(text)


class Array(Codec):
    name, suffixes = "array", ("npy",)

    def encode(self, value) -> bytes:
        out = io.BytesIO()
        np.save(out, np.ascontiguousarray(value), allow_pickle=False)
        return out.getvalue()

    def decode(self, data) -> np.ndarray:
        try:
            return np.load(io.BytesIO(bytes(data)), allow_pickle=False)
        except (OSError, ValueError, EOFError) as exc:
            raise ValueError(f"not a .npy array ({str(exc).split('. ')[0]})") from None


class Json(Codec):
    name, suffixes = "json", ("json",)

    def encode(self, value) -> bytes:
        return json.dumps(value, separators=(",", ":")).encode()

    def decode(self, data):
        return json.loads(bytes(data))


CODECS: dict[str, Codec] = {c.name: c for c in (Encoded(), Pixels(), Int(), Array(), Json())}


@dataclasses.dataclass(frozen=True)
class Field:
    """One named field of a record.

    ext: its WebDataset extension (None: its name; "": the codec's suffix alone).
    xywh: pixel boxes (n, 4: x, y, w, h) in the record's first image, rescaled with that
          image when packing resizes it.
    classes: an int field whose values index the split's classes (shards written by
          other tools name their classes by its largest value).
    """

    name: str
    codec: str
    ext: str | None = None
    xywh: bool = False
    classes: bool = False

    def __post_init__(self):
        if self.codec not in CODECS:
            raise ValueError(
                f"field {self.name}: codec {self.codec!r} is not one of {list(CODECS)}"
            )
        if not self.name.isidentifier():
            raise ValueError(f"field name {self.name!r}: use letters, digits and _")

    @property
    def coder(self) -> Codec:
        return CODECS[self.codec]

    def member_ext(self, data) -> str:
        """The WebDataset extension of this field's member holding `data`."""
        stem = self.name if self.ext is None else self.ext
        suffix = self.coder.suffix(data)
        return f"{stem}.{suffix}" if stem else suffix

    def reads(self, ext: str) -> bool:
        """Whether a WebDataset member with extension `ext` holds this field."""
        stem = self.name if self.ext is None else self.ext
        head, _, suffix = ext.rpartition(".")
        return head == stem and suffix in self.coder.suffixes

    def to_json(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, False)}


class Schema(tuple):
    """The fields of a record, in order; the first image field is the record's image."""

    def __new__(cls, *fields: Field):
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise ValueError(f"a record's field names must differ: {names}")
        exts = [(f.ext if f.ext is not None else f.name, f.codec) for f in fields]
        if len(set(exts)) != len(exts):
            raise ValueError(f"two fields would share a WebDataset extension: {names}")
        return super().__new__(cls, fields)

    def __getnewargs__(self):  # pickle: the fields as __new__'s arguments
        return tuple(self)

    @classmethod
    def from_json(cls, doc) -> Schema:
        return cls(*(Field(**f) for f in doc))

    def to_json(self) -> list[dict]:
        return [f.to_json() for f in self]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self)

    def __contains__(self, name) -> bool:
        return (
            any(f.name == name for f in self)
            if isinstance(name, str)
            else super().__contains__(name)
        )

    def __getitem__(self, key):
        if isinstance(key, str):
            for f in self:
                if f.name == key:
                    return f
            raise KeyError(key)
        return super().__getitem__(key)

    @property
    def columns(self) -> tuple[Field, ...]:
        """The fields stores keep as int64 columns."""
        return tuple(f for f in self if f.coder.column)

    @property
    def blobs(self) -> tuple[Field, ...]:
        """The fields stored as bytes, one blob per record."""
        return tuple(f for f in self if not f.coder.column)

    def replace(self, name: str, **changes) -> Schema:
        return Schema(*(dataclasses.replace(f, **changes) if f.name == name else f for f in self))

    def __repr__(self) -> str:
        return "Schema(" + ", ".join(f"{f.name}:{f.codec}" for f in self) + ")"


@dataclasses.dataclass(frozen=True)
class ImageFile:
    """An image field's value in a source: the file, and for a paired image the factor its
    sides are smaller than the record's image by (DIV2K LR: the scale), so packing resizes
    the pair to max_side / divide and keeps the pair's ratio. `stated`: the (width, height)
    an annotation file gives the image (COCO; 0 where it gives none), which packing checks
    the image's frame against (fastload/data/frames.py)."""

    path: str
    divide: int = 1
    stated: tuple[int, int] | None = None
