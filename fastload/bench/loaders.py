"""python -m fastload.bench loaders: each loader strategy x num_workers, feeding a consumer.

For every combination it runs a training-like loop over the synthetic dataset and prints
images/s and the data-wait share (time blocked in `next()` over wall time).

The consumer step:
* on CPU (default): a fixed `--step-ms` sleep, which releases the GIL like a GPU step does
  (CUDA kernels launch asynchronously), so overlap between loading and the step is visible:
  with num_workers=0 the baseline pays load + step per batch, the background thread pays
  about max(load, step);
* `--model resnet50` on CUDA: a real bf16 autocast, channels_last training step, plus the
  same model fed one GPU-resident synthetic batch (the compute ceiling); the `vs_ceiling`
  column is real-data throughput / ceiling (target >= 0.95 for the best strategy).

Loaders are built from the real config by fastload/pipeline.py, as `python train.py` builds
them: extra overrides (backend=turbo, storage=shards, loader.timeout=60) apply.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from fastload.bench.common import (
    at_least,
    check_output,
    check_root,
    compose,
    config_names,
    data_overrides,
    default_dataset,
    format_table,
    pick_names,
    write_json,
)
from fastload.dist import DistContext
from fastload.errors import ConfigError, DatasetError
from fastload.measure import SleepStep, feed
from fastload.pipeline import build_loader, build_plan, prepare_data


def strategy_loader(strategy: str, workers: int, args, root: Path, device: torch.device):
    """loader=<strategy> as train.py builds it (fastload/pipeline.py: prepare_data, then
    build_plan and build_loader), with the command's overrides (backend=, storage=, loader.*)
    honoured; only the training split is prepared, the one timed (a --root needs no val/)."""
    overrides = data_overrides(root, crop=args.size, batch_size=args.batch_size)
    overrides += [f"loader={strategy}", f"loader.num_workers={workers}", *args.override]
    cfg = compose(overrides)
    storage = prepare_data(cfg, DistContext(device=device), splits=("train",))
    plan = build_plan(cfg, storage=storage)
    return build_loader(plan, "train", device=device, channels_last=device.type == "cuda")


class ModelStep:
    """One bf16 autocast, channels_last SGD step of a torchvision model on CUDA."""

    def __init__(self, arch: str, device: torch.device):
        import torchvision

        self.model = getattr(torchvision.models, arch)(num_classes=1000).to(device)
        self.model = self.model.to(memory_format=torch.channels_last).train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.loss = torch.nn.CrossEntropyLoss()

    def train(self, batch) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = self.loss(self.model(batch["image"]), batch["target"])
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def after_step(self) -> None:
        pass  # train() made the update

    def sync(self) -> None:
        torch.cuda.synchronize()


def measure(batches, step, warmup: int, steps: int) -> dict:
    """Images/s, data-wait share and ms per step over `steps` steps after `warmup` untimed
    ones (fastload/measure.py)."""
    return feed(batches, step, warmup=warmup, max_batches=steps).row()


def resident_batches(args, device):
    """The compute ceiling's input: one normalised batch that never leaves the GPU."""
    x = torch.randn(args.batch_size, 3, args.size, args.size, device=device)
    x = x.contiguous(memory_format=torch.channels_last)
    batch = {"image": x, "target": torch.randint(0, 10, (args.batch_size,), device=device)}
    while True:
        yield batch


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m fastload.bench loaders", description=__doc__)
    p.add_argument(
        "--strategies",
        default="baseline,bg,prefetch,prefetch+bg",
        help=f"comma-separated conf/loader/ names, of: {', '.join(config_names('loader'))}",
    )
    p.add_argument("--workers", default="0,2", help="comma-separated num_workers values")
    p.add_argument("--batch-size", type=at_least(1), default=32)
    p.add_argument("--size", type=at_least(1), default=64, help="crop size (224 for ResNet-50)")
    p.add_argument(
        "--warmup", type=at_least(0), default=3, help="untimed steps first (worker start)"
    )
    p.add_argument("--steps", type=at_least(1), default=25, help="timed steps")
    p.add_argument(
        "--step-ms", type=at_least(0, float), default=50.0, help="CPU consumer step (sleep)"
    )
    p.add_argument("--model", default=None, help="e.g. resnet50: real step on CUDA + ceiling")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--root", default=None, help="dataset root (default: the synthetic set)")
    p.add_argument(
        "--train-per-class", type=at_least(1), default=100, help="synthetic set size / 10"
    )
    p.add_argument("--json", default="outputs/bench/loaders.json")
    p.add_argument(
        "override", nargs="*", help="config overrides, e.g. backend=turbo storage=shards"
    )
    args = p.parse_intermixed_args(argv)  # overrides before and after options alike
    args.strategies = ",".join(
        pick_names(p, "--strategies", args.strategies, config_names("loader"))
    )
    if not all(w.strip().isdigit() for w in args.workers.split(",")):
        p.error(f"--workers {args.workers!r}: give comma-separated whole numbers, e.g. 0,2,4")
    check_root(p, args.root)
    check_output(p, "--json", args.json)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv or [])
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    if args.model and device.type != "cuda":
        raise ConfigError(
            f"--model {args.model} needs CUDA; on CPU use --step-ms (a GIL-releasing step)."
        )
    root = Path(args.root) if args.root else default_dataset(train_per_class=args.train_per_class)
    step = ModelStep(args.model, device) if args.model else SleepStep(args.step_ms)
    ceiling = None
    if args.model:
        ceiling = measure(resident_batches(args, device), step, args.warmup, args.steps)
        print(f"compute ceiling (GPU-resident batch): {ceiling['images_per_s']:,.0f} images/s")
    rows = []
    for workers in [int(w) for w in args.workers.split(",")]:
        for strategy in args.strategies.split(","):
            loader = strategy_loader(strategy, workers, args, root, device)
            if args.warmup + args.steps > len(loader):
                loader.close()
                raise DatasetError(
                    f"{root}: {len(loader)} batches of {args.batch_size} per epoch, fewer than "
                    f"--warmup + --steps ({args.warmup + args.steps}): give --root a bigger "
                    f"set (or --train-per-class for the synthetic one), or fewer --steps."
                )
            loader.set_epoch(0)
            row = {"strategy": strategy, "num_workers": workers}
            row.update(measure(loader, step, args.warmup, args.steps))
            if ceiling:
                row["vs_ceiling"] = row["images_per_s"] / ceiling["images_per_s"]
            rows.append(row)
            print(
                f"{strategy:>12} workers={workers}: {row['images_per_s']:8.1f} img/s, "
                f"data wait {100 * row['data_wait_share']:.0f}%",
                flush=True,
            )
    columns = ["strategy", "num_workers", "images_per_s", "data_wait_share", "ms_per_step"]
    columns += ["vs_ceiling"] if ceiling else []
    consumer = f"{args.model} bf16 channels_last" if args.model else f"sleep {args.step_ms:g} ms"
    print(
        f"\nloaders: batch {args.batch_size}, crop {args.size}, {args.steps} timed steps after "
        f"{args.warmup}, consumer step: {consumer}, device {device}"
    )
    print(format_table(rows, columns))
    params = {k: v for k, v in vars(args).items() if k != "json"}
    params.update(device=str(device), root=str(root), ceiling=ceiling)
    print(f"\nwrote {write_json(args.json, 'loaders', params, rows)}")
    return 0
