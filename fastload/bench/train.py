"""python -m fastload.bench train: the real training loop, end to end, against its ceiling.

    python -m fastload.bench train --step-ms 40 --epochs 6 --steps-per-epoch 30   # CPU proxy
    python -m fastload.bench train --model resnet50 --epochs 5 --steps-per-epoch 40 \\
        trainer.batch_size=256 trainer.compile=true loader.num_workers=14 backend=turbo

Runs the engine's own epoch loop (fastload/engine.py: train, evaluate, epoch boundaries,
the evaluation loader's warm start) for N epochs of S steps through the configured data path
(every override honoured: backend=, storage=, loader=, dataset=...), then the same loop fed
one batch that never leaves the device: the end-to-end ceiling. Per epoch and for the whole
run, boundaries and evaluation included: images/s, data-wait share, ratio to the ceiling.

The step: `--model NAME` (conf/model/NAME.yaml) trains that model with the configured
precision, channels_last and torch.compile, on the GPU; `--step-ms MS` replaces the model with
a fixed step that releases the GIL (as a GPU step does: kernels launch asynchronously), an
evaluation step costing a third of it (a forward pass), so the loader's side can be measured
on any machine. Nothing is written but the JSON: no checkpoints, no W&B, no metric files.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from fastload.bench.common import (
    at_least,
    check_output,
    compose,
    format_table,
    one_device,
    write_json,
)
from fastload.measure import EVAL_STEP_SHARE, SleepStep


def all_threads():
    """torch.profiler's setting that records every thread's torch ops, not only the starting
    thread's and autograd's: device prep's thread (backend=nvjpeg's decode, its phases named
    nvjpeg.*) is in the trace beside the training thread. None where torch lacks it."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        return None


