"""python -m fastload.bench {backends,loaders,storage,train} [--help]

A problem with the input (a missing dataset, a store that cannot be built, an override that
does not compose) is one line, `error: <message>`, and exit status 2."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import fastload.bench as bench_pkg


def suites() -> list[str]:
    return sorted(
        m.name
        for m in pkgutil.iter_modules(bench_pkg.__path__)
        if not m.name.startswith("_") and m.name != "common"
    )


def one_line(hydra_message: str) -> str:
    """Hydra's composition error without its search path, on one line."""
    text = hydra_message.split("\nConfig search path")[0].strip()
    return text.replace("\n\n", "; ").replace("\n\t", " ").replace("\n", " ")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    available = suites()
    if not argv or argv[0] not in available:
        print(
            f"usage: python -m fastload.bench {{{','.join(available)}}} [--help]", file=sys.stderr
        )
        return 2
    return reporting_errors(importlib.import_module(f"fastload.bench.{argv[0]}").main, argv[1:])


def reporting_errors(command, argv: list[str]) -> int:
    """`command(argv)`'s exit status; a problem with the input is one line, exit 2."""
    from hydra.errors import HydraException

    from fastload.errors import FastloadError, user_error

    try:
        return command(argv)
    except (FastloadError, HydraException) as exc:
        # ours (also when Hydra's instantiate wrapped it), or an override that does not compose
        ours = user_error(exc)
        print(f"error: {ours.user_message if ours else one_line(str(exc))}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
