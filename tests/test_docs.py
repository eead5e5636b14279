"""The commands the docs show work as shown: every `train.py` command composes and passes a
run's first checks; every `python -m fastload.<tool>` command parses with the tool's own
parser, and its train.py overrides compose. A renamed option, flag or group fails here, not
on a user's machine."""

from __future__ import annotations

import importlib
import re
import shlex
import sys

import pytest
from conftest import CONF, REPO, compose_config, resolve_all

# Where users read commands: the docs, the yaml comments, the modules' docstrings, the Dockerfile.
DOC_FILES = sorted(
    {
        *REPO.glob("*.md"),
        *(REPO / "docs").rglob("*.md"),
        *CONF.rglob("*.yaml"),
        *(REPO / "fastload").rglob("*.py"),
        REPO / "Dockerfile",
    }
)
TRAIN_PY = re.compile(r"(^|\s)(python3? |torchrun .*?)train\.py(\s|$)")
TOOL = re.compile(r"^python3? -m fastload\.(pack|bench|doctor|report)(\s|$)")
SHELL_VAR = re.compile(r'^([A-Z]\w*)="([^"]*)"$')  # B="..." in a code block, used as $B


def doc_lines(path) -> list[str]:
    """The command-like text of a doc: in markdown the lines of its code blocks (a
    `NAME="..."` line there expands `$NAME` further down the block) and its inline code;
    elsewhere the lines (a comment's `#` taken off) and their inline code. Backslash
    continuations are joined."""
    found, fenced, lines, names = [], False, iter(path.read_text().splitlines()), {}
    markdown = path.suffix == ".md"
    for line in lines:
        if markdown and line.lstrip().startswith("```"):
            fenced, names = not fenced, {}
            continue
        if not markdown:
            line = line.strip().lstrip("#").strip()
        if path.suffix == ".py":  # a docstring's `\\` is the `\` users read
            line = line.replace("\\\\", "\\")
        while (fenced or not markdown) and line.rstrip().endswith("\\"):
            nxt = next(lines, "")
            line = line.rstrip()[:-1] + " " + (nxt if markdown else nxt.strip().lstrip("#")).strip()
        if fenced and (var := SHELL_VAR.match(line.strip())):
            names[var[1]] = var[2]
            continue
        for name, value in names.items():
            line = line.replace(f"${name}", value)
        inline = re.findall(r"`([^`]*)`", line)
        found += inline if inline or (markdown and not fenced) else [line]
    return [x.strip() for x in found]


DOC_LINES = {path: doc_lines(path) for path in DOC_FILES}  # each file read once


def doc_commands(path) -> list[str]:
    """The `python train.py ...` / `torchrun ... train.py ...` commands a file shows."""
    return [c for c in DOC_LINES[path] if TRAIN_PY.search(c)]


def doc_overrides(command: str) -> list[str]:
    """A documented command's Hydra overrides: the words after train.py, without its comment,
    placeholders (`...` for the line above, `<overrides>`), Hydra's flags and the SLURM
    launcher's own settings (an optional plugin: `pip install -e ".[slurm]"`)."""
    words = shlex.split(command.split("train.py", 1)[1], comments=True)
    skip = ("...", "-m", "--multirun", "--cfg", "job")
    skip_prefixes = ("hydra/launcher=", "hydra.launcher.", "<")
    return [w for w in words if w not in skip and not w.startswith(skip_prefixes)]


DOC_COMMANDS = [(str(p.relative_to(REPO)), c) for p in DOC_FILES for c in doc_commands(p)]
# Each set of overrides once (many commands share one, e.g. a bare `python train.py`), named
# by the first place that shows it.
DOC_OVERRIDES = {}
for _doc, _command in DOC_COMMANDS:
    DOC_OVERRIDES.setdefault(tuple(doc_overrides(_command)), f"{_doc}: {_command}")


def test_the_docs_show_train_py_commands():
    """The extraction finds them (a change of the docs' shape would leave nothing to
    check): the README's recipes, a torchrun launch, a docker run."""
    readme = [c for doc, c in DOC_COMMANDS if doc == "README.md"]
    assert len(readme) > 40 and len(DOC_COMMANDS) > len(readme) + 20
    assert any(c.startswith("torchrun --nnodes=2") and "rdzv-endpoint" in c for c in readme)
    assert any(c.startswith("docker run") for c in readme)
    assert doc_overrides("python train.py ... a=1 'b=\"x y\"'  # c=2") == ["a=1", 'b="x y"']


