"""Compare runs: `python -m fastload.report RUN_DIR... [--out DIR] [--baseline loader=baseline]`.

Each run directory (what train.py writes: metrics.jsonl, summary.json, .hydra/overrides.yaml)
becomes one run; runs whose overrides differ only in `+repeat=` or `resume=` (a repeat that
was interrupted and finished with resume=auto) are repeats of one variant.
The variant's name is the overrides that differ between the variants (so `loader=bg`, not the
30 overrides every run shares); when all runs are one variant's repeats, `all runs`. Per
variant: the median of the runs' training time (every epoch's `epoch_time_s`, summed; an
epoch resumed inside of is timed for the new process's start-up and the steps after the
resume only, so the images it did not train are added at the run's steady speed: an
estimate, see Run.train_time) with its spread (min..max over repeats), that time normalised
to the baseline variant's median, and the medians of the runs' steady-state epoch time (the
mean over the epochs without a process's start-up), images/s and data-wait share (those
epochs' images and data wait summed over their seconds summed) and GPU utilisation (their
means weighted by their seconds). Written as report.md (the table),
report.json and PNG charts (fastload/report/charts.py); the table is printed. report.json
also says what made it (`made`: the report tool's `git describe --always --dirty`, null
outside git, the host and the date) and each run's folder, variant and the host and commit
its folder records (null where none); runs from several hosts or commits get a warning.
"""

from __future__ import annotations

import datetime
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from fastload.errors import FastloadError
from fastload.host import code_version, hostname
from fastload.telemetry.report import over_seconds, steady_epochs, whole_epochs

# overrides that make a repeat, not a variant: its number; resume=auto finishing it
REPEAT_KEYS = ("+repeat", "repeat", "resume", "+resume")


class ReportError(FastloadError):
    pass


@dataclass
class Run:
    path: Path
    overrides: dict[str, str]
    epochs: list[dict]
    summary: dict
    origin: dict = field(default_factory=dict)  # host / commit, where the folder records them

    def train_time(self, fallback_speed: float | None = None) -> float:
        """The epochs' measured times summed; for an epoch resumed inside of
        (`resumed_at_step`), an estimate of the whole epoch: its measured time (the new
        process's start-up and the steps after the resume) plus the images it did not train
        at a steady speed: the run's own (`steady_speed`), else `fallback_speed` (its
        variant's other repeats'), else the run's whole epochs' (start-up included, so an
        over-estimate). The measured time is never scaled: it holds the start-up, which a
        scale by whole / trained images multiplies (resumed at step 99 of 100 after 30 s of
        start-up, that counted 3,060 s for about 90 s). The stopped process's time inside
        that epoch was lost with it, so its images count at the steady speed. A whole epoch
        is the median images of the epochs trained whole; with none, the epoch counts as
        measured."""
        whole = [r.get("train_images") for r in self.epochs if "resumed_at_step" not in r]
        whole = [n for n in whole if n]
        full = statistics.median(whole) if whole else None
        speed = (
            self.steady_speed()
            or fallback_speed
            or over_seconds(whole_epochs(self.epochs), "images_per_s")
        )
        total = 0.0
        for r in self.epochs:
            t, n = float(r["epoch_time_s"]), r.get("train_images")
            if "resumed_at_step" in r and full and n is not None and speed:
                t += max(full - n, 0) / speed
            total += t
        return total

    def steady_speed(self) -> float | None:
        """Images/s over the epochs trained whole without a process's start-up: their
        images summed over their times summed; None when the run has no such epoch."""
        rows = [r for i, r in enumerate(self.epochs)
                if i and not r.get("start_up_epoch") and "resumed_at_step" not in r]  # fmt: skip
        return over_seconds(rows, "images_per_s")

    def steady(self, key: str) -> float | None:
        """The mean over the epochs without a process's start-up (the first, and the first
        after a resume), or over all when none is left."""
        rows = steady_epochs(self.epochs)
        vals = [float(r[key]) for r in rows if r.get(key) is not None]
        return statistics.fmean(vals) if vals else None

    def steady_rate(self, key: str) -> float | None:
        """Images/s, data-wait share or GPU utilisation over the same epochs as `steady`,
        weighted by their seconds (telemetry/report.py: over_seconds), not a mean of rates."""
        return over_seconds(steady_epochs(self.epochs), key)


