"""Shared pieces of the benchmark suites: machine facts, the dataset, tables, JSON."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from fastload.argtypes import at_least  # noqa: F401  (the bench commands import it from here)
from fastload.errors import OutputError
from fastload.host import code_version, usable_cores


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu": cpu,
        "usable_cores": usable_cores(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git_rev": code_version() or "",
    }


def default_dataset(
    root: str | None = None,
    *,
    num_classes: int = 10,
    train_per_class: int = 100,
    val_per_class: int = 25,
    seed: int = 0,
) -> Path:
    """The synthetic ImageNet-style set the default run trains on (generated if missing)."""
    from fastload.data.synthetic import GENERATOR_VERSION, ensure_synthetic_imagenet

    if root is None:
        cache = os.environ.get("FASTLOAD_CACHE", os.path.expanduser("~/.cache/fastload"))
        root = f"{cache}/synthetic-imagenet-g{GENERATOR_VERSION}-c{num_classes}-n{train_per_class}-v{val_per_class}-s{seed}"
    return ensure_synthetic_imagenet(
        root,
        num_classes=num_classes,
        train_per_class=train_per_class,
        val_per_class=val_per_class,
        seed=seed,
    )


def format_table(rows: list[dict], columns: list[str]) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.3f}"
        return "n/a" if v is None else str(v)

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def write_json(path: str | os.PathLike, suite: str, params: dict, rows: list[dict]) -> Path:
    """The results as JSON at `path` (its folder made); an OSError is one OutputError naming
    the path (the table above it is printed already)."""
    path = Path(path)
    payload = {"suite": suite, "machine": machine(), "params": params, "results": rows}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    except OSError as exc:
        raise OutputError(f"cannot write the results to {path}: {os_reason(exc)}") from None
    return path


def os_reason(exc: OSError) -> str:
    """An OSError as one phrase: its strerror and the file it names."""
    where = f": {exc.filename}" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"


def output_problem(path: str | os.PathLike, folder: bool = False) -> str | None:
    """Why `path` (a file to write; `folder`: a folder to write into, made when missing)
    cannot be written, or None. Nothing is left behind: the nearest existing folder on the
    way gets a test file, removed at once."""
    path = Path(path)
    if path.is_dir() and not folder:
        return f"{path} is a folder; give a file name"
    if path.exists() and not path.is_dir() and folder:
        return f"{path} is a file, not a folder"
    if path.exists() and not folder and not os.access(path, os.W_OK):
        return f"{path} is not writable"
    here = path if folder else path.parent
    while not here.exists() and here != here.parent:  # a part that is a file does not exist
        here = here.parent
    if not here.is_dir():
        return f"{here} is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=here):
            pass
    except OSError as exc:
        return f"cannot write in {here} ({exc.strerror or exc})"
    return None


def check_output(p, option: str, path: str | os.PathLike, folder: bool = False) -> None:
    """Refuse (argparse's error) an output `path` that cannot be written, before any work:
    otherwise it is found after the measurement, and its results are lost."""
    problem = output_problem(path, folder)
    if problem:
        p.error(f"{option} {path}: {problem}")


def compose(overrides: list[str]):
    """The real config (conf/), as `python train.py <overrides>` composes it, refused as it
    refuses it (fastload/engine.py: `check_config`): a trainer.batch_size=-1 is one error
    line naming it, not a ValueError from deep in the loader."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from fastload.added_keys import check_added_keys
    from fastload.config import conf_dir
    from fastload.engine import check_config

    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose("config", overrides=list(overrides))
    check_added_keys(cfg, list(overrides))  # no Hydra app here to read them from
    check_config(cfg)
    return cfg


def one_device(cfg):
    """(a one-process DistContext, channels_last) as a run resolves them: trainer.device (auto:
    the first GPU when there is one) and trainer.channels_last (auto: on for CUDA)."""
    from fastload.dist import DistContext, check_gpus_for_ranks

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.trainer.device != "auto":
        device = torch.device(cfg.trainer.device)
    if device.type == "cuda":
        check_gpus_for_ranks(1)
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    channels_last = cfg.trainer.channels_last
    channels_last = device.type == "cuda" if channels_last == "auto" else bool(channels_last)
    return DistContext(device=device), channels_last


def config_names(group: str) -> list[str]:
    """The options of a config group, as train.py takes them: conf/<group>/*.yaml names."""
    from fastload.config import conf_dir

    return sorted(f.stem for f in (conf_dir() / group).glob("*.yaml"))


def pick_names(p, option: str, value: str, valid) -> list[str]:
    """The comma-separated names given to `option`, each one of `valid`; otherwise
    argparse's error (usage, the message, exit 2) listing the valid names."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        what = f"unknown {', '.join(repr(n) for n in unknown)}" if unknown else "no name given"
        p.error(f"{option} {value!r}: {what}; valid names: {', '.join(valid)}")
    return names


def add_peer_options(p, rows: str) -> None:
    """--ffcv-python / --dali-python: the peers' environments (`rows`: what each adds)."""
    for option, peer, script in (("--ffcv-python", "ffcv", "bench_ffcv.py"),
                                 ("--dali-python", "NVIDIA DALI", "bench_dali.py")):  # fmt: skip
        p.add_argument(option, type=peer_python(script),
                       help=f"python of an env with {peer} (scripts/{script}): {rows}")  # fmt: skip


def peer_python(script: str):
    """An argparse `type=` for --ffcv-python / --dali-python: an interpreter that is there
    (a path, or a name on PATH). A wrong one was found only after the whole benchmark ran,
    its rows then missing with exit 0."""

    def parse(text: str) -> str:
        found = shutil.which(text)
        if found is None:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not an executable python; make that environment first "
                f"(`python scripts/{script} --help` says how) and pass its bin/python"
            )
        return text

    return parse


