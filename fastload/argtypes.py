"""argparse `type=` helpers shared by the command lines (fastload.pack, fastload.bench.*);
nothing heavy imported here, so a command that needs no torch does not load it."""

from __future__ import annotations

import argparse
import math


def at_least(low: float, kind: type = int, at_most: float | None = None):
    """An argparse `type=`: a `kind` (int: a whole number) >= low (and <= at_most). What is
    outside (a batch of 0, a negative sleep) would fail deep in a run, after the loaders were
    built, with a traceback; argparse's error names the option instead."""
    what = "a whole number" if kind is int else "a number"
    bounds = f">= {low:g}" if at_most is None else f"from {low:g} to {at_most:g}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if (value is None or not math.isfinite(value) or value < low
                or (at_most is not None and value > at_most)):  # fmt: skip
            raise argparse.ArgumentTypeError(f"{text!r}: use {what} {bounds}")
        return value

    return parse