@dataclass
class Variant:
    name: str
    runs: list[Run] = field(default_factory=list)

    def tokens(self) -> set[str]:
        """What --baseline matches: its name's `key=value`s and every override its runs
        share (a lone variant named `all runs` is still `loader=baseline`), lower case, as
        Hydra writes booleans True / False."""
        shared = set.intersection(*({f"{k.lstrip('+')}={v}" for k, v in r.overrides.items()
                                     if k not in REPEAT_KEYS} for r in self.runs))  # fmt: skip
        return {t.lower() for t in shared | set(self.name.split())}

    def steady_speed(self) -> float | None:
        """The median of its runs' steady speeds: for a resumed repeat that has none of its
        own (a 2-epoch run resumed inside its second epoch)."""
        speeds = [s for s in (r.steady_speed() for r in self.runs) if s]
        return statistics.median(speeds) if speeds else None

    def run_time(self, run: Run) -> float:
        return run.train_time(self.steady_speed())

    def stat(self, value) -> tuple[float | None, float | None, float | None]:
        vals = [v for v in (value(r) for r in self.runs) if v is not None]
        if not vals:
            return None, None, None
        return statistics.median(vals), min(vals), max(vals)


def read_run(path: Path) -> Run:
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(
            f"{path} is not a finished run directory (no metrics.jsonl): pass the folders "
            f"train.py wrote, e.g. outputs/reproduce/<name>/<size>-<time>/<job number>."
        )
    epochs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if not epochs:
        raise ReportError(f"{metrics} holds no epoch: the run stopped before its first epoch.")
    summary_file = path / "summary.json"
    if not summary_file.is_file():  # train.py writes it once the last epoch is done
        raise ReportError(
            f"{path} holds {len(epochs)} epoch(s) but no summary.json: the run did not finish "
            f"(stopped, crashed or still running), so its training time would read as a "
            f"faster run's. Finish it (the same command plus resume=auto) or leave it out."
        )
    summary = json.loads(summary_file.read_text())
    overrides_file = path / ".hydra" / "overrides.yaml"
    overrides = {}
    if overrides_file.is_file():
        for item in OmegaConf.load(overrides_file) or []:
            key, _, value = str(item).partition("=")
            overrides[key] = value
    return Run(path, overrides, epochs, summary, _origin(path, summary))


# where a run folder may say what made it: summary.json (train.py's end-of-run record) and
# .fastload-run.json (the launch that claimed the folder: fastload/run_folder.py)
ORIGIN_KEYS = {"host": ("host", "hostname"), "commit": ("commit", "git_describe", "git_rev")}


def _origin(path: Path, summary: dict) -> dict:
    """The host and commit the run's folder records, each None where it records none."""
    try:
        marker = json.loads((path / ".fastload-run.json").read_text())
    except (OSError, ValueError):
        marker = {}
    sources = [s for s in (summary, marker) if isinstance(s, dict)]
    return {
        what: next((str(s[k]) for s in sources for k in keys if s.get(k)), None)
        for what, keys in ORIGIN_KEYS.items()
    }


