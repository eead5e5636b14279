"""What every rank of a run must have alike, compared once at the start: the config (but for
node-local folders), fastload's code, and each split's samples.

Each node starts its ranks with its own command line, and reads its own copy of the data:
nothing else makes them alike. A node given another seed or LR trains a replica that drifts
from the others unseen; a node whose dataset.root holds a file fewer plans other batches
(some samples trained twice, others never) and runs another number of steps, and the ranks
then wait for one another until the process group's timeout (30 minutes), with nothing in
train.log. So every rank shares a small record (`run_record` in the run directory's check,
the first collective of a run; `data_record` when the data is built) and every rank raises
the same error, naming the rank and host that differs from rank 0, what differs and the fix.
"""

from __future__ import annotations

import functools
import importlib.metadata
from pathlib import Path

import numpy as np
import xxhash

from fastload import dist
from fastload.checkpoint import flatten
from fastload.errors import ConfigError, DatasetError, alike
from fastload.host import hostname

# Config keys that may differ from node to node, left out of the comparison. Each names where
# a node keeps or finds something of its own: its copy of the dataset, its staged copy, pack
# or shard cache (their contents are compared instead: `data_record`), or its output folder
# (only rank 0 writes the run's files; the checkpoint each rank resumes is compared by
# engine.same_checkpoint). Hydra's keys hold the run directory and this node's command line.
# Any other difference is refused: another value of anything else changes what a rank
# computes, or how many steps or collectives it runs.
NODE_LOCAL = (
    "hydra",
    "output_root",
    "dataset.root",
    "dataset.layout.root",  # ${..root}
    "dataset.prepare.root",  # ${..root}
    "storage.path",
    "storage.target_dir",
    "storage.cache_dir",
    "storage.url",
    "backend.scratch_dir",  # accimage's scratch files
)


# Settings of a node's own resources, which may differ between unlike nodes (more cores, less
# RAM): they change how fast a rank's batches come, never which samples they hold or how
# many there are (each sample's pixels are a function of (seed, epoch, index) alone).
HOST_RESOURCES = (
    "loader.num_workers",
    "loader.prefetch_factor",
    "loader.pin_memory",
    "loader.pin_memory_max_mb",
    "loader.timeout",
    "storage.threads",
    "storage.reserve_gb",
    "storage.cache_gb",  # the WebDataset shard cache on the node's disk
    "storage.progress",
    "backend.cpu_threads",
    "trainer.progress",
    "loader.auto",  # rank 0 probes and sends its choice to every rank: only its own is read
)


def node_local(key: str) -> bool:
    return any(key == p or key.startswith(p + ".") for p in NODE_LOCAL + HOST_RESOURCES)


def shared_config(cfg) -> dict:
    """The resolved config, flattened ('optim.base_lr'), without the node-local keys."""
    from omegaconf import OmegaConf

    flat = flatten(OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False))
    values = {
        k: OmegaConf.select(cfg, k, throw_on_missing=False) for k in flat if not node_local(k)
    }
    return {
        k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
        for k, v in values.items()
    }


def config_digest(values: dict) -> str:
    return xxhash.xxh3_128(repr(sorted(values.items())).encode()).hexdigest()


@functools.cache
def code_identity() -> str:
    """fastload's version and a digest of its sources (every .py and .c file of the package,
    by path and content, read once: ~150 files, milliseconds): another commit, or a local
    edit, gives another digest whatever the version number says."""
    try:
        version = importlib.metadata.version("fastload")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        version = "(not installed)"
    package = Path(__file__).resolve().parent
    h = xxhash.xxh3_128()
    for path in sorted(p for ext in ("*.py", "*.c") for p in package.rglob(ext)):
        h.update(f"{path.relative_to(package)}\0".encode())
        h.update(path.read_bytes())
    return f"fastload {version}, sources {h.hexdigest()[:16]}"


def run_record(cfg) -> dict:
    """What this rank compares with rank 0 before any work: its config and its code."""
    return {
        "host": hostname(),
        "config": config_digest(shared_config(cfg)),
        "code": code_identity(),
    }


def differing(records: list[dict], key) -> list[int]:
    """The ranks whose `key(record)` differs from rank 0's."""
    first = key(records[0])
    return [r for r, rec in enumerate(records) if key(rec) != first]


def where(records: list[dict], rank: int) -> str:
    return f"rank {rank} (host {records[rank]['host']})"


def also(ranks: list[int]) -> str:
    more = ranks[1:]
    return (
        f" (and rank(s) {', '.join(map(str, more[:8]))}{' ...' if len(more) > 8 else ''})"
        if more
        else ""
    )


