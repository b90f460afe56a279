"""``specdec`` entry point: one parser, subcommands in their own modules.

Every expected failure (bad flag values, bad input, a service's error status)
ends as one line on stderr and exit status 2 (``options.run_parsed``); nothing
prints a traceback for input the user can fix. The subcommand modules never
import this one: what they share is in ``specdec.cli.options``.
"""

from __future__ import annotations

import argparse
import sys

from specdec.cli import bench, generate, remote, serve, soak, stack, train, up
from specdec.cli.options import run_parsed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding (EAGLE-2).")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    train.add_parser(sub)
    serve.add_parsers(sub)
    stack.add_orchestrator_parser(sub)
    up.add_parser(sub)
    remote.add_client_flags(sub.choices["generate"])
    bench.add_parser(sub)
    soak.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_parsed(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
