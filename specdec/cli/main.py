"""``specdec`` entry point: one parser, subcommands in their own modules.

Every expected failure (bad flag values, bad input, a service's error status)
ends as one line on stderr and exit status 2; nothing prints a traceback for
input the user can fix.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdec.errors import SpecdecError


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    from specdec.cli import bench, generate, remote, serve, soak, stack, train

    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding (EAGLE-2).")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    train.add_parser(sub)
    serve.add_parsers(sub)
    stack.add_parsers(sub)
    remote.add_client_flags(sub.choices["generate"])
    bench.add_parser(sub)
    soak.add_parser(sub)
    return parser


def model_dir(path: str | None, demo: str, what: str, flag: str) -> str:
    """``path``, or the bundled demo model ``demo``; a directory without a
    config.json is a one-line error saying which flag to pass."""
    from specdec.models import demo_path

    chosen = path or str(demo_path(demo))
    if not Path(chosen, "config.json").is_file():
        hint = "" if path else f" (the bundled demo {what} is missing: pass {flag} or run `specdec train`)"
        raise CliError(f"{what} directory {chosen} has no config.json{hint}")
    return chosen


def run_parsed(args) -> int:
    """Run a parsed subcommand: expected failures -> one line, status 2."""
    try:
        return int(args.run(args) or 0)
    except (CliError, SpecdecError, ValueError, FileNotFoundError) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"specdec: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    return run_parsed(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
