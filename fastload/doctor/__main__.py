"""python -m fastload.doctor {env,pipeline} [options] [train.py overrides]

    env       the pre-flight check every run makes, with the fix for each problem
    pipeline  which stage of the data path starves the GPU, and the change that helps most
    (python -m fastload.doctor COMMAND --help: its options)

    python -m fastload.doctor env                         # the pre-flight check, one line each
    python -m fastload.doctor env loader.num_workers=16 trainer.batch_size=256
    python -m fastload.doctor pipeline backend=pil storage=disk   # which stage starves the GPU
    python -m fastload.doctor pipeline --step-ms 40 dataset.task.item_cost_ms=5

A problem with the input (an override that does not compose, a missing dataset) is one line,
`error: <message>`, and exit status 2; `env` exits 1 when a check is fatal.
"""

from __future__ import annotations

import sys

COMMANDS = ("env", "pipeline")


def parse_env(argv: list[str]):
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m fastload.doctor env",
        description="The pre-flight check every run makes, with the fix for each problem.",
    )
    p.add_argument("--local-ranks", type=int, default=None,
                   help="ranks per node to check for (default: LOCAL_WORLD_SIZE or 1)")  # fmt: skip
    p.add_argument("override", nargs="*", help="train.py overrides: loader.num_workers=8 ...")
    args = p.parse_intermixed_args(argv)  # overrides before and after options alike
    from fastload.dist import local_world_size_from_env

    if args.local_ranks is None:  # not `or`: --local-ranks 0 is refused, not the default
        args.local_ranks = local_world_size_from_env()
    if args.local_ranks < 1:
        p.error(f"--local-ranks {args.local_ranks}: use a whole number >= 1")
    return args


def env_main(argv: list[str]) -> int:
    from fastload.bench.common import compose
    from fastload.pipeline import loader_options
    from fastload.preflight import FATAL, run_checks

    args = parse_env(argv)
    cfg = compose(args.override)
    # the loader's options as a run resolves them: a num_workers=abc train.py refuses is
    # refused here too, not judged as 0 workers
    loader_options(cfg, args.local_ranks)
    results = run_checks(cfg, local_ranks=args.local_ranks)
    for r in results:
        print(r.line())
    fatal = sum(r.status == FATAL for r in results)
    warn = sum(r.status == "warn" for r in results)
    print(f"{len(results)} checks: {fatal} fatal, {warn} warning(s)")
    return 1 if fatal else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: {__doc__.strip()}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        what = f"unknown command {argv[0]!r}" if argv else "no command given"
        print(f"error: {what}; the commands: {', '.join(COMMANDS)} (python -m fastload.doctor "
              f"--help says what each does)", file=sys.stderr)  # fmt: skip
        return 2
    from fastload.bench.__main__ import reporting_errors

    if argv[0] == "env":
        return reporting_errors(env_main, argv[1:])
    from fastload.doctor.pipeline import main as pipeline_main

    return reporting_errors(pipeline_main, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