def check_runs_alike(cfg, ctx, records: list[dict]) -> None:
    """Every rank runs rank 0's fastload code with rank 0's config (but for `NODE_LOCAL`
    keys); else the same ConfigError on every rank. Where the configs differ, every rank
    then shares its config (a second collective, on this path only) to name the keys."""
    code = differing(records, lambda rec: rec["code"])
    if code:
        r = code[0]
        raise alike(
            ConfigError(
                f"{where(records, r)}{also(code)} runs other fastload code than "
                f"{where(records, 0)}: {records[r]['code']} there, {records[0]['code']} on rank 0. "
                f"Every node must run the same fastload (the same commit, without local "
                f"changes): install it alike on every node, or run it from one shared checkout."
            )
        )
    config = differing(records, lambda rec: rec["config"])
    if not config:
        return
    configs = dist.gathered(ctx, "comparing the configurations", lambda: shared_config(cfg))
    r, mine, theirs = config[0], configs[0], configs[config[0]]
    missing = "(unset)"
    diff = [f"{k}: {mine.get(k, missing)!r} -> {theirs.get(k, missing)!r}"
            for k in sorted(set(mine) | set(theirs))
            if mine.get(k, missing) != theirs.get(k, missing)]  # fmt: skip
    shown = "; ".join(diff[:8]) + (f"; and {len(diff) - 8} more" if len(diff) > 8 else "")
    raise alike(
        ConfigError(
            f"{where(records, r)}{also(config)} was started with another configuration than "
            f"{where(records, 0)} ({shown}; rank 0's -> rank {r}'s). Every rank of a run must "
            f"train with the same settings: another seed or LR trains a replica that drifts from "
            f"the others, another batch size or epoch count leaves ranks waiting for each other. "
            f"Start every node with the same command line; only node-local folders and host "
            f"resources may differ ({', '.join(k for k in NODE_LOCAL + HOST_RESOURCES if k != 'hydra')})."
        )
    )


def feed(h, value) -> None:
    if hasattr(value, "digest_into"):  # fed as the array it stands for (folder.TextColumn)
        value.digest_into(h)
    elif isinstance(value, np.ndarray):
        value = np.ascontiguousarray(value)
        h.update(f"{value.dtype.str}{value.shape}\0".encode())
        h.update(value)
    else:
        h.update(f"{value}\0".encode("utf-8", "surrogateescape"))


def split_fingerprint(reader) -> str:
    """'<kind>:<xxh3-128>' of a split's records as its reader indexes them, in order: their
    count, classes, schema, int fields (labels, ids) and names (`Reader.identity`: a
    folder's relative file names, a pack's checksums). Nothing is read from the files; a
    file renamed, added, removed or moved to another class changes it. The kind says what
    the names are: fingerprints of other kinds (a folder and its pack) are not compared."""
    kind, names = reader.identity()
    h = xxhash.xxh3_128()
    h.update(f"{len(reader)}\0{list(reader.classes)!r}\0{list(reader.schema.names)!r}\n".encode())
    for f in reader.schema.columns:
        feed(h, np.asarray(reader.column(f.name), np.int64))
    for part in names:
        feed(h, part)
    return f"{kind}:{h.hexdigest()}"


def data_record(datasets: dict, root) -> dict:
    """What this rank compares with rank 0 once its data is built: each split's samples
    (the dataset's length) and fingerprint; `root` (its dataset.root) for the message."""
    return {
        "host": hostname(),
        "root": str(root),
        "splits": {
            split: {"samples": len(ds), "fingerprint": split_fingerprint(ds.reader)}
            for split, ds in datasets.items()
        },
    }


def check_data_alike(records: list[dict]) -> None:
    """Every rank has rank 0's samples in each split, in the same order; else the same
    DatasetError on every rank, naming the split."""
    for split in records[0]["splits"]:
        ranks = differing(records, lambda rec, s=split: rec["splits"].get(s))
        if not ranks:
            continue
        r = ranks[0]
        have, want = records[r]["splits"].get(split) or {}, records[0]["splits"][split]
        if have.get("samples") != want["samples"]:
            what = (f"{have.get('samples')} samples from dataset.root={records[r]['root']} "
                    f"there, {want['samples']} from dataset.root={records[0]['root']} on rank 0")  # fmt: skip
        elif not str(want.get("fingerprint")).startswith("files:"):
            # a pack's fingerprint is of its checksums: the same samples packed again with
            # other settings, or re-encoded by another Pillow, differ too
            what = (f"as many samples ({want['samples']}), but another pack of them (other "
                    f"records or checksums: other data, or packed with other settings or "
                    f"another Pillow; dataset.root={records[r]['root']} there, "
                    f"{records[0]['root']} on rank 0)")  # fmt: skip
        else:
            what = (f"as many samples ({want['samples']}), but other files, labels or order "
                    f"(dataset.root={records[r]['root']} there, {records[0]['root']} on rank 0)")  # fmt: skip
        raise alike(
            DatasetError(
                f"{where(records, r)}{also(ranks)} reads another {split} split than "
                f"{where(records, 0)}: {what}. Every rank must train on the same data: a node's "
                f"own copy that differs would train some samples twice and others never, and its "
                f"ranks would run another number of steps than the others. Make each node's "
                f"dataset.root (and any pack made of it) the same as rank 0's, e.g. copy it again "
                f"with rsync -a --delete, or point every node at one shared copy."
            )
        )
