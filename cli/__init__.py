"""The ``batchwire`` command: ``ingest``, ``inspect``, ``serve``, ``health``, ``bench``, ``demo``.

Each subcommand lives in its own module ``_<name>.py`` with ``add_parser(subparsers)``
(registering its arguments and ``func=run``) and ``run(args) -> int`` (the exit code).
Server-side subcommands import DALI and LMDB only when they run, so the thin client's
``batchwire health`` works where they are not installed.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

__all__ = ["main"]

_COMMANDS = ("ingest", "inspect", "serve", "health", "demo")
# What the [server] extra adds; the thin client has none of them.
_SERVER_PACKAGES = frozenset({"nvidia", "lmdb", "uvloop", "PIL", "yaml", "grpc_reflection"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchwire",
        description="Remote DALI data loading: LMDB datasets, DALI pipelines, batches over gRPC.",
    )
    parser.add_argument(
        "--log-level",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log verbosity (default INFO; WARNING for demo)",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMANDS:
        module = importlib.import_module(f"batchwire.cli._{name}")
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = args.log_level or getattr(args, "default_log_level", "INFO")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except ImportError as exc:
        if (exc.name or "").split(".")[0] not in _SERVER_PACKAGES:
            raise
        print(
            f"error: {exc.name} is missing: `batchwire {args.command}` needs the server extra "
            '(pip install "batchwire[server]")',
            file=sys.stderr,
        )
        return 2
