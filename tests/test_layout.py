"""The package's shape, kept by tests: no import circle, short functions, the loader built
in one place, every private torch internal still there, docs that point inside the repo."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = REPO / "fastload"
MAX_FUNCTION_LINES = 80
# Folders installed under another package name (pyproject.toml [tool.setuptools.package-dir]).
MAPPED = {"fastload.models": REPO / "models"}


def package_folders() -> dict[str, Path]:
    """Every package the project installs -> its folder in the checkout."""
    out = {}
    for init in sorted(PACKAGE.rglob("__init__.py")):
        out[".".join(init.parent.relative_to(REPO).parts)] = init.parent
    return {**out, **MAPPED}


def modules() -> dict[str, ast.Module]:
    out = {}
    for package, folder in package_folders().items():
        for path in sorted(folder.glob("*.py")):
            name = f"{package}.{path.stem}".removesuffix(".__init__")
            out[name] = ast.parse(path.read_text(), str(path))
    return out


def test_installed_packages_are_every_package_folder():
    """pyproject.toml lists the packages by hand (models/ installs as fastload.models): the
    list, the folder mapping and the folders on disk agree, and nothing else is installed
    as a top-level `models`."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert sorted(config["packages"]) == sorted(package_folders())
    assert {k: REPO / v for k, v in config["package-dir"].items()} == MAPPED
    assert not (PACKAGE / "models").exists()
    import fastload.models

    assert Path(fastload.models.__file__).parent == REPO / "models"


