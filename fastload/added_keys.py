"""Keys added on the command line (`+key=value`, `++key=value`) that nothing would read.

Hydra refuses `trainer.lr_typo=0.5` (not in the config) and its message says "To append to
your config use +trainer.lr_typo=0.5". Followed, that composes fine and the run trains
without the setting, exit 0. So an added key is refused before any work unless something
can read it:

* a key some shipped yaml has at that place (conf/<group>/*.yaml, or a `_global_` file such
  as an experiment= or variant=): the code reads those, some with a default where the
  chosen option leaves them out (`optim.clip_grad_norm`, `dataset.annotations`);
* a key below an option that a shipped yaml leaves empty for the user to fill
  (`storage.storage_options: {}`, fsspec's options);
* a parameter of the class or function its node is built with (`_target_`), which receives
  it (`+backend.scratch_dir=...`), or anything where that takes `**kwargs`;
* Hydra's own settings (`+hydra.job.env_set.X=1`) and config groups (`+experiment=...`);
* the sweep axes in SWEEP_AXES, which only tell runs apart;

but never an argument the code passes itself (SET_BY_CODE: the optimizer's lr and
weight_decay), which would be overridden.
"""

from __future__ import annotations

import difflib
import functools
import inspect

from omegaconf import DictConfig, OmegaConf

from fastload.errors import ConfigError

# Keys a sweep adds only to tell its runs apart: scripts/reproduce repeats each variant with
# `+repeat=0,1,2`, and the report groups the runs by their overrides (fastload/report/).
SWEEP_AXES = frozenset({"repeat"})


# Arguments of a built class that the code always passes itself, so that one added in the
# config is overridden without a word: the optimizer's learning rate and weight decay come
# from these options (fastload/optim.py: build_optimizer).
SET_BY_CODE = {
    "optim.optimizer.lr": "optim.base_lr (scaled by the global batch)",
    "optim.optimizer.weight_decay": "optim.weight_decay",
}


def check_added_keys(cfg: DictConfig, overrides: list[str] | None = None) -> None:
    """ConfigError naming the first `+key=` / `++key=` override that nothing reads, with the
    options there and the closest one. `overrides`: the command line's (Hydra's task
    overrides when None; nothing to check outside a Hydra run)."""
    if overrides is None:
        overrides = task_overrides(cfg)
    for key, text in added(overrides):
        problem = unread(cfg, key)
        if problem is not None:
            raise ConfigError(f"{text}: {problem}")


def task_overrides(cfg: DictConfig) -> list[str]:
    """The command line's overrides: from the config's own hydra node where it has one (a
    config composed with Hydra's), else from the running Hydra app's."""
    task = OmegaConf.select(cfg, "hydra.overrides.task", default=None)
    if task is not None:
        return list(task)
    from hydra.core.hydra_config import HydraConfig

    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:  # no Hydra run (a config composed by a tool, or built by hand)
        return []


def added(overrides: list[str]) -> list[tuple[str, str]]:
    """(key, override as written) of every `+key=` / `++key=` that adds a config key (not a
    config group, not Hydra's own)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from fastload.config import conf_dir

    found = []
    parsed = OverridesParser.create().parse_overrides(overrides)
    for text, o in zip(overrides, parsed, strict=True):
        if not (o.is_add() or o.is_force_add()):
            continue
        key = o.key_or_group
        if "/" in key or key.startswith("hydra.") or key == "hydra" or o.package is not None:
            continue
        if (conf_dir() / key.replace(".", "/")).is_dir():  # a config group: +experiment=x
            continue
        found.append((key, text))
    return found


def unread(cfg: DictConfig, key: str) -> str | None:
    """Why nothing would read `key` (a dotted path) in `cfg`, or None when something can."""
    if key in SET_BY_CODE:
        return (
            f"the run sets {key.rpartition('.')[2]} itself, from {SET_BY_CODE[key]}, so this "
            f"value would be overridden. Set that option instead."
        )
    known, open_nodes = shipped_keys()
    if key in known or key in SWEEP_AXES or any(key.startswith(f"{node}.") for node in open_nodes):
        return None
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    takes = target_parameters(node)
    if takes is True or (takes is not None and leaf in takes):
        return None
    here = parent if parent else "the config"
    options = sorted(
        str(k) for k in (node.keys() if isinstance(node, DictConfig) else ())
        if not str(k).startswith("_") and str(k) != leaf
    )  # fmt: skip
    if takes is not None:
        what = f"{here} has no option {leaf!r}, and {node.get('_target_')} takes no such argument"
    else:
        what = f"{here} has no option {leaf!r}, and nothing reads one added there"
    close = difflib.get_close_matches(leaf, options, n=1)
    hint = f" Did you mean {parent + '.' if parent else ''}{close[0]}=...?" if close else ""
    listed = f" Its options: {', '.join(options)}." if options else ""
    return f"{what}: the run would go on without it.{hint}{listed} Drop it or fix the name."


def target_parameters(node) -> set[str] | bool | None:
    """The parameter names of the callable that `node` (a config node with `_target_`) is
    built with; True when it takes **kwargs or cannot be imported here (building it says
    why, in its own words); None for a node with no `_target_`."""
    if not isinstance(node, DictConfig) or "_target_" not in node:
        return None
    from hydra.utils import get_object

    try:
        params = inspect.signature(get_object(str(node["_target_"]))).parameters
    except Exception:  # noqa: BLE001 - not importable or no signature: not judged here
        return True
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    return {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL}


@functools.cache
def shipped_keys() -> tuple[frozenset[str], frozenset[str]]:
    """(every dotted key path some yaml under conf/ sets, the paths of those it leaves as an
    empty mapping for the user to fill)."""
    from fastload.config import conf_dir

    root = conf_dir()
    known: set[str] = set()
    open_nodes: set[str] = set()
    for path in sorted(root.rglob("*.yaml")):
        text = path.read_text()
        rel = path.relative_to(root).parent
        is_global = "@package _global_" in text or rel == type(rel)(".")
        prefix = "" if is_global else ".".join(rel.parts)
        try:
            data = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
        except Exception:  # noqa: BLE001 - a yaml Hydra itself would refuse first
            continue
        if isinstance(data, dict):
            data.pop("defaults", None)
            walk(data, prefix, known, open_nodes)
    return frozenset(known), frozenset(open_nodes)


def walk(data: dict, prefix: str, known: set[str], open_nodes: set[str]) -> None:
    for k, v in data.items():
        path = f"{prefix}.{k}" if prefix else str(k)
        known.add(path)
        if isinstance(v, dict):
            if not v:
                open_nodes.add(path)
            walk(v, path, known, open_nodes)
