"""Test-only components plugged in through the config (`storage._target_=tests.helpers.X`),
so the engine runs unmodified."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from fastload.data.layouts import as_layout
from fastload.storage.disk import DiskStorage, SourceReader
from fastload.storage.shards import ShardStorage
from fastload.storage.tmpfs import TmpfsStorage
from fastload.storage.webdataset import WdsReader, WebDatasetStorage


def sample(reader, i: int) -> tuple:
    """(image bytes, target) of record i, whatever its store: the target is the record's
    first int field (an ImageFolder's label, COCO's image id, DIV2K's position)."""
    return reader.get(i, "image"), int(targets(reader)[i])


def targets(reader):
    """The first int field of every record (int64)."""
    return reader.column(reader.schema.columns[0].name)


class SigtermReader(SourceReader):
    """Sends SIGTERM to its own process after `reads` reads: a preemption at a known step."""

    def __init__(self, source, reads: int):
        super().__init__(source)
        self.left = reads

    def get(self, i, name):
        if name == "image":
            self.left -= 1
            if self.left == 0:
                os.kill(os.getpid(), signal.SIGTERM)
        return super().get(i, name)


class SigtermAfterReads(DiskStorage):
    """storage=disk whose train split sends SIGTERM after $SIGTERM_AFTER_READS reads (use
    with loader.num_workers=0). An environment variable, not a config key: a preemption is
    not part of the run's configuration, so the resumed run's config is the same."""

    def open(self, root, split):
        reads = int(os.environ.get("SIGTERM_AFTER_READS", "0"))
        if split != "train" or not reads:
            return super().open(root, split)
        return SigtermReader(as_layout(root).source(split), reads)


class RecordingTmpfs(TmpfsStorage):
    """storage=tmpfs whose `prepare` also appends the calling rank to a file, so a DDP test
    can count how many processes staged."""

    def __init__(self, record, **kw):
        super().__init__(**kw)
        self.record = record

    def prepare(self, root, splits, **kw):
        with open(self.record, "a") as f:
            f.write(f"{os.environ.get('RANK', '0')}\n")
        super().prepare(root, splits, **kw)


class SigtermWebDataset(WebDatasetStorage):
    """storage=webdataset whose train reader sends SIGTERM after $SIGTERM_AFTER_READS reads
    (loader.num_workers=0), like SigtermAfterReads."""

    def _reader(self, base, manifest):
        reader = super()._reader(base, manifest)
        reads = int(os.environ.get("SIGTERM_AFTER_READS", "0"))
        if reads and "/train" in base:
            reader.__class__ = _SigtermWdsReader
            reader.left = reads
        return reader


class _SigtermWdsReader(WdsReader):
    def get(self, i, name):
        if name == "image":
            self.left -= 1
            if self.left == 0:
                os.kill(os.getpid(), signal.SIGTERM)
        return super().get(i, name)


class PackTogetherShards(ShardStorage):
    """storage=shards whose packers wait for each other: the writer of a process's n-th
    split returns only once `together` processes have asked for their n-th (a file each in
    `sync_dir`), so two nodes that pack into one folder are both packing at once, as two
    nodes that start together on a large dataset are."""

    def __init__(self, sync_dir, together: int = 2, wait_s: float = 60.0, **kw):
        super().__init__(**kw)
        self.sync_dir, self.together, self.wait_s = Path(sync_dir), int(together), wait_s
        self.calls = 0

    def writer(self, folder, schema):
        self.calls += 1
        self.sync_dir.mkdir(parents=True, exist_ok=True)
        (self.sync_dir / f"{os.getpid()}-{self.calls}").touch()
        end = time.monotonic() + self.wait_s
        while len(list(self.sync_dir.glob(f"*-{self.calls}"))) < self.together:
            if time.monotonic() > end:
                raise TimeoutError(f"{self.together} packers never met in {self.sync_dir}")
            time.sleep(0.05)
        return super().writer(folder, schema)
