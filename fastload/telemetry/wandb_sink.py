"""Weights & Biases logger (``logger=wandb``) that can never stop the training.

W&B files go to ``run_dir/wandb/``. Offline is the default: nothing leaves the machine
until the user runs the ``wandb sync <dir>`` command that `finish()` returns.

What wandb 0.31 writes in offline mode, and why this class adds to it: the run folder
``run_dir/wandb/offline-run-<time>-<id>/`` holds ``run-<id>.wandb`` (the binary record
log: run + config, history rows, summaries) and ``files/`` (only ``requirements.txt``
and, with console capture, ``output.log``); ``config.yaml`` and ``wandb-summary.json``
are never written offline. The record log is buffered and flushed every 15 s by default,
so a run killed early left a 7-byte file with no config. Hence: the flush interval is
shortened, and the resolved config is written at start to ``files/resolved_config.json``
(also registered with ``run.save(policy="now")`` so ``wandb sync`` uploads it).
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fastload.errors import ConfigError
from fastload.telemetry.sinks import to_jsonable, write_json_atomic

log = logging.getLogger("fastload")

MODES = ("offline", "online", "disabled")
CONFIG_FILE = "resolved_config.json"
TAG_CHARS = 64  # W&B refuses a longer (or empty) tag at wandb.init
# Seconds between flushes of wandb's record log (wandb's default: 15 s). Epoch-level
# logging makes flushing cheap; a crash then loses at most this much of the W&B record.
_FLUSH_INTERVAL_S = 2.0
_TEARDOWN_TIMEOUT_S = 60.0
# How long run.finish() may take (online: the last uploads) before the run goes on without it;
# `wandb sync <dir>` then uploads what the run folder holds.
_FINISH_TIMEOUT_S = 120.0


class WandbTimeout(TimeoutError):
    pass


def checked_mode(mode: Any) -> str:
    if mode not in MODES:
        raise ConfigError(
            f"logger.mode={mode!r}: use one of {', '.join(MODES)} (logger=none: no W&B at all)."
        )
    return mode


def checked_timeout(seconds: Any) -> float:
    ok = isinstance(seconds, int | float) and not isinstance(seconds, bool)
    if not (ok and math.isfinite(seconds) and seconds > 0):
        raise ConfigError(
            f"logger.init_timeout_s={seconds!r}: use a number of seconds > 0 (how long "
            f"wandb.init may take before the run goes on without W&B), e.g. 60."
        )
    return float(seconds)


def checked_tags(tags: Any) -> list[str]:
    """logger.tags as W&B takes them: one word is one tag (logger.tags=baseline), a list is
    its tags (logger.tags=[baseline,bs256])."""
    if tags is None:
        return []
    fix = "use one tag (logger.tags=baseline) or a list of them (logger.tags=[baseline,bs256])"
    if isinstance(tags, str):
        tags = [tags]
    elif not isinstance(tags, Sequence):  # Hydra passes a list as a ListConfig
        raise ConfigError(f"logger.tags={tags!r}: {fix}.")
    out = []
    for tag in tags:
        if isinstance(tag, bool) or not isinstance(tag, str | int | float):
            raise ConfigError(f"logger.tags: {tag!r} is not a tag; {fix}.")
        if not 1 <= len(str(tag)) <= TAG_CHARS:
            raise ConfigError(
                f"logger.tags: {str(tag)!r} has {len(str(tag))} characters; W&B takes tags of "
                f"1 to {TAG_CHARS}."
            )
        out.append(str(tag))
    return out


def is_wandb(options: Mapping[str, Any] | None) -> bool:
    """Whether the config's `logger` node builds this sink (logger=wandb)."""
    return bool(options) and options.get("_target_") == f"{__name__}.WandbSink"


def check_options(options: Mapping[str, Any] | None) -> None:
    """logger=wandb's options (the config's `logger` node), refused by name before any work
    (engine.check_config); a logger of another _target_ is not checked."""
    if not is_wandb(options):
        return
    checked_mode(options.get("mode", "offline"))
    checked_timeout(options.get("init_timeout_s", 60.0))
    checked_tags(options.get("tags"))


