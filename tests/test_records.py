"""Records as named fields with codecs (fastload/data/records.py): each codec round-trips, a
schema refuses what would collide, and a new kind of field is one codec that every store
then holds, without a line changed in a store."""

from __future__ import annotations

import tarfile

import numpy as np
import pytest

from fastload.data.records import CODECS, Codec, Field, Schema
from fastload.data.sources import ImageFolderSource
from fastload.errors import StorageError
from fastload.storage.disk import SourceReader
from fastload.storage.lmdb_store import LmdbStorage
from fastload.storage.packing import pack_split
from fastload.storage.shards import ShardStorage
from fastload.storage.webdataset import WebDatasetStorage


@pytest.mark.parametrize(
    "codec, value",
    [
        ("encoded", b"\xff\xd8\xff\xe0 jpeg bytes"),
        ("int", 1234),
        ("array", np.arange(12, dtype=np.float32).reshape(3, 4)),
        ("json", {"caption": "a dog", "tags": [1, 2]}),
    ],
)
def test_every_codec_round_trips(codec, value):
    coder = CODECS[codec]
    back = coder.decode(coder.encode(value))
    if isinstance(value, np.ndarray):
        assert back.dtype == value.dtype and np.array_equal(back, value)
    else:
        assert back == value


def test_codecs_refuse_bytes_that_are_not_theirs():
    with pytest.raises(ValueError, match="whole number"):
        CODECS["int"].decode(b"-1")
    with pytest.raises(ValueError, match="not a .npy"):
        CODECS["array"].decode(b"garbage")
    pickled = np.array([{"a": 1}], dtype=object)
    import io

    out = io.BytesIO()
    np.save(out, pickled, allow_pickle=True)
    with pytest.raises(ValueError):  # never unpickled
        CODECS["array"].decode(out.getvalue())


def test_webdataset_extensions_follow_the_convention():
    image, label = Field("image", "encoded", ext=""), Field("label", "int", ext="")
    assert image.member_ext(b"\x89PNG....") == "png" and image.member_ext(b"\xff\xd8") == "jpg"
    assert label.member_ext(b"3") == "cls"
    lr = Field("lr", "encoded")
    assert lr.member_ext(b"\x89PNG....") == "lr.png" and lr.reads("lr.jpg")
    assert not lr.reads("png") and image.reads("jpeg") and not image.reads("lr.png")
    assert Field("boxes", "array").member_ext(b"") == "boxes.npy"


def test_a_schema_refuses_fields_that_would_collide():
    with pytest.raises(ValueError, match="differ"):
        Schema(Field("image", "encoded"), Field("image", "int"))
    with pytest.raises(ValueError, match="WebDataset extension"):
        Schema(Field("image", "encoded", ext=""), Field("photo", "encoded", ext=""))
    with pytest.raises(ValueError, match="codec"):
        Field("caption", "text")
    schema = ImageFolderSource.schema
    assert Schema.from_json(schema.to_json()) == schema and schema.names == ("image", "label")
    import pickle

    assert pickle.loads(pickle.dumps(schema)) == schema


# -- a fourth kind of field: one codec, every store ------------------------------------------


class Text(Codec):
    """A UTF-8 string: the whole of what adding a field kind takes."""

    name, suffixes = "text", ("txt",)

    def encode(self, value) -> bytes:
        return value.encode()

    def decode(self, data) -> str:
        return bytes(data).decode()


class CaptionedFolder(ImageFolderSource):
    """An ImageFolder split whose records also carry a caption."""

    def __init__(self, split_dir):
        super().__init__(split_dir)
        self.schema = Schema(*ImageFolderSource.schema, Field("caption", "text"))
        self._values["caption"] = self.caption

    def caption(self, i: int) -> str:
        return f"photo {i} of a {self.classes[self.index.targets[i]]} ✓"


@pytest.mark.parametrize("store", ["shards", "lmdb", "webdataset"])
def test_a_new_field_kind_is_one_codec_that_every_store_holds(
    tiny_folder, tmp_path, monkeypatch, store
):
    monkeypatch.setitem(CODECS, "text", Text())
    source = CaptionedFolder(tiny_folder / "train")
    storage = {
        "shards": ShardStorage(path=tmp_path),
        "lmdb": LmdbStorage(path=tmp_path),
        "webdataset": WebDatasetStorage(path=tmp_path, shard_samples=5),
    }[store]
    meta = pack_split(storage.writer, None, tmp_path / "train", source=source, progress=False)
    assert [f["name"] for f in meta["schema"]] == ["image", "label", "caption"]
    packed, disk = storage.reader(tmp_path / "train"), SourceReader(source)
    assert len(packed) == len(disk) == len(source)
    for i in range(len(source)):
        assert packed.get(i, "caption") == disk.get(i, "caption") == source.caption(i)
        assert packed.get(i, "image") == disk.get(i, "image")
    assert np.array_equal(packed.column("label"), disk.column("label"))
    with pytest.raises(StorageError, match="holds no field 'boxes'.*image, label, caption"):
        packed.get(0, "boxes")
    if store == "webdataset":
        with tarfile.open(tmp_path / "train" / "shard-000000.tar") as tf:
            assert tf.getnames()[:3] == ["00000000.jpg", "00000000.cls", "00000000.caption.txt"]
