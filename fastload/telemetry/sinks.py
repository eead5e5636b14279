"""Local metric files (the source of truth for a run) and the do-nothing logger sink.

``metrics.jsonl`` holds one JSON object per epoch, each line flushed and fsynced so a
crash loses at most the epoch being written; ``summary.json`` is replaced atomically so a
reader never sees half a file; ``skipped_files.txt`` lists what dataset.skip_corrupt left out,
a line per file and epoch. A resumed run in the same folder keeps the lines of the epochs its
checkpoint's history holds and drops the others: it redoes those epochs and writes them again.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import numbers
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from fastload.atomic import is_disk_full
from fastload.errors import OutputError
from fastload.host import size_text

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
SKIPPED_FILE = "skipped_files.txt"


def to_jsonable(value: Any) -> Any:
    """Plain JSON data from `value`: numpy/torch scalars and arrays become Python numbers
    and lists, NaN and infinities become None (null), paths and other objects strings."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (Sequence, set, frozenset)) and not isinstance(value, (bytes, bytearray)):
        return [to_jsonable(v) for v in value]  # includes OmegaConf's ListConfig
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    # numpy scalars/arrays and torch tensors all have tolist(); it returns Python values.
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        try:
            return to_jsonable(tolist())
        except Exception:
            pass
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):  # e.g. Fraction
        return to_jsonable(float(value))
    return str(value)


def _fsync_dir(path: Path) -> None:
    """Persist a rename in `path` (best effort: not every OS/filesystem allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    """Write JSON to `path` via a temporary file in the same folder, fsync, os.replace."""
    write_text_atomic(path, json.dumps(to_jsonable(data), indent=2, allow_nan=False) + "\n")


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` to `path` via a temporary file in the same folder, fsync, os.replace."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def room_needed(file: str):
    """A MetricsFiles write of `file` on a full disk (or quota) as one clear OutputError
    naming it, instead of a traceback; the run's files so far stay as they are."""

    def wrap(method):
        @functools.wraps(method)
        def write(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except OSError as exc:
                if not is_disk_full(exc):
                    raise
                free = size_text(shutil.disk_usage(self.run_dir).free)
                raise OutputError(
                    f"no space left to write {self.run_dir / file} ({exc.strerror}; {free} "
                    f"free): free some space there, or set output_root=<a folder with room>. "
                    f"The run's files written before are kept."
                ) from None

        return write

    return wrap


class MetricsFiles:
    """``run_dir/metrics.jsonl`` (one line per epoch) and ``run_dir/summary.json``.

    Write from rank 0 only.
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_FILE
        self.summary_path = self.run_dir / SUMMARY_FILE
        self.skipped_path = self.run_dir / SKIPPED_FILE
        self._checked_tail = False

    @room_needed(METRICS_FILE)
    def append_epoch(self, metrics: Mapping[str, Any]) -> None:
        """Append one JSON line and fsync it."""
        line = json.dumps(to_jsonable(dict(metrics)), allow_nan=False) + "\n"
        with open(self.metrics_path, "a+b") as f:
            if not self._checked_tail:
                # A crash mid-write can leave a line without its newline; appending to it
                # would corrupt the next record too.
                self._checked_tail = True
                if f.seek(0, os.SEEK_END) > 0:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        f.write(b"\n")
            f.write(line.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())

    def read_epochs(self) -> list[dict[str, Any]]:
        """All epoch records, in file order; unreadable lines (a torn last write) are skipped."""
        if not self.metrics_path.exists():
            return []
        records = []
        with open(self.metrics_path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    log.warning("%s:%d: skipping unreadable line", self.metrics_path, lineno)
                    continue
                if isinstance(record, dict):
                    records.append(record)
        return records

    @room_needed(METRICS_FILE)
    def rewrite_epochs(self, records: list[Mapping[str, Any]]) -> None:
        """Replace metrics.jsonl atomically, e.g. to drop epochs past a resumed checkpoint,
        and keep skipped_files.txt's lines of those epochs only."""
        lines = [json.dumps(to_jsonable(dict(r)), allow_nan=False) + "\n" for r in records]
        write_text_atomic(self.metrics_path, "".join(lines))
        self._checked_tail = True
        self.keep_skipped(records)

    @room_needed(SKIPPED_FILE)
    def keep_skipped(self, records: Sequence[Mapping[str, Any]], source: Path | None = None):
        """skipped_files.txt with the lines of `records`' epochs only, taken from `source` (a
        resumed run's folder's list; default this folder's)."""
        source = self.skipped_path if source is None else source
        if not source.is_file():
            return
        epochs = {str(r.get("epoch")) for r in records}
        listed = source.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        kept = [line for line in listed if line.split("\t", 1)[0][len("epoch ") :] in epochs]
        if source != self.skipped_path or len(kept) != len(listed):
            write_text_atomic(self.skipped_path, "".join(kept))

    @room_needed(SKIPPED_FILE)
    def append_skipped(self, epoch: int, files: Sequence[str]) -> None:
        """An epoch's skipped files, a line each: "epoch N<TAB>file"."""
        with open(self.skipped_path, "a", encoding="utf-8") as f:
            f.writelines(f"epoch {epoch}\t{where}\n" for where in files)

    @room_needed(SUMMARY_FILE)
    def write_summary(self, summary: Mapping[str, Any]) -> None:
        """Write summary.json atomically (temporary name, fsync, os.replace)."""
        write_json_atomic(self.summary_path, dict(summary))

    def read_summary(self) -> dict[str, Any] | None:
        if not self.summary_path.exists():
            return None
        return json.loads(self.summary_path.read_text(encoding="utf-8"))


class MetricsSink(Protocol):
    """What the engine calls on an experiment logger (WandbSink, NullSink)."""

    def start(
        self, config: Mapping[str, Any] | None = None, run_dir: str | os.PathLike[str] = "."
    ) -> None: ...

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None: ...

    def finish(
        self, summary: Mapping[str, Any] | None = None, exit_code: int = 0
    ) -> str | None: ...


class NullSink:
    """Logger that does nothing (``logger=none``); local metric files are still written."""

    sync_dir: str | None = None

    def start(
        self, config: Mapping[str, Any] | None = None, run_dir: str | os.PathLike[str] = "."
    ) -> None:
        pass

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        pass

    def finish(self, summary: Mapping[str, Any] | None = None, exit_code: int = 0) -> str | None:
        return None
