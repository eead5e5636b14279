"""Test-only components plugged in through the config (`storage._target_=tests.helpers.X`),
so the engine runs unmodified."""

from __future__ import annotations

import os
import signal

from fastload.storage.disk import DiskStorage


class SigtermAfterReads(DiskStorage):
    """Disk storage that sends SIGTERM to its own process after `reads` reads of the train
    split: a preemption at a known step (use with loader.num_workers=0)."""

    def __init__(self, root, split, reads: int):
        super().__init__(root, split)
        self.left = reads if split == "train" else None

    def read(self, i):
        if self.left is not None:
            self.left -= 1
            if self.left == 0:
                os.kill(os.getpid(), signal.SIGTERM)
        return super().read(i)
