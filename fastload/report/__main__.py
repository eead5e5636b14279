"""python -m fastload.report RUN_DIR... [--out DIR] [--baseline OVERRIDE] [--title TEXT]"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fastload.errors import user_error
from fastload.report import build_report


def parse(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m fastload.report",
        description="Compare train.py run directories: a Markdown table, report.json and "
        "PNG charts (normalised time with error bars; epoch time, GPU utilisation and "
        "data-wait share per variant).",
    )
    p.add_argument("runs", nargs="+", type=Path, help="run directories (a multirun's job folders)")
    p.add_argument("--out", type=Path, default=None, help="default: <first run's parent>/report")
    p.add_argument(
        "--baseline",
        default=None,
        help="the variant to normalise to, e.g. loader=baseline; it must match one variant "
        "(several overrides narrow it: 'storage=disk logger.group=G'; default: the first)",
    )
    p.add_argument("--title", default="", help="the charts' and table's title")  # fmt: skip
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    out = args.out or args.runs[0].parent / "report"
    try:
        report = build_report(args.runs, out, args.baseline, args.title)
    except Exception as exc:
        error = user_error(exc)
        if error is None:
            raise
        print(f"error: {error.user_message}", file=sys.stderr)
        return 2
    print(report["table"])
    for warning in report["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"written: {out / 'report.md'}, {out / 'report.json'}, "
          + ", ".join(str(out / c) for c in report["charts"]))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