class Timeline:
    """What `Epochs` records, kept in memory: each epoch's row and its full wall time (from the
    previous epoch's end, so the boundary and the evaluation are inside). With `trace`, the
    last epoch (boundary and evaluation included) runs under torch.profiler, written there."""

    checkpoint_path = Path("(bench: none written)")
    checkpoints = False

    def __init__(self, epochs: int, trace: Path | None = None):
        self.rows: list[dict] = []
        self.epochs, self.trace, self.profiler = epochs, trace, None
        self.t = time.perf_counter()

    def epoch(self, row: dict) -> None:
        now = time.perf_counter()
        self.rows.append({**row, "wall_s": now - self.t})
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler.export_chrome_trace(str(self.trace))
            self.profiler = None
        elif self.trace is not None and len(self.rows) == self.epochs - 1:
            self.start_profiler()
        self.t = time.perf_counter()  # the profiler's start-up and export not in an epoch

    def start_profiler(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        activities += [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
        self.profiler = profile(activities=activities, experimental_config=all_threads())
        self.profiler.start()

    def save(self, state) -> None:
        pass

    def save_best(self, model, of: str, epoch: int, value: float) -> None:
        pass

    def skipped(self, epoch: int, files: list) -> None:
        pass


class ResidentLoader:
    """The ceiling's loader: one device-ready batch, `n` times per epoch, never reloaded."""

    first_batch_s = 0.0

    def __init__(self, batch: dict, n: int):
        self.batch, self.n = batch, n

    def set_epoch(self, epoch: int, skip_batches: int = 0, stretches=()) -> None:
        self.skip = skip_batches

    def batches_in(self, epoch: int) -> int:
        return self.n

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return (self.batch for _ in range(self.n))


class ResidentData:
    """A DataPath whose loaders are resident batches (no storage, no decode)."""

    def __init__(self, data, train_batch: dict, val_batch: dict):
        self.train = ResidentLoader(train_batch, len(data.train))
        self.val = ResidentLoader(val_batch, len(data.val))

    def before_epoch(self, ctx=None) -> None:
        pass

    def epoch_stats(self, ctx, epoch: int) -> dict:
        return {}

    def close(self) -> None:
        pass


def first_batch(loader) -> dict:
    loader.set_epoch(0)
    for batch in loader:
        return batch
    raise RuntimeError("the loader produced no batch")


def run_loop(cfg, ctx, data, args, amp, channels_last, trace=None) -> tuple[list[dict], float]:
    """The engine's epoch loop over `data`; (per-epoch rows, total seconds). With `trace`, one
    more epoch runs profiled (its trace written there), left out of both."""
    from fastload.engine import Epochs
    from fastload.tasks.base import build_task
    from fastload.train_state import TrainState

    torch.manual_seed(cfg.seed)
    state = TrainState.create(
        cfg, ctx.device, 1, len(data.train), amp=amp, channels_last=channels_last
    )
    task = build_task(cfg)
    if args.model:
        step = task.step(state, cfg, ctx, amp)
    else:
        step = SleepStep(args.step_ms, ctx.device)
    timeline = Timeline(cfg.trainer.epochs, trace)
    t0 = timeline.t
    Epochs(cfg, ctx, state, step, data, timeline, task).run()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    if trace is not None:
        return timeline.rows[:-1], sum(r["wall_s"] for r in timeline.rows[:-1])
    return timeline.rows, total


def epoch_rows(rows: list[dict], ceiling: list[dict]) -> list[dict]:
    """Per epoch: its whole wall time (boundary and evaluation included) against the
    ceiling's same epoch; images/s over that wall; the training part's data-wait share."""
    out = []
    for r, c in zip(rows, ceiling, strict=True):
        out.append(
            {
                "epoch": r["epoch"],
                "wall_s": r["wall_s"],
                "train_s": r["epoch_time_s"],
                "eval_s": r.get("eval_time_s", 0.0),
                "images_per_s": r["train_images"] / r["wall_s"],
                "data_wait_share": r["data_wait_share"],
                "vs_ceiling": c["wall_s"] / r["wall_s"],
                "ceiling_wall_s": c["wall_s"],
                "ceiling_train_s": c["epoch_time_s"],
            }
        )
    return out


def summarize(rows, total_s, ceiling_s, steps: int, val_batches: int, args, ceiling=()) -> dict:
    images = sum(r["train_images"] for r in rows)
    # Epochs >= 2 alone: epoch 1 holds torch.compile's compilation (a minute for ResNet-50,
    # not the same in the two loops: the second hits the compile caches) and the workers' start.
    later = sum(r["wall_s"] for r in rows[1:])
    later_ceiling = sum(c["wall_s"] for c in ceiling[1:])
    # The training part alone (evaluation and the boundary left out): where a run loses to
    # the ceiling, this says whether training or evaluation is behind.
    trained = sum(r["epoch_time_s"] for r in rows[1:])
    trained_ceiling = sum(c["epoch_time_s"] for c in ceiling[1:])
    out = {
        "epochs": len(rows),
        "wall_s": total_s,
        "images_per_s": images / total_s,
        "ceiling_wall_s": ceiling_s,
        "ceiling_images_per_s": images / ceiling_s,
        "vs_ceiling": ceiling_s / total_s,
        # of the training parts, as each epoch's: evaluation's waits are not timed, so over
        # the whole wall it came out diluted (0.19 for epochs of 0.29-0.33)
        "data_wait_share": sum(r["data_wait_s"] for r in rows)
        / sum(r["epoch_time_s"] for r in rows),
        # the worst epoch's share, not a share of epochs 2 on together: the target is per epoch
        "worst_data_wait_share_epochs_2_on": max(
            (r["data_wait_share"] for r in rows[1:]), default=None
        ),
        "vs_ceiling_epochs_2_on": later_ceiling / later if later and later_ceiling else None,
        "train_vs_ceiling_epochs_2_on": (
            trained_ceiling / trained if trained and trained_ceiling else None
        ),
    }
    if not args.model:  # the CPU proxy: every step at its fixed cost, nothing else
        evals = sum(1 for r in rows if "eval_time_s" in r)
        step_s = args.step_ms / 1000
        steps_s = len(rows) * steps * step_s
        steps_s += evals * val_batches * step_s * EVAL_STEP_SHARE
        out.update(steps_time_s=steps_s, vs_steps_time=steps_s / total_s)
    return out


def parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m fastload.bench train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    step = p.add_mutually_exclusive_group()
    step.add_argument("--model", help="conf/model/<NAME>: a real training step (GPU)")
    step.add_argument(
        "--step-ms", type=at_least(0, float), help="a fixed GIL-releasing step (default 50)"
    )
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--steps-per-epoch", type=int, default=30)
    p.add_argument("--json", default="outputs/bench/train.json")
    p.add_argument(
        "--profile", action="store_true",
        help="one more epoch of the run and of its ceiling under torch.profiler, left out of "
        "the figures: prints where the GPU time went per CUDA stream, writes the two traces "
        "beside --json",
    )  # fmt: skip
    p.add_argument("override", nargs="*", help="train.py overrides: backend=turbo loader=bg ...")
    args = p.parse_intermixed_args(argv)  # overrides before and after options alike
    if args.model is None and args.step_ms is None:
        args.step_ms = 50.0
    if args.epochs < 1 or args.steps_per_epoch < 1:
        p.error("--epochs and --steps-per-epoch must be >= 1")
    check_output(p, "--json", args.json)
    return args


def build(args):
    """(config, rank context, data path, autocast dtype, channels_last) as fit builds them."""
    from fastload.engine import amp_dtype
    from fastload.errors import ConfigError
    from fastload.pipeline import build_data, build_plan, prepare_data

    overrides = [*args.override, "logger=none", "trainer.progress=false"]
    overrides += [f"trainer.epochs={args.epochs + int(args.profile)}"]
    overrides += [f"trainer.max_steps_per_epoch={args.steps_per_epoch}"]
    overrides += [f"model={args.model}"] if args.model else []
    cfg = compose(overrides)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.trainer.device != "auto":
        device = torch.device(cfg.trainer.device)
    if args.model and device.type != "cuda":
        raise ConfigError(f"--model {args.model} needs a GPU; on a CPU machine use --step-ms MS.")
    ctx, channels_last = one_device(cfg)
    device = ctx.device
    storage = prepare_data(cfg, ctx)
    data = build_data(build_plan(cfg, storage=storage), ctx, channels_last=channels_last)
    return cfg, ctx, data, amp_dtype(cfg.trainer.precision, device), channels_last


def main(argv: list[str] | None = None) -> int:
    args = parse(argv or [])
    if not args.model:
        # A GPU box's training thread does no math of its own (kernels run on the GPU); here
        # its device prep would otherwise fight the workers for the cores with a thread pool.
        torch.set_num_threads(1)
    cfg, ctx, data, amp, channels_last = build(args)
    if len(data.train) < args.steps_per_epoch:
        print(f"note: an epoch of this data has {len(data.train)} steps < --steps-per-epoch")
    traces = trace_paths(args.json) if args.profile else (None, None)
    try:
        rows, total = run_loop(cfg, ctx, data, args, amp, channels_last, traces[0])
        resident = ResidentData(data, first_batch(data.train), first_batch(data.val))
        ceiling, ceiling_total = run_loop(cfg, ctx, resident, args, amp, channels_last,
                                          traces[1])  # fmt: skip
    finally:
        data.close()
    per_epoch = epoch_rows(rows, ceiling)
    summary = summarize(
        rows, total, ceiling_total, len(data.train), len(data.val), args, ceiling=ceiling
    )
    step = f"model {args.model}" if args.model else f"fixed step {args.step_ms:g} ms"
    print(
        f"\nbench train: {args.epochs} epochs x {args.steps_per_epoch} steps, batch "
        f"{cfg.trainer.batch_size}, {step}, device {ctx.device}, loader={cfg.loader._target_}, "
        f"{data.backend.info().get('decoder')}, {len(data.train.dataset)} training images"
    )
    print(format_table(per_epoch, list(per_epoch[0])))
    print()
    print(format_table([summary], list(summary)))
    print_targets(summary, args)
    results = per_epoch + [{"epoch": "all", **summary}]
    if args.profile:
        results.append({"epoch": "profiled", **print_profile(*traces)})
    params = {**vars(args), "config_overrides": args.override, "device": str(ctx.device)}
    path = write_json(args.json, "train", params, results)
    print(f"wrote {path}")
    return 0


def trace_paths(json_path: str) -> tuple[Path, Path]:
    """The run's and the ceiling's trace files, beside the JSON."""
    stem = Path(json_path).with_suffix("")
    stem.parent.mkdir(parents=True, exist_ok=True)
    return Path(f"{stem}.trace.json"), Path(f"{stem}.ceiling.trace.json")


def print_profile(run_trace: Path, ceiling_trace: Path) -> dict:
    """The profiled epoch of the run beside the ceiling's: GPU time per stream, blocking calls."""
    from fastload.bench.gpu_timeline import idle_line, summarize_file, table_rows

    got = {"run": summarize_file(run_trace), "ceiling": summarize_file(ceiling_trace)}
    streams, calls = [], []
    for label, summary in got.items():
        s, c = table_rows(label, summary)
        streams += s
        calls += c
        busy = summary["gpu_busy_share"]
        print(f"\nprofiled epoch, {label}: {summary['window_ms']:,.0f} ms, the GPU busy "
              + ("n/a (no GPU activity recorded)" if busy is None else f"{100 * busy:.1f} %"))  # fmt: skip
        line = idle_line(summary)
        if line:
            print(f"  the model's {line}")
    if streams:
        print(format_table(streams, list(streams[0])))
    if calls:
        print("\nhost calls that wait for the GPU (or its allocator):")
        print(format_table(calls, list(calls[0])))
    print(f"traces: {run_trace} and {ceiling_trace} (ui.perfetto.dev)")
    return got


def print_targets(summary: dict, args) -> None:
    wait = summary["worst_data_wait_share_epochs_2_on"]
    if wait is not None:
        verdict = "met" if wait <= 0.02 else "NOT met"
        print(f"epochs >= 2: worst data-wait share {100 * wait:.1f} % (target <= 2 %): {verdict}")
    if "vs_steps_time" in summary:
        r = summary["vs_steps_time"]
        verdict = "met" if r >= 0.95 else "NOT met"
        print(f"whole run: steps x step time / wall = {r:.3f} (target >= 0.95): {verdict}")
    else:
        for key, what in (("vs_ceiling", "whole run"), ("vs_ceiling_epochs_2_on", "epochs >= 2")):
            r = summary[key]
            if r is not None:
                verdict = "met" if r >= 0.95 else "NOT met"
                print(f"{what} vs the GPU-resident ceiling: {r:.3f} (target >= 0.95): {verdict}")
        r = summary["train_vs_ceiling_epochs_2_on"]
        if r is not None:
            print(f"epochs >= 2, the training part alone (no evaluation): {r:.3f} of the "
                  "ceiling's")  # fmt: skip