def credentials_missing() -> str | None:
    """For logger.mode=online: what to do when wandb would find no credentials, else None.

    wandb.init looks in the same places (wandb.sdk.lib.wbauth's system auth): the
    WANDB_API_KEY or WANDB_IDENTITY_TOKEN_FILE environment variable, the netrc entry that
    `wandb login` writes for the W&B host, an api_key in wandb's settings file. Looked up
    without a network call and without a prompt; a wandb version whose lookup this cannot
    reach gives None (the run then tries, and a failure is in train.log and summary.json).
    wandb.login(prompt=False) is not used: it asks the server who the user is."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    try:
        import wandb  # noqa: F401
    except ImportError:
        return None  # start() says the package is missing
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth

        settings = wandb_setup.singleton().settings
        found = wbauth.authenticate_session(
            host=settings.base_url, source="fastload", prompt=False, update_session=False
        )
    except ImportError:
        return None
    except Exception as exc:  # noqa: BLE001 - e.g. a malformed key in the netrc file
        if type(exc).__name__ != "AuthenticationError":
            return None
        return (
            f"logger.mode=online: W&B cannot use its credentials ({exc}). Run `wandb login "
            f"--relogin`, set WANDB_API_KEY, or log offline with logger.mode=offline."
        )
    if found is not None:
        return None
    return (
        f"logger.mode=online: no W&B API key for {settings.base_url}. Run `wandb login` (or "
        f"set WANDB_API_KEY), or log offline with logger.mode=offline (the default; the run "
        f"prints the `wandb sync` command that uploads it later)."
    )


def check_login(options: Mapping[str, Any] | None) -> None:
    """logger=wandb logger.mode=online without W&B credentials: refused before any work
    (the run would train, then find out at wandb.init); no network call."""
    if is_wandb(options) and options.get("mode") == "online":
        missing = credentials_missing()
        if missing:
            raise ConfigError(missing)


def _settings(wandb: Any, init_timeout_s: float) -> Any:
    wanted: dict[str, Any] = {
        "init_timeout": float(init_timeout_s),
        # No stdout/stderr capture: it rewires the streams of a training process, and the
        # metrics we care about are logged explicitly.
        "console": "off",
        # No banner or end-of-run chatter; finish() hands the sync command to the caller.
        "silent": True,
        "x_transaction_log_flush_interval": _FLUSH_INTERVAL_S,
    }
    # Settings is a strict pydantic model in recent wandb; other versions know other fields.
    fields = getattr(wandb.Settings, "model_fields", None)
    if fields is not None:
        wanted = {k: v for k, v in wanted.items() if k in fields}
    try:
        return wandb.Settings(**wanted)
    except Exception:
        return wandb.Settings(init_timeout=float(init_timeout_s))


def _call_with_deadline(fn: Any, kwargs: dict[str, Any], deadline_s: float, what: str) -> Any:
    """Call ``fn(**kwargs)`` on a daemon thread; raise WandbTimeout after deadline_s.

    For wandb.init, wandb's own init_timeout only covers part of init (the backend
    handshake); this guard also covers a hung service start. A run that completes after we
    gave up is finished at once so it does not linger.
    """
    box: dict[str, Any] = {}
    lock = threading.Lock()
    done = threading.Event()

    def target() -> None:
        try:
            result = fn(**kwargs)
        except BaseException as exc:  # delivered to the caller below
            with lock:
                box["error"] = exc
            done.set()
            return
        with lock:
            late = box.get("abandoned", False)
            if not late:
                box["result"] = result
        done.set()
        if late and hasattr(result, "finish"):  # a wandb run we no longer want
            try:
                result.finish()
            except Exception:
                pass

    thread = threading.Thread(target=target, name=f"fastload-{what}", daemon=True)
    thread.start()
    done.wait(deadline_s)
    with lock:
        if "result" in box:
            return box["result"]
        if "error" in box:
            raise box["error"]
        box["abandoned"] = True
    raise WandbTimeout(f"{what} did not return within {deadline_s:.1f} s")


def without_none(values: Mapping[str, Any]) -> dict:
    """JSON-able values, the None ones (e.g. GPU fields without a GPU) left out: W&B has
    no null, and a missing key keeps a chart's gaps honest."""
    return {k: v for k, v in to_jsonable(dict(values)).items() if v is not None}


