"""Benchmarks: `python -m fastload.bench SUITE [options]` prints a table and writes JSON.

Each suite is one module here with a `main(argv) -> int`; results go to BENCHMARKS.md by hand
with the command, machine and date. Benchmarks compare within one run (ratios), never in tests.
"""
