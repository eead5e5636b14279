"""Console output: the per-epoch progress bar and the end-of-run summary table."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from typing import Any

from tqdm import tqdm


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except Exception:
        return False


class ProgressBar:
    """tqdm bar on stderr whose postfix shows ``img/s`` and data ``wait %``.

    With ``enabled=False`` (ranks other than 0) every call returns at once. The postfix
    is reformatted at most every `postfix_interval_s`, so per-step cost stays negligible.
    """

    def __init__(
        self,
        total: int | None,
        enabled: bool = True,
        desc: str = "",
        postfix_interval_s: float = 0.5,
    ) -> None:
        self.enabled = enabled
        self.postfix_interval_s = postfix_interval_s
        self._next_postfix = 0.0
        self._bar = (
            tqdm(
                total=total,
                desc=desc,
                file=sys.stderr,
                dynamic_ncols=True,
                leave=False,
                # Redirected to a file (batch jobs), every redraw is another line of log.
                mininterval=0.5 if _isatty(sys.stderr) else 30.0,
                unit="step",
            )
            if enabled
            else None
        )

    def update(
        self,
        n: int = 1,
        images_per_s: float | None = None,
        data_wait_share: float | None = None,
    ) -> None:
        bar = self._bar
        if bar is None:
            return
        bar.update(n)
        now = time.monotonic()
        if now >= self._next_postfix and (images_per_s is not None or data_wait_share is not None):
            self._next_postfix = now + self.postfix_interval_s
            parts = []
            if images_per_s is not None:
                parts.append(f"img/s={images_per_s:,.0f}")
            if data_wait_share is not None:
                parts.append(f"wait={100.0 * data_wait_share:.0f}%")
            # refresh=False: tqdm redraws on its own schedule (mininterval).
            bar.set_postfix_str(" ".join(parts), refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _num(value: Any) -> float | None:
    """A finite float, or None for missing/None/NaN/non-numeric values."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def best_metric_row(summary: Mapping[str, Any], fmt) -> tuple[str, str]:
    if summary.get("metric_label"):
        return summary["metric_label"], fmt(
            "best_metric", ".4g", unit=summary.get("metric_unit", "")
        )
    return "best top-1", fmt("best_acc1", ".2f", unit=" %")


def ema_metric_row(summary: Mapping[str, Any], fmt) -> list[tuple[str, str]]:
    """The EMA's best (trainer.ema), when the run kept one."""
    if "best_ema_metric" not in summary:
        return []
    label = summary.get("metric_label") or "best top-1"
    unit = summary.get("metric_unit", "") if summary.get("metric_label") else " %"
    return [(f"{label} (EMA)", fmt("best_ema_metric", ".4g", unit=unit))]


def steady_epochs(rows: list[dict]) -> list[dict]:
    """The epoch rows that show the steady state: not the first epoch of a process, which
    carries its start-up (workers, caches, compilation), the run's and a resumed run's alike
    (`start_up_epoch`; in rows written before that key: the first row); all rows when no
    other is left."""
    return [r for i, r in enumerate(rows) if i and not r.get("start_up_epoch")] or rows


# The amount behind each per-epoch rate: what over_seconds sums where a row holds it.
AMOUNTS = {"images_per_s": "train_images", "data_wait_share": "data_wait_s"}


def over_seconds(rows: list[dict], key: str) -> float | None:
    """`key` (a per-epoch rate, share or mean) over `rows` weighted by their seconds: each
    row's amount (AMOUNTS: train_images, data_wait_s; else its `key` x its seconds), summed,
    over their seconds, summed; None when no row holds either. A mean of per-epoch rates
    counts a 2 s epoch as much as an 8 s one (two epochs of 1,000 images: 312 img/s for a
    true 200)."""
    total, amounts = AMOUNTS.get(key), []
    for r in rows:
        t = r.get("epoch_time_s")
        if not t:
            continue
        if total and r.get(total) is not None:
            amounts.append((float(r[total]), t))
        elif r.get(key) is not None:
            amounts.append((float(r[key]) * t, t))
    seconds = sum(t for _, t in amounts)
    return sum(a for a, _ in amounts) / seconds if seconds > 0 else None


def whole_epochs(rows: list[dict]) -> list[dict]:
    """The rows of epochs trained whole: not one a run resumed inside of, whose time covers
    only its last steps (`resumed_at_step`); all rows when no other is left."""
    return [r for r in rows if r.get("resumed_at_step") is None] or rows


def format_summary_table(summary: Mapping[str, Any]) -> str:
    """A short aligned plain-text table of a run's summary; missing/None values show "n/a".

    Summary keys (all optional):
      ``epochs`` (int), ``epoch_time_s_mean`` (s), ``images_per_s`` (the steady epochs'
      images over their seconds), ``data_wait_share`` (fraction 0..1, the same way),
      ``gpu_util_mean`` (percent 0..100, weighted by the epochs' seconds),
      ``peak_pss_mib`` / ``peak_rss_sum_mib`` (MiB, process tree: PSS summed, RSS
      summed; one rank's tree, the largest, when ``world_size`` > 1), ``best_metric`` (the task's validation metric at its best) with
      ``metric_label`` / ``metric_unit`` (default: top-1, percent; ``best_acc1`` also read),
      ``best_ema_metric`` (the same for the EMA of the weights, a row only when present),
      ``run_dir`` (str), ``wandb_dir`` (W&B run folder), ``wandb_sync`` (sync command;
      shown instead of ``wandb_dir`` when present), ``wandb_error`` (why W&B failed: the
      W&B row says so, not n/a as for logger=none).
    """

    def fmt(key: str, spec: str, scale: float = 1.0, unit: str = "") -> str:
        x = _num(summary.get(key))
        return "n/a" if x is None else f"{x * scale:{spec}}{unit}"

    def text(*keys: str) -> str:
        for key in keys:
            value = summary.get(key)
            if value not in (None, ""):
                return str(value)
        return "n/a"

    def memory() -> str:
        pss, rss = _num(summary.get("peak_pss_mib")), _num(summary.get("peak_rss_sum_mib"))
        # each rank samples its own process tree: the row holds the largest rank's
        per_rank = " of the largest rank" if (_num(summary.get("world_size")) or 1) > 1 else ""
        if pss is None:
            return (
                "n/a"
                if rss is None
                else f"{rss:,.0f} MiB summed RSS{per_rank} (shared pages counted per process)"
            )
        return f"{pss:,.0f} MiB PSS{per_rank}" + (
            "" if rss is None else f" (summed RSS {rss:,.0f} MiB)"
        )

    def wandb() -> str:
        where, error = text("wandb_sync", "wandb_dir"), summary.get("wandb_error")
        if not error:
            return where
        error = str(error).splitlines()[0]
        error = error if len(error) <= 100 else error[:99] + "…"
        return f"failed: {error}" + ("" if where == "n/a" else f"; {where}")

    epochs = summary.get("epochs")
    rows = [
        ("epochs", str(epochs) if epochs is not None else "n/a"),
        ("time / epoch", fmt("epoch_time_s_mean", ",.1f", unit=" s")),
        ("images / s", fmt("images_per_s", ",.0f")),
        ("data wait", fmt("data_wait_share", ".1f", 100.0, " %")),
        ("GPU util", fmt("gpu_util_mean", ".0f", unit=" %")),
        ("peak memory", memory()),
        best_metric_row(summary, fmt),
        *ema_metric_row(summary, fmt),
        ("run directory", text("run_dir")),
        ("W&B", wandb()),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
