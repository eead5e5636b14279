"""python -m fastload.bench {backends,loaders,storage,train} [--help]

A problem with the input (a missing dataset, a store that cannot be built, an override that
does not compose) is one line, `error: <message>`, and exit status 2."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import sys
from pathlib import Path

import fastload.bench as bench_pkg


def suite_summaries() -> dict[str, str]:
    """Each suite's name and what it times (its docstring's first line): a suite is a module
    here with a top-level `main(argv)`; the others (common, gpu_timeline) are its helpers.
    Read from the source, not imported: every suite imports torch, seconds for a --help."""
    out = {}
    for m in pkgutil.iter_modules(bench_pkg.__path__):
        if m.name.startswith("_"):
            continue
        tree = ast.parse((Path(m.module_finder.path) / f"{m.name}.py").read_text())
        if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            first = (ast.get_docstring(tree) or "").split("\n")[0]
            out[m.name] = first.split(": ", 1)[-1]
    return dict(sorted(out.items()))


def suites() -> list[str]:
    return list(suite_summaries())


def usage(available) -> str:
    return f"usage: python -m fastload.bench {{{','.join(available)}}} [--help]"


def help_text() -> str:
    summaries = suite_summaries()
    width = max(map(len, summaries))
    lines = [usage(summaries), "", "suites (python -m fastload.bench SUITE --help: its options):"]
    lines += [f"  {name:<{width}}  {what}" for name, what in summaries.items()]
    return "\n".join([*lines, "", __doc__.split("\n\n", 1)[1]])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(help_text())
        return 0
    available = suites()
    if not argv or argv[0] not in available:
        what = f"unknown suite {argv[0]!r}" if argv else "no suite given"
        print(f"error: {what}; the suites: {', '.join(available)} (python -m fastload.bench "
              f"--help says what each times)", file=sys.stderr)  # fmt: skip
        return 2
    return reporting_errors(importlib.import_module(f"fastload.bench.{argv[0]}").main, argv[1:])


def reporting_errors(command, argv: list[str]) -> int:
    """`command(argv)`'s exit status; a problem with the input is one line, exit 2."""
    from hydra.errors import HydraException

    from fastload.errors import FastloadError, hydra_one_line, user_error

    try:
        return command(argv)
    except (FastloadError, HydraException) as exc:
        # ours (also when Hydra's instantiate wrapped it), or an override that does not compose
        ours = user_error(exc)
        print(f"error: {ours.user_message if ours else hydra_one_line(str(exc))}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
