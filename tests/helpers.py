"""Test-only components plugged in through the config (`storage._target_=tests.helpers.X`),
so the engine runs unmodified."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
import xxhash

from fastload.data.layouts import as_layout
from fastload.errors import StorageError
from fastload.storage.disk import DiskStorage, SourceReader
from fastload.storage.shards import ShardStorage
from fastload.storage.tmpfs import TmpfsStorage
from fastload.storage.webdataset import WdsReader, WebDatasetStorage
from fastload.tasks.classification import ClassificationTask
from fastload.telemetry.sinks import NullSink


def sample(reader, i: int) -> tuple:
    """(image bytes, target) of record i, whatever its store: the target is the record's
    first int field (an ImageFolder's label, COCO's image id, DIV2K's position)."""
    return reader.get(i, "image"), int(targets(reader)[i])


def targets(reader):
    """The first int field of every record (int64)."""
    return reader.column(reader.schema.columns[0].name)


class SigtermReader(SourceReader):
    """Sends SIGTERM (or `signum`) to its own process after `reads` reads (`group`: to its
    whole process group, once, the file $SIGTERM_ONCE marking it): a preemption (or a hard
    failure) at a known step."""

    def __init__(self, source, reads: int, signum: int = signal.SIGTERM, group: bool = False):
        super().__init__(source)
        self.left, self.signum, self.group = reads, signum, group

    def get(self, i, name):
        count_read(self, name)
        return super().get(i, name)


def count_read(reader, name: str) -> None:
    """One read of `reader` (with `left` and `signum`): its signal to this process at the
    last one, or to the process group (`group`), which a DataLoader worker shares."""
    if name == "image":
        reader.left -= 1
        if reader.left == 0 and not getattr(reader, "group", False):
            os.kill(os.getpid(), reader.signum)
        elif reader.left == 0:
            try:  # one worker sends it, once
                os.close(os.open(os.environ["SIGTERM_ONCE"], os.O_CREAT | os.O_EXCL))
                os.killpg(os.getpgid(0), reader.signum)
            except FileExistsError:
                pass


class SigtermAfterReads(DiskStorage):
    """storage=disk whose train split sends SIGTERM after $SIGTERM_AFTER_READS reads (use
    with loader.num_workers=0). An environment variable, not a config key: a preemption is
    not part of the run's configuration, so the resumed run's config is the same."""

    group = False

    def open(self, root, split):
        reads = int(os.environ.get("SIGTERM_AFTER_READS", "0"))
        if split != "train" or not reads:
            return super().open(root, split)
        return SigtermReader(as_layout(root).source(split), reads, group=self.group)


class SigtermGroupAfterReads(SigtermAfterReads):
    """The same, sent by a DataLoader worker to the whole process group, once: what torchrun
    (os.killpg), Slurm and `kill -- -PGID` do on a preemption."""

    group = True


class SigkillAfterReads(DiskStorage):
    """storage=disk whose train split SIGKILLs the rank $SIGKILL_RANK after $SIGKILL_AFTER_READS
    reads, in the first launch of a torchrun group only (TORCHELASTIC_RESTART_COUNT 0): a
    lost process that writes no checkpoint, and a restart that runs on (loader.num_workers=0)."""

    def open(self, root, split):
        reads = int(os.environ.get("SIGKILL_AFTER_READS", "0"))
        mine = os.environ.get("RANK", "0") == os.environ.get("SIGKILL_RANK", "0")
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if split != "train" or not (reads and mine and first):
            return super().open(root, split)
        return SigtermReader(as_layout(root).source(split), reads, signal.SIGKILL)


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


class SigtermWhileStaging(TmpfsStorage):
    """storage=tmpfs that gets SIGTERM once it has copied 3 files."""

    def prepare(self, root, splits, **kw):
        import shutil

        real, copied = shutil.copyfile, []

        def copy(src, dst):
            real(src, dst)
            copied.append(src)
            if len(copied) == 3:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the signal lands meanwhile

        shutil.copyfile = copy
        try:
            super().prepare(root, splits, **kw)
        finally:
            shutil.copyfile = real


class TmpfsOpenFails(TmpfsStorage):
    """storage=tmpfs whose readers cannot be opened: a run that fails after staging, before
    training (building the data)."""

    def open(self, root, split):
        raise StorageError(f"cannot open the staged {split} split (a test's failure)")


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
    signum = signal.SIGTERM

    def get(self, i, name):
        count_read(self, name)
        return super().get(i, name)


class RecordingClassification(ClassificationTask):
    """The classification task whose training dataset appends `epoch, index, hash of the
    augmented pixels` of every sample it builds to $RECORD_SAMPLES/rank<RANK>.tsv: which
    samples each rank trained, in order, and with which augmentation draw (with
    loader.num_workers=0 a sample is built when its step trains it, never ahead)."""

    def dataset(self, split, reader, backend, normalize=None):
        inner = super().dataset(split, reader, backend, normalize)
        folder = os.environ.get("RECORD_SAMPLES")
        return _RecordingDataset(inner, Path(folder)) if split == "train" and folder else inner


class _RecordingDataset(torch.utils.data.Dataset):
    def __init__(self, inner, folder: Path):
        self.inner = inner
        self.path = folder / f"rank{os.environ.get('RANK', '0')}.tsv"

    def __getattr__(self, name):  # reader, transform, backend, ... of the real dataset
        return getattr(self.__dict__["inner"], name)

    def __len__(self) -> int:
        return len(self.inner)

    def load_batch(self, keys):
        samples = self.inner.__getitems__(keys)
        with open(self.path, "a") as f:
            for (epoch, index), s in zip(keys, samples, strict=True):
                pixels = s[0].contiguous().numpy().tobytes()
                f.write(f"{epoch}\t{index}\t{xxhash.xxh64(pixels).hexdigest()}\n")
        return samples

    def __getitem__(self, key):
        return self.load_batch([key])[0]


def recorded(folder: Path) -> dict[int, list[tuple[int, int, str]]]:
    """rank -> the (epoch, index, pixel hash) a `RecordingClassification` run trained, in order."""
    out = {}
    for path in sorted(Path(folder).glob("rank*.tsv")):
        rows = [line.split("\t") for line in path.read_text().splitlines()]
        out[int(path.stem[4:])] = [(int(e), int(i), h) for e, i, h in rows]
    return out


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


def build_small_resnet(arch: str = "resnet18", num_classes: int = 1000,
                       zero_init_residual: bool = True, weights: str | None = None):  # fmt: skip
    """The ResNet-18 of the tiny CPU runs (conftest.small_model), shrunk: one BasicBlock at
    each of widths 16 and 32, the same stem, BatchNorm, zero-init residuals and `fc`
    classifier."""
    from torchvision.models.resnet import BasicBlock

    assert weights is None, "a run that loads weights keeps the model its config names"
    nn = torch.nn

    def block(inplanes, planes, stride=1):
        down = None
        if stride != 1 or inplanes != planes:
            down = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False),
                                 nn.BatchNorm2d(planes))  # fmt: skip
        return BasicBlock(inplanes, planes, stride, down)

    model = nn.Sequential()
    model.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
    model.bn1 = nn.BatchNorm2d(16)
    model.relu = nn.ReLU(inplace=True)
    model.layer1 = block(16, 16)
    model.layer2 = block(16, 32, stride=2)
    model.avgpool = nn.AdaptiveAvgPool2d(1)
    model.flatten = nn.Flatten()
    model.fc = nn.Linear(32, num_classes)
    if zero_init_residual:
        for layer in (model.layer1, model.layer2):
            nn.init.zeros_(layer.bn2.weight)
    return model


def build_dropout_resnet(p: float = 0.5, **kw) -> torch.nn.Module:
    """The small ResNet with dropout before its classifier: a model that draws from each
    rank's torch RNG at every step (`model._target_=tests.helpers.build_dropout_resnet`)."""
    model = build_small_resnet(**kw)
    model.fc = torch.nn.Sequential(torch.nn.Dropout(p), model.fc)
    return model


class RecordingSink(NullSink):
    """logger._target_=tests.helpers.RecordingSink: what the run hands its logger (W&B's
    place), a JSON line per call to $RECORDING_SINK."""

    def _write(self, **what) -> None:
        with open(os.environ["RECORDING_SINK"], "a") as f:
            f.write(json.dumps(what) + "\n")

    def start(self, config=None, run_dir="."):
        self._write(call="start")

    def log(self, metrics, step=None):
        self._write(call="log", step=step)

    def finish(self, summary=None, exit_code=0):
        self._write(call="finish", epochs=(summary or {}).get("epochs"), exit_code=exit_code)
