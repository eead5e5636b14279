"""python -m fastload.bench {loaders,backends,storage} [--help]"""

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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    available = suites()
    if not argv or argv[0] not in available:
        print(
            f"usage: python -m fastload.bench {{{','.join(available)}}} [--help]", file=sys.stderr
        )
        return 2
    return importlib.import_module(f"fastload.bench.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