@pytest.mark.parametrize(
    "overrides", list(DOC_OVERRIDES), ids=[where[:70] for where in DOC_OVERRIDES.values()]
)
def test_every_train_py_command_in_the_docs_composes(overrides, tmp_path):
    """Every option a doc tells users to pass exists (a renamed key or group option fails
    here, not on a user's machine), every value resolves, and the checks a run makes before
    any work accept it."""
    accepted(overrides, tmp_path)


def accepted(overrides, tmp_path) -> None:
    """`overrides` compose, every value resolves, and a run's first checks pass them."""
    from fastload.engine import check_config

    cfg = compose_config([*overrides, f"hydra.run.dir={tmp_path}"], tmp_path)
    resolve_all(cfg)
    check_config(cfg)


# -- the tools: python -m fastload.{pack,bench,doctor,report} ---------------------------------


def tool_words(command: str) -> list[str] | None:
    """A documented tool command's words after `python -m`, without its comment; None for a
    usage line (`[--opt N]`, `{a,b}`, `a|b`, `<placeholder>`, `...`) or prose (`bench x:`,
    `(what it does)` in a layout tree)."""
    words = shlex.split(command, comments=True)[2:]
    synopsis = any(w.startswith(("[", "{", "<")) or "|" in w or w in ("...", "SUITE")
                   for w in words)  # fmt: skip
    prose = any(w.endswith((":", ")")) or w.startswith("(") for w in words)
    # the tool named in a sentence (`python -m fastload.pack verify` checks ...)
    mention = len(words) == 1 or (words[0] == "fastload.pack" and len(words) == 2)
    return None if synopsis or prose or mention else words


def tool_parser(words: list[str]):
    """(the parser a tool runs its arguments through, those arguments)."""
    module, rest = words[0].removeprefix("fastload."), words[1:]
    if module == "pack":
        from fastload.pack import parse

        return (lambda argv: parse(argv)[1]), rest
    if module == "report":
        from fastload.report.__main__ import parse

        return parse, rest
    if module == "doctor" and rest[:1] == ["env"]:
        from fastload.doctor.__main__ import parse_env

        return parse_env, rest[1:]
    return importlib.import_module(f"fastload.{module}.{rest[0]}").parse, rest[1:]  # bench, doctor


TOOL_COMMANDS = {}
for _path, _lines in DOC_LINES.items():
    for _line in _lines:
        if TOOL.match(_line) and (_words := tool_words(_line)) is not None:
            TOOL_COMMANDS.setdefault(tuple(_words), f"{_path.relative_to(REPO)}: {_line}")


def test_the_docs_show_tool_commands():
    """The extraction finds each tool's documented commands, and usage lines are told apart
    from commands."""
    tools = {words[0] for words in TOOL_COMMANDS}
    assert tools == {"fastload.pack", "fastload.bench", "fastload.doctor", "fastload.report"}
    suites = {words[1] for words in TOOL_COMMANDS if words[0] == "fastload.bench"}
    assert suites == {"backends", "loaders", "storage", "train"}
    assert len(TOOL_COMMANDS) > 30
    assert tool_words("python -m fastload.pack lmdb SRC DST [--max-side N]") is None
    assert tool_words("python -m fastload.pack shards|lmdb SRC DST") is None
    assert tool_words("python -m fastload.bench train: the loop") is None
    assert tool_words("python -m fastload.pack (command line only)") is None
    assert tool_words("python -m fastload.pack verify") is None
    assert tool_words("python -m fastload.bench train --step-ms 9  # a=1") == [
        "fastload.bench", "train", "--step-ms", "9"]  # fmt: skip


@pytest.mark.parametrize(
    "words", list(TOOL_COMMANDS), ids=[where[:70] for where in TOOL_COMMANDS.values()]
)
def test_every_tool_command_in_the_docs_parses(words, tmp_path, monkeypatch):
    """The tool's own parser accepts the documented flags and values (argparse exits with
    status 2 on an unknown or renamed one), and the train.py overrides it passes compose."""
    monkeypatch.chdir(tmp_path)  # nothing a parser might write lands in the checkout
    parse, argv = tool_parser(list(words))
    # a placeholder the reader fills in (a peer's /path/to/env/bin/python) must exist for
    # the parser: this interpreter stands in for it
    argv = [sys.executable if a.startswith("/path/to/") and a.endswith("/python") else a
            for a in argv]  # fmt: skip
    try:
        args = parse(argv)
    except SystemExit as exc:
        pytest.fail(f"{' '.join(words)}: the parser refused it (exit {exc.code})")
    if getattr(args, "override", []):
        accepted(args.override, tmp_path)
