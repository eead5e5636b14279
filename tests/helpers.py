"""Test-only components plugged in through the config (`storage._target_=tests.helpers.X`),
so the engine runs unmodified."""

from __future__ import annotations

import os
import signal

from fastload.storage.disk import DiskStorage


class SigtermAfterReads(DiskStorage):
    """Disk storage that sends SIGTERM to its own process after `reads` reads of the train
    split: a preemption at a known step (use with loader.num_workers=0)."""

    def __init__(self, root, split, reads: int, **kw):
        super().__init__(root, split, **kw)
        self.left = reads if split == "train" else None

    def read(self, i):
        if self.left is not None:
            self.left -= 1
            if self.left == 0:
                os.kill(os.getpid(), signal.SIGTERM)
        return super().read(i)


class RecordingTmpfs:
    """storage=tmpfs whose `prepare` hook also appends the calling rank to a file, so a
    DDP test can count how many processes staged."""

    from fastload.storage.tmpfs import TmpfsStorage as _Base

    def __new__(cls, root, split, record=None, **kw):
        return cls._Base(root, split, **kw)

    @classmethod
    def prepare(cls, *, record, **kw):
        with open(record, "a") as f:
            f.write(f"{os.environ.get('RANK', '0')}\n")
        cls._Base.prepare(**kw)

    @classmethod
    def finish(cls, *, record=None, **kw):
        cls._Base.finish(**kw)
