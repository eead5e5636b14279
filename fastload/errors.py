"""User-facing errors: each names the file or option at fault and the fix.

train.py catches `FastloadError` and prints its message alone (no traceback), so a user
sees one clear line instead of a stack. Errors raised inside DataLoader workers come back
re-wrapped by torch with the worker's traceback prepended; `user_message` recovers ours.
"""

from __future__ import annotations


class FastloadError(Exception):
    """A problem with the user's input or environment that the user can fix."""

    # True for an error every rank raises word for word (fastload/agreement.py: the ranks
    # compared the same records): train.py prints it once per node, not once per rank.
    alike_on_every_rank = False

    @property
    def user_message(self) -> str:
        text = str(self)
        # torch's ExceptionWrapper re-raises `type(exc)(msg)` where msg is
        # "Caught X in DataLoader worker process N.\nOriginal Traceback ...\n<module>.X: <ours>".
        marker = f"{type(self).__module__}.{type(self).__qualname__}: "
        cut = text.rfind(marker)
        if "Original Traceback" in text and cut >= 0:
            return text[cut + len(marker) :].strip()
        return text


class ConfigError(FastloadError):
    """An option has a value that cannot work; the message names the option."""


class DatasetError(FastloadError):
    """A dataset root is missing, empty or not in the expected layout."""


class NotAnImageFolder(DatasetError):
    """A split folder that is there but does not read as an image folder (no class folders,
    no images, an unreadable folder): a pack made from it earlier is out of date, not a
    pack whose source is elsewhere."""


class CorruptImageError(FastloadError):
    """An image file could not be decoded; the message names the file."""


class CheckpointError(FastloadError):
    """A checkpoint cannot be read or does not fit this run."""


class OutputError(FastloadError):
    """A run's own files (metrics, summary, skipped-file list) cannot be written."""


class StorageError(FastloadError):
    """A store (staged copy, LMDB, packed shards) is missing, does not fit, or is corrupt."""


class LoaderStallError(FastloadError):
    """The loader produced no batch within loader.timeout; the message names the stuck worker."""


def alike(error: FastloadError) -> FastloadError:
    """`error`, marked as raised word for word on every rank of a node (the ranks compared
    the same gathered records, or checked the same command line): train.py prints it once
    per node (`printed_here`)."""
    error.alike_on_every_rank = True
    return error


def printed_here(error: FastloadError) -> bool:
    """Whether this process prints `error` on the console: every rank but where all of a
    node's ranks raise the same words, which its local rank 0 alone prints (each rank's
    log file still gets it)."""
    from fastload.host import local_rank

    return not error.alike_on_every_rank or local_rank() == 0


def to_log_files(line: str) -> None:
    """A line train.py prints to stderr alone (the error that ends a run) written to the
    run's log files too: train.log is rank 0's log "as on the console", and a run's folder
    would otherwise not say why it stopped."""
    import logging

    for handler in {*logging.getLogger().handlers, *logging.getLogger("fastload").handlers}:
        if isinstance(handler, logging.FileHandler):
            record = {"name": "fastload", "levelno": logging.ERROR, "levelname": "ERROR"}
            handler.handle(logging.makeLogRecord({**record, "msg": line}))


def user_error(exc: BaseException | None) -> FastloadError | None:
    """The FastloadError behind `exc`: itself, or the cause Hydra's InstantiationException
    wraps when a yaml's _target_ refused its options; None for anything else."""
    while exc is not None and not isinstance(exc, FastloadError):
        exc = exc.__cause__
    return exc


def hydra_one_line(message: str) -> str:
    """Hydra's composition error (a misspelt option or group choice, with the choices it
    has) without its config search path, on one line."""
    text = message.split("\nConfig search path")[0].strip()
    return text.replace("\n\n", "; ").replace("\n\t", " ").replace("\n", " ")