class WandbSink:
    """Logs the resolved config and per-epoch metrics to W&B; rank 0 only.

    Any W&B failure (package missing, init error or timeout, a failing log call, a close
    that fails or takes too long) is logged once (the `fastload` logger: the console and
    train.log) and turns the sink into a no-op; the local metrics files remain the record.
    `error` keeps the first one, for summary.json and the final table.
    """

    def __init__(
        self,
        project: str = "fastload",
        mode: str = "offline",
        entity: str | None = None,
        name: str | None = None,
        tags: Sequence[str] | str | None = (),
        group: str | None = None,
        init_timeout_s: float = 60.0,
    ) -> None:
        self.project = project
        self.mode = checked_mode(mode)
        self.entity = entity
        self.name = name
        self.tags = checked_tags(tags)
        self.group = group
        self.init_timeout_s = checked_timeout(init_timeout_s)
        self._run: Any = None
        self._log_failed = False
        self.error: str | None = None  # the first failure that cost W&B data, in short
        self.sync_dir: str | None = None  # wandb's folder for this run, once started
        self.config_path: Path | None = None  # our copy of the config, written at start

    @property
    def active(self) -> bool:
        """True while a W&B run is open."""
        return self._run is not None

    def start(
        self, config: Mapping[str, Any] | None = None, run_dir: str | os.PathLike[str] = "."
    ) -> None:
        """Open the W&B run under ``run_dir/wandb/``; on failure warn and stay local-only."""
        if self.mode == "disabled" or self._run is not None:
            return
        try:
            import wandb
        except ImportError:
            self._fail(
                "the wandb package is not installed (pip install wandb)",
                "logger=wandb but the wandb package is not installed (pip install wandb); "
                "logging locally only",
            )
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        plain_config = to_jsonable(dict(config or {}))
        kwargs = dict(
            project=self.project,
            entity=self.entity,
            name=self.name,
            tags=self.tags or None,
            group=self.group,
            mode=self.mode,
            dir=str(run_dir),
            config=plain_config,
            settings=_settings(wandb, self.init_timeout_s),
        )
        # A little beyond wandb's own timeout so that its (clearer) error wins when it fires.
        deadline_s = self.init_timeout_s * 1.1 + 1.0
        try:
            run = _call_with_deadline(wandb.init, kwargs, deadline_s, "wandb.init")
        except Exception as exc:
            cause = f"{type(exc).__name__}: {exc}"
            self._fail(f"init failed ({cause})", f"W&B init failed ({cause}); logging locally only")
            return
        self._run = run
        try:
            self.sync_dir = str(run.settings.sync_dir)
            files_dir = Path(run.settings.files_dir)
            files_dir.mkdir(parents=True, exist_ok=True)
            self.config_path = files_dir / CONFIG_FILE
            write_json_atomic(self.config_path, plain_config)
            run.save(str(self.config_path), base_path=str(files_dir), policy="now")
        except Exception as exc:
            self._warn(f"could not save the config into the W&B run folder: {exc}")

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log one epoch's metrics; None values (e.g. GPU fields without a GPU) are dropped."""
        if self._run is None or self._log_failed:
            return
        data = without_none(metrics)
        try:
            # committed now: a row held open until the next step would land after, and
            # overwrite, the summary that finish() sets
            self._run.log(data, step=step, commit=True)
        except Exception as exc:
            cause = f"{type(exc).__name__}: {exc}"
            self._fail(f"log failed ({cause})", f"W&B log failed ({cause}); W&B logging stopped")
            self._log_failed = True  # keep the run: finish() still closes it

    def finish(self, summary: Mapping[str, Any] | None = None, exit_code: int = 0) -> str | None:
        """Close the run; return ``"wandb sync <dir>"`` for an offline run (or one whose
        close did not end in time), else None. `summary` (summary.json's numbers:
        steady-state means, the best metric) becomes the run's summary; W&B would otherwise
        show the last epoch's values in its runs table. `exit_code`: the process's (128 +
        the signal of a stopped run), what W&B shows as the run's state."""
        run, self._run = self._run, None
        if run is None:
            return None
        if summary:
            data = without_none(summary)
            try:
                run.summary.update(data)
            except Exception as exc:
                self._warn(f"W&B summary failed ({type(exc).__name__}: {exc})")
        try:
            kwargs = {"exit_code": int(exit_code)}
            _call_with_deadline(run.finish, kwargs, _FINISH_TIMEOUT_S, "wandb finish")
        except WandbTimeout:
            left = (
                f"; `wandb sync {shlex.quote(self.sync_dir)}` uploads it" if self.sync_dir else ""
            )
            self._fail(
                f"closing the run took over {_FINISH_TIMEOUT_S:g} s",
                f"W&B did not close its run within {_FINISH_TIMEOUT_S:g} s; the run goes on "
                f"without it (its record may lack the last rows{left})",
            )
            return f"wandb sync {shlex.quote(self.sync_dir)}" if self.sync_dir else None
        except Exception as exc:
            cause = f"{type(exc).__name__}: {exc}"
            self._fail(f"finish failed ({cause})", f"W&B finish failed ({cause})")
        # wandb 0.31's finish() returns before its service has closed the run's record log
        # (the last rows and the exit record are written asynchronously); teardown waits for
        # that, so the files are complete when we print the sync command.
        try:
            import wandb

            _call_with_deadline(wandb.teardown, {}, _TEARDOWN_TIMEOUT_S, "wandb.teardown")
        except Exception as exc:
            cause = f"{type(exc).__name__}: {exc}"
            self._fail(f"teardown failed ({cause})", f"W&B teardown failed ({cause})")
        try:
            offline = bool(run.offline)
        except Exception:
            offline = self.mode == "offline"
        if offline and self.sync_dir:
            return f"wandb sync {shlex.quote(self.sync_dir)}"
        return None

    def _fail(self, short: str, message: str) -> None:
        """A failure that costs W&B data: logged, and the first one kept as `error`."""
        if self.error is None:
            self.error = short
        self._warn(message)

    @staticmethod
    def _warn(message: str) -> None:
        log.warning(message)