def fastload_imports(tree: ast.Module, known) -> set[str]:
    """Every fastload module a module imports, at module level or inside a function (a lazy
    import that closes a circle is still a circle)."""
    deps = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            deps |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            deps.add(node.module)
            deps |= {f"{node.module}.{a.name}" for a in node.names}
    return {d for d in deps if d in known}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, path = {}, []

    def visit(u):
        state[u] = "open"
        path.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                return path[path.index(v) :] + [v]
            if v not in state and (found := visit(v)):
                return found
        path.pop()
        state[u] = "done"
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circle():
    mods = modules()
    graph = {name: fastload_imports(tree, mods) - {name} for name, tree in mods.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    # and the check itself sees a circle when there is one
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def package_of(module: str) -> str:
    """fastload.storage.shards -> fastload.storage; a top-level module is its own unit."""
    return ".".join(module.split(".")[:2])


def test_no_package_circle():
    """Between packages too (storage, data, decode, loaders, tasks, ... and the top-level
    modules), lazy imports included: data/ below storage/, storage/ below the engine."""
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, tree in mods.items():
        deps = {package_of(d) for d in fastload_imports(tree, mods)} - {package_of(name)}
        graph.setdefault(package_of(name), set()).update(deps)
    for deps in list(graph.values()):
        for d in deps:
            graph.setdefault(d, set())
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    assert {"fastload.storage", "fastload.data"} <= set(graph) and "fastload.storage" not in (
        graph["fastload.data"]
    )


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for v in graph[todo.pop()] - seen:
            seen.add(v)
            todo.append(v)
    return seen


def test_the_run_imports_no_tool():
    """What train.py runs (the engine and everything it imports, lazy imports included) takes
    nothing from the tools: doctor/ (which sits above bench/) and bench/ import the run, never
    the other way round."""
    mods = modules()
    graph = {name: fastload_imports(tree, mods) - {name} for name, tree in mods.items()}
    run = reachable(graph, "fastload.engine") | {"fastload.engine"}
    tools = sorted(m for m in run if m.startswith(("fastload.doctor", "fastload.bench")))
    assert tools == [], tools
    assert "fastload.engine" in reachable(graph, "fastload.doctor.pipeline")  # the check sees


def test_every_module_imports_in_a_fresh_interpreter():
    names = [n for n in modules() if not n.endswith("__main__")]
    code = f"import importlib\nfor n in {names!r}:\n    importlib.import_module(n)\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]


# What a spawn pool's child imports before its first task (fastload.host.spawn_pool): the
# main module (train.py, python -m fastload.pack) and the module of the task it runs.
POOL_CHILD_MODULES = [
    "fastload.pack",
    "fastload.storage.packing",
    "fastload.data.synthetic",
    "fastload.data.synthetic_coco",
    "fastload.data.synthetic_div2k",
]


def test_spawn_pool_children_start_without_torch():
    code = (
        "import importlib, runpy, sys\n"
        "sys.argv = ['train.py']\n"
        "runpy.run_path('train.py', run_name='__mp_main__')\n"
        f"for n in {POOL_CHILD_MODULES!r}:\n    importlib.import_module(n)\n"
        "heavy = sorted(m for m in ('torch', 'torchvision', 'cv2') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "", f"a pool child would import {out.stdout.strip()}"


def test_no_function_over_80_lines():
    long = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, tree in modules().items()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, long


LOADER_CLASSES = {"DataLoaderStream", "BackgroundLoader", "CudaPrefetchLoader"}
LOADER_CLASSES |= {"PrefetchBackgroundLoader"}


def loader_constructions(tree: ast.Module) -> int:
    """Calls of a fastload loader class, or instantiate(<...loader>)."""
    n = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "id", getattr(node.func, "attr", ""))
        if name in LOADER_CLASSES:
            n += 1
        elif name == "instantiate" and node.args and "loader" in ast.unparse(node.args[0]):
            n += 1
    return n


def test_the_loader_is_constructed_in_one_place():
    files = [
        *PACKAGE.rglob("*.py"),
        *MAPPED["fastload.models"].glob("*.py"),
        *(REPO / "tests").glob("test_*.py"),
        REPO / "train.py",
    ]
    files += [REPO / "tests" / "conftest.py", REPO / "tests" / "helpers.py"]
    places = {
        str(path.relative_to(REPO)): n
        for path in files
        if (n := loader_constructions(ast.parse(path.read_text())))
    }
    assert places == {"fastload/pipeline.py": 1}, places
    assert loader_constructions(ast.parse("DataLoaderStream(ds, s)\ninstantiate(cfg.loader)")) == 2


def test_private_torch_internals_are_all_still_there():
    """A torch upgrade that drops one of them makes fastload fall back to a slower path
    (fastload/torch_internals.py): this test makes that visible instead of silent."""
    from fastload import torch_internals

    assert torch_internals.missing() == []


def test_readme_points_only_inside_the_repository():
    readme = (REPO / "README.md").read_text()
    assert "../shared" not in readme
    for link in re.findall(r"\]\(([^)#]+)\)", readme):
        if not link.startswith(("http://", "https://")):
            assert (REPO / link).exists(), link


TASK_WORDS = ("boxes", "labels", "pair", "targets", "read_pair", "has_pairs", "describe_pair")


def docstring_ids(tree: ast.Module) -> set[int]:
    """id() of every docstring constant in `tree` (module, class, function)."""
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def task_mentions(tree: ast.Module, fields: set[str]) -> list[str]:
    """Where a module names a task's field: a string constant (docstrings aside) that is a
    field name, or an attribute, function or argument named after a task's data."""
    docs = docstring_ids(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in fields and id(node) not in docs:
            found.append(f"line {node.lineno}: {node.value!r}")
        name = getattr(node, "attr", None) or getattr(node, "arg", None)
        if isinstance(node, (ast.FunctionDef, ast.Name)):
            name = getattr(node, "name", None) or node.id
        if name in TASK_WORDS:
            found.append(f"line {node.lineno}: {name}")
    return found


def test_no_store_names_a_tasks_field():
    """Stores write and read a record's fields by its schema (fastload/data/records.py): no
    module of fastload/storage/ names a field of a task's records, so a new task's fields
    need no store edited."""
    from fastload.data.sources import CocoSource, Div2kSource, ImageFolderSource

    fields = {f.name for s in (ImageFolderSource, CocoSource) for f in s.schema}
    fields |= set(Div2kSource.PAIRED.names)
    assert {"image", "label", "boxes", "lr"} <= fields
    mods = {n: t for n, t in modules().items() if n.startswith("fastload.storage.")}
    assert "fastload.storage.shards" in mods
    named = {n: found for n, t in mods.items() if (found := task_mentions(t, fields))}
    assert named == {}, named
    # and the check sees a store that reads a task's field
    assert task_mentions(ast.parse('def f(r, i):\n    return r.boxes(i), r.get(i, "lr")'), fields)


TRANSPORT = ("RingSlot", "InlineArray", "BatchPart", "merge_parts", "join_images", "SlotCollate")


def defined_names(tree: ast.Module) -> set[str]:
    return {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}


def test_the_batch_contract_holds_no_transport():
    """data/batch.py says what a batch is; how it travels (slots, inline arrays, a batch cut
    across the workers and joined) lives beside the ring in fastload/loaders/."""
    mods = modules()
    assert not defined_names(mods["fastload.data.batch"]) & set(TRANSPORT)
    assert {"InlineArray", "merge_parts", "join_images", "SlotCollate"} <= defined_names(
        mods["fastload.loaders.transport"]
    )
    assert "RingSlot" in defined_names(mods["fastload.loaders.batch_ring"])


def collate_fn_assignments(tree: ast.Module) -> list[int]:
    """Lines that set `<something>.collate_fn = ...` (swapping a built DataLoader's collate)."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Attribute) and target.attr == "collate_fn"
    ]


def test_no_dataloader_gets_its_collate_swapped_after_it_is_built():
    swapped = {n: lines for n, t in modules().items() if (lines := collate_fn_assignments(t))}
    assert swapped == {}, swapped
    assert collate_fn_assignments(ast.parse("dl.collate_fn = partial(collate, ring=r)")) == [1]


CLOCKS = ("perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns")
# Where a loop may time batches: the tools' one measuring module, and the training run's own
# per-epoch timer (the engine's StepTimer, whose data wait `feed` counts the same way).
TIMING_MODULES = {
    "fastload.measure": ["feed", "host_epoch", "step_times"],
    "fastload.telemetry.timer": ["iter"],
}


def timing_loops(tree: ast.Module) -> list[str]:
    """Functions with a loop that reads the clock (`perf_counter` or `monotonic`, however
    imported or aliased) and either takes batches, by `next(...)` or by iterating something
    named a loader or batches (`for batch in loader`), or calls a training step
    (`step.train(...)`): a loader- or step-timing loop of their own. A loop that only repeats
    a timed call (`for _ in range(n)`) or times other work (packing a split) is not one."""
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for loop in ast.walk(fn):
            if not isinstance(loop, (ast.For, ast.While)):
                continue
            calls = [ast.unparse(c.func) for c in ast.walk(loop) if isinstance(c, ast.Call)]
            clock = any(c.rsplit(".", 1)[-1] in CLOCKS for c in calls)
            over = ast.unparse(loop.iter) if isinstance(loop, ast.For) else ""
            pulls = "next" in calls or "loader" in over or "batch" in over
            steps = any(c.endswith(".train") for c in calls)
            if clock and (pulls or steps):
                found.append(fn.name)
                break
    return found


def test_one_measuring_module():
    """bench loaders, the doctor and loader=auto time a loader with fastload/measure.py: one
    SleepStep class and one timing loop in the project."""
    files = [*PACKAGE.rglob("*.py"), *(REPO / "scripts").rglob("*.py")]
    sleep_steps = [
        str(p.relative_to(REPO))
        for p in files
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.ClassDef) and n.name == "SleepStep"
    ]
    assert sleep_steps == ["fastload/measure.py"]
    loops = {n: sorted(found) for n, t in modules().items() if (found := timing_loops(t))}
    assert loops == TIMING_MODULES, loops
    users = ("fastload.bench.loaders", "fastload.bench.train", "fastload.bench.storage")
    users += ("fastload.doctor.pipeline", "fastload.autotune")
    for user in users:
        assert "fastload.measure" in fastload_imports(modules()[user], modules()), user
    # and the check sees a private loop, in each of its shapes
    own = "def f(it):\n    while True:\n        t = time.perf_counter()\n        next(it)\n"
    assert timing_loops(ast.parse(own)) == ["f"]
    loop = "def f(loader):\n    for batch in loader:\n        t0 = perf_counter()\n"
    assert timing_loops(ast.parse(loop)) == ["f"]
    step = (
        "def f(s, b):\n    for _ in range(3):\n        t0 = clock.monotonic()\n        s.train(b)\n"
    )
    assert timing_loops(ast.parse(step)) == ["f"]
    repeat = "def f(g):\n    for _ in range(3):\n        t0 = time.perf_counter()\n        g()\n"
    assert timing_loops(ast.parse(repeat)) == []


def test_the_preflight_names_no_backend_or_storage():
    """Backends and storages state what they need (`DecodeBackend.needs`, `Storage.needs`):
    the pre-flight holds no table of them and compares no option with one of their names."""
    conf = REPO / "conf"
    names = {p.stem for group in ("backend", "storage") for p in (conf / group).glob("*.yaml")}
    assert {"turbo", "pillow-simd", "nvjpeg", "disk", "tmpfs"} <= names
    from fastload import preflight

    names -= set(preflight.DECODER_MODULES)  # modules whose presence is a fact (accimage)
    tree = modules()["fastload.preflight"]
    docs = docstring_ids(tree)
    named = sorted(
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and n.value in names and id(n) not in docs
    )
    assert named == [], named
    targets = [n for n in ast.walk(tree) if isinstance(n, ast.Constant)
               and isinstance(n.value, str) and n.value.startswith("fastload.decode.")]  # fmt: skip
    assert targets == []