def provenance(runs: list[Run]) -> tuple[dict, list[str]]:
    """What made the report and its runs, and a warning for each origin the runs differ in
    (times from two machines or two commits compare those as well as the variants)."""
    made = {
        "commit": code_version(),  # the report tool's own checkout
        "host": hostname(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    warnings = []
    for what in ORIGIN_KEYS:
        seen = sorted({r.origin[what] for r in runs if r.origin.get(what)})
        if len(seen) > 1:
            warnings.append(
                f"the runs come from {len(seen)} {what}s ({', '.join(seen)}): their times "
                f"compare those as well as the variants (report.json's runs say which is which)."
            )
    return made, warnings


def group_variants(runs: list[Run]) -> list[Variant]:
    """Runs -> variants named by the overrides that differ between runs (repeats merged),
    in the order their first run appears (a sweep's job order). Runs that differ in repeat
    keys only (one variant's repeats, e.g. the baseline's folders alone) are one variant,
    `all runs` (the overrides they share, which name it, are a sweep's dozen or more)."""
    keys = sorted({k for r in runs for k in r.overrides if k not in REPEAT_KEYS})
    varying = [k for k in keys if len({r.overrides.get(k) for r in runs}) > 1]
    if not varying:
        return [Variant("all runs", list(runs))]
    variants: dict[str, Variant] = {}
    for run in runs:
        name = " ".join(f"{k.lstrip('+')}={run.overrides.get(k, '-')}" for k in varying)
        variants.setdefault(name, Variant(name)).runs.append(run)
    return list(variants.values())


def pick_baseline(variants: list[Variant], baseline: str | None) -> Variant:
    if baseline is None:
        return variants[0]
    wanted = set(baseline.lower().split())  # Hydra writes booleans as True / False
    matches = [v for v in variants if wanted <= v.tokens()]
    exact = [v for v in matches if wanted == set(v.name.lower().split())]
    if len(matches) == 1 or len(exact) == 1:
        return exact[0] if exact else matches[0]
    if matches:  # taking the first would normalise, e.g., two sweeps' runs to one sweep's
        names = "; ".join(v.name for v in matches)
        raise ReportError(
            f"--baseline {baseline!r} matches {len(matches)} variants: {names}. Name one "
            f"whole, e.g. --baseline {matches[0].name!r}, or report one sweep's run folders."
        )
    names = ", ".join(v.name for v in variants)
    if len(variants) == 1:  # `all runs`: what it could be named by
        names += f" (its overrides: {' '.join(sorted(variants[0].tokens() - {'all', 'runs'}))})"
    raise ReportError(f"--baseline {baseline!r} matches no variant; the variants are: {names}.")


def summarize(variants: list[Variant], base: Variant) -> list[dict]:
    """One row per variant: medians, spreads and the normalised time."""
    base_s = base.stat(base.run_time)[0]
    rows = []
    for v in variants:
        med, lo, hi = v.stat(v.run_time)
        rows.append(
            {
                "variant": v.name,
                "baseline": v is base,
                "runs": len(v.runs),
                "train_s": med,
                "train_s_min": lo,
                "train_s_max": hi,
                "normalized": med / base_s if base_s else None,
                "normalized_min": lo / base_s if base_s else None,
                "normalized_max": hi / base_s if base_s else None,
                "epoch_time_s": v.stat(lambda r: r.steady("epoch_time_s"))[0],
                "images_per_s": v.stat(lambda r: r.steady_rate("images_per_s"))[0],
                "data_wait_share": v.stat(lambda r: r.steady_rate("data_wait_share"))[0],
                "gpu_util_mean": v.stat(lambda r: r.steady_rate("gpu_util_mean"))[0],
                "metric": _metric(v),
            }
        )
    return rows


def _metric(v: Variant) -> dict | None:
    """The task's final validation metric (median over repeats), e.g. val_acc1."""
    name = next((r.summary.get("metric") for r in v.runs if r.summary.get("metric")), None)
    if name is None:
        return None
    value = v.stat(lambda r: r.epochs[-1].get(name))[0]
    return {"name": name, "value": value}


def _fmt(x, spec: str, scale: float = 1.0, unit: str = "") -> str:
    return "n/a" if x is None else f"{x * scale:{spec}}{unit}"


def markdown_table(rows: list[dict], title: str = "") -> str:
    head = (
        "| variant | runs | train time (median, min–max) | vs baseline | epoch time | "
        "images/s | data wait | GPU util | metric |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [f"### {title}\n" if title else "", head]
    for r in rows:
        name = f"**{r['variant']}** (baseline)" if r["baseline"] else r["variant"]
        spread = f"{_fmt(r['train_s'], '.1f')} s ({_fmt(r['train_s_min'], '.1f')}–" \
                 f"{_fmt(r['train_s_max'], '.1f')})"  # fmt: skip
        m = r["metric"]
        metric = "n/a" if not m or m["value"] is None else f"{m['name']} {m['value']:.3g}"
        lines.append(
            f"| {name} | {r['runs']} | {spread} | {_fmt(r['normalized'], '.2f')}× | "
            f"{_fmt(r['epoch_time_s'], '.2f', unit=' s')} | {_fmt(r['images_per_s'], ',.0f')} | "
            f"{_fmt(r['data_wait_share'], '.1f', 100, ' %')} | "
            f"{_fmt(r['gpu_util_mean'], '.0f', unit=' %')} | {metric} |"
        )
    return "\n".join(line for line in lines if line) + "\n"


def build_report(run_dirs, out: Path, baseline: str | None = None, title: str = "") -> dict:
    """Read the runs, write report.md / report.json / the charts into `out`; the table."""
    from fastload.report.charts import write_charts

    paths = [Path(p) for p in run_dirs]
    if all(p.name.isdigit() for p in paths):  # a sweep's job folders: job order, not 0,1,10,2
        paths.sort(key=lambda p: (str(p.parent), int(p.name)))
    runs = [read_run(p) for p in paths]
    if not runs:
        raise ReportError("no run directories given.")
    variants = group_variants(runs)
    rows = summarize(variants, pick_baseline(variants, baseline))
    table = markdown_table(rows, title)
    try:
        out.mkdir(parents=True, exist_ok=True)
        charts = write_charts(rows, out, title or "experiment")
        made, warnings = provenance(runs)
        md = table + "\n" + "".join(f"![{c.stem}]({c.name})\n" for c in charts)
        md += (f"\nReport made {made['date']} on {made['host']} from commit "
               f"{made['commit'] or 'n/a (not a git checkout)'}.\n")  # fmt: skip
        md += "".join(f"\nWarning: {w}\n" for w in warnings)
        (out / "report.md").write_text(md)
        variant_of = {id(r): v.name for v in variants for r in v.runs}
        report = {
            "title": title,
            "rows": rows,
            "charts": [c.name for c in charts],
            "made": made,
            "warnings": warnings,
            "runs": [
                {"folder": str(r.path), "variant": variant_of[id(r)], **r.origin} for r in runs
            ],  # fmt: skip
        }
        (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    except OSError as exc:  # the runs were read: only the output folder can be at fault here
        raise ReportError(
            f"cannot write the report into {out} ({exc.strerror or exc}): give --out a "
            f"writable folder."
        ) from None
    return {"table": table, **report}
