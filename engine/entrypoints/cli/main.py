"""The `stepscope` command line: prepare models, run the demo, serve, read traces, show the
dashboard, run benchmarks."""

from __future__ import annotations

import argparse
import sys

from stepscope.engine.entrypoints.cli import bench, dashboard, prepare, serve, trace

# Each family adds its subcommands, in the order `stepscope --help` lists them.
FAMILIES = (prepare, serve, trace, dashboard, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stepscope", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for family in FAMILIES:
        family.register(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except ValueError as e:
        print(f"stepscope: {e}", file=sys.stderr)
        sys.exit(2)
    if code:  # a command that found nothing to show (an unknown request id)
        sys.exit(code)


if __name__ == "__main__":
    main()
