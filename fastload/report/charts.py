"""The report's PNG charts (matplotlib, headless): normalised training time with the
repeats' spread as error bars, each bar's run count and the baseline marked (a bar of a
single run is hatched, without an error bar); epoch time, GPU utilisation and
data-wait share per variant. Every axis says its unit; a missing value (no GPU) is drawn as
an empty bar labelled n/a rather than left out, so the variants line up across panels."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on servers and in CI
import matplotlib.pyplot as plt  # noqa: E402

BASE_COLOUR, OTHER_COLOUR = "#7f7f7f", "#1f77b4"


def _labels(rows) -> list[str]:
    """Tick labels: the values alone when one option varies (its name goes in the axis
    label), else one `option=value` per line."""
    parts = [r["variant"].split() for r in rows]
    keys = {p.split("=", 1)[0] for ps in parts for p in ps}
    if len(keys) == 1 and all("=" in p for ps in parts for p in ps):
        return ["\n".join(p.split("=", 1)[1] for p in ps) for ps in parts]
    return ["\n".join(ps) for ps in parts]


def _axis_name(rows) -> str:
    keys = {p.split("=", 1)[0] for r in rows for p in r["variant"].split()}
    return next(iter(keys)) if len(keys) == 1 else "variant"


def _bar(ax, rows, key: str, scale: float, unit: str, title: str) -> None:
    xs = range(len(rows))
    vals = [r[key] for r in rows]
    colours = [BASE_COLOUR if r["baseline"] else OTHER_COLOUR for r in rows]
    ax.bar(xs, [0 if v is None else v * scale for v in vals], color=colours)
    for x, v in zip(xs, vals, strict=True):
        if all(u is None for u in vals):
            break  # one note for the whole panel below
        text = "n/a" if v is None else f"{v * scale:.3g}"
        ax.annotate(text, (x, 0 if v is None else v * scale), ha="center", va="bottom",
                    fontsize=8)  # fmt: skip
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(unit)
    ax.set_xticks(list(xs), _labels(rows), fontsize=7, rotation=20, ha="right")
    ax.set_xlabel(_axis_name(rows), fontsize=8)
    if all(v is None for v in vals):
        ax.set_yticks([])
        ax.text(0.5, 0.5, "not measured here\n(no GPU on this machine)", ha="center",
                va="center", transform=ax.transAxes, fontsize=9, color="dimgray")  # fmt: skip
    else:
        top = max(v * scale for v in vals if v is not None)
        ax.set_ylim(0, top * 1.18 if top > 0 else 1)


def runs_text(rows) -> str:
    """How many runs each bar's median is of: the range when the bars differ."""
    lo, hi = min(r["runs"] for r in rows), max(r["runs"] for r in rows)
    if lo == hi:
        return f"median of {lo} run{'s' if lo > 1 else ''}"
    return f"median of {lo}–{hi} runs"


def normalized_chart(rows, out: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(max(6.5, 1.3 * len(rows)), 4.2), dpi=110)
    xs = list(range(len(rows)))
    med = [r["normalized"] or 0 for r in rows]
    colours = [BASE_COLOUR if r["baseline"] else OTHER_COLOUR for r in rows]
    # a single run has no spread: hatched and without an error bar, since a bar whose
    # min = max = median draws the caps of a spread too tight to see
    single = [r["runs"] < 2 for r in rows]
    bars = ax.bar(xs, med, color=colours)
    for bar, one in zip(bars, single, strict=True):
        if one:
            bar.set_hatch("//")
            bar.set_alpha(0.55)
    spread = [i for i, one in enumerate(single) if not one]
    if spread:
        ax.errorbar(
            [xs[i] for i in spread],
            [med[i] for i in spread],
            yerr=[
                [med[i] - (rows[i]["normalized_min"] or med[i]) for i in spread],
                [(rows[i]["normalized_max"] or med[i]) - med[i] for i in spread],
            ],
            fmt="none",
            ecolor="black",
            capsize=4,
        )
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="baseline = 1.0")
    for x, m, r in zip(xs, med, rows, strict=True):
        top = max(m, r["normalized_max"] or m)  # above the error bar, not on it
        ax.annotate(f"{m:.2f}×\nn={r['runs']}", (x, top), ha="center", va="bottom",
                    fontsize=8, xytext=(0, 3), textcoords="offset points")  # fmt: skip
    ax.set_xticks(xs, _labels(rows), fontsize=8, rotation=20, ha="right")
    ax.set_xlabel(_axis_name(rows), fontsize=9)
    ax.set_ylabel("training time ÷ baseline's\n(lower is better)")
    top = max([1.0] + [r["normalized_max"] or 0 for r in rows])
    ax.set_ylim(0, top * 1.3)
    note = ", hatched = 1 run (no spread)" if any(single) else ""
    ax.set_title(f"{title}: training time vs baseline (grey)\n{runs_text(rows)} (n per bar), "
                 f"error bars = min–max{note}", fontsize=10)  # fmt: skip
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path = out / "normalized_time.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def per_variant_chart(rows, out: Path, title: str) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(max(10, 3.2 * len(rows)), 4.2), dpi=110)
    _bar(axes[0], rows, "epoch_time_s", 1.0, "seconds", "epoch time (steady epochs)")
    _bar(axes[1], rows, "gpu_util_mean", 1.0, "percent", "GPU utilisation")
    _bar(axes[2], rows, "data_wait_share", 100.0, "percent of epoch", "data-wait share")
    fig.suptitle(f"{title}: per variant (grey = baseline)", fontsize=11)
    fig.tight_layout()
    path = out / "per_variant.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def write_charts(rows, out: Path, title: str) -> list[Path]:
    return [normalized_chart(rows, out, title), per_variant_chart(rows, out, title)]
