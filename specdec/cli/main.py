"""``specdec`` entry point: one parser, subcommands in their own modules.

Every expected failure (bad flag values, bad input, a service's error status)
ends as one line on stderr and exit status 2; nothing prints a traceback for
input the user can fix.
"""

from __future__ import annotations

import argparse
import sys

from specdec.errors import SpecdecError


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    from specdec.cli import bench, generate, remote, serve, stack, train

    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding (EAGLE-2).")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    train.add_parser(sub)
    serve.add_parsers(sub)
    stack.add_parsers(sub)
    remote.add_client_flags(sub.choices["generate"])
    bench.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (CliError, SpecdecError, ValueError, FileNotFoundError) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"specdec: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