def check_root(p, root: str | None, split: str = "train") -> None:
    """--root, when given, must be a dataset folder holding `split`/ (ImageFolder layout:
    split/<class>/<image>); otherwise argparse's error saying what was expected."""
    if root is None:
        return
    layout = f"an ImageFolder root ({split}/<class>/<image>.jpg)"
    if not Path(root).is_dir():
        p.error(
            f"--root {root}: no such folder; give {layout}, or leave --root out for the "
            f"synthetic set"
        )
    if not (Path(root) / split).is_dir():
        p.error(f"--root {root} has no {split}/ folder; give {layout}")


def data_overrides(root, *, split: str = "train", crop: int = 224, batch_size: int = 64):
    """Point the config at an ImageFolder root with torchvision's RandomResizedCrop(crop)
    defaults (scale 0.08-1), so every benchmark's transform matches the reference rows."""
    return [
        f"dataset.root={root}",
        "dataset.prepare=null",
        f"dataset.train_split={split}",
        f"dataset.train_transform.size={crop}",
        "dataset.train_transform.scale=[0.08,1.0]",
        f"trainer.batch_size={batch_size}",
    ]


def product_loader(cfg, **parts):
    """The training split's loader exactly as training builds it (fastload/pipeline.py), on
    the CPU, from `parts` built already (storage=, backend=); benchmarks time its host stage
    (fastload/measure.py: `host_epoch`): read, decode, augment, collate."""
    from fastload.errors import ConfigError
    from fastload.pipeline import build_loader, build_plan

    plan = build_plan(cfg, **parts)
    if plan.backend.device_decoder is not None:  # its host stage ships undecoded bytes
        raise ConfigError(
            f"backend={plan.backend.name} decodes in device prep, after the host stage these "
            f"rows time: they would count no decode at all. Time it with `python -m "
            f"fastload.bench train` (or bench backends' batched GPU decode row)."
        )
    return build_loader(plan, "train", device="cpu")


def same_round_target(ours: list[float], refs: list[float], factor: float) -> dict:
    """A target judged on same-round ratios (`--rounds`): this machine's speed drifts by
    +-30 % over minutes, so each ratio is of two figures taken in the same round, and the
    verdict is on their median."""
    ratios = [a / b for a, b in zip(ours, refs, strict=True)]
    median = statistics.median(ratios)
    return {
        "factor": factor,
        "img_s": ours,
        "reference_img_s": refs,
        "ratios": ratios,
        "median_ratio": median,
        "met": median >= factor,
    }


def target_text(t: dict) -> str:
    """`same_round_target`'s figures per round, their median, the verdict: one line's end."""
    per = ", ".join(
        f"{a:,.0f} vs {b:,.0f} = {r:.2f}x"
        for a, b, r in zip(t["img_s"], t["reference_img_s"], t["ratios"], strict=True)
    )
    n = len(t["ratios"])
    many = f"; median of {n} rounds {t['median_ratio']:.2f}x" if n > 1 else ""
    return f"{per}{many}, target >= {t['factor']:g}x {'met' if t['met'] else 'NOT met'}"


def run_peer(
    script: str, python: str, root: Path, size: int, workers: int, *options: str, timeout: float
) -> dict:
    """scripts/<script> (a peer loader's benchmark: FFCV, DALI) in the environment of
    `python` on ROOT/train: its JSON result (the last line it prints), or {"error": the last
    line of its output} when it fails or prints no result."""
    path = Path(__file__).resolve().parents[2] / "scripts" / script
    cmd = [python, str(path), "--root", str(root), "--size", str(size)]
    cmd += ["--workers", str(workers), *options]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"{script}: {e}"}
    last = (out.stdout.strip().splitlines() or [""])[-1]
    if out.returncode == 0:
        try:
            return json.loads(last)
        except json.JSONDecodeError:
            pass
    lines = (out.stderr or out.stdout).strip().splitlines()
    return {"error": lines[-1] if lines else f"{script}: exit {out.returncode}"}


def run_ffcv(
    python: str, root: Path, size: int, workers: int, *options: str, timeout: float = 1800
) -> dict:
    """scripts/bench_ffcv.py in an environment with ffcv (see `run_peer`)."""
    return run_peer("bench_ffcv.py", python, root, size, workers, *options, timeout=timeout)


def run_dali(
    python: str, root: Path, size: int, workers: int, *options: str, timeout: float = 1800
) -> dict:
    """scripts/bench_dali.py in an environment with NVIDIA DALI (see `run_peer`)."""
    return run_peer("bench_dali.py", python, root, size, workers, *options, timeout=timeout)
