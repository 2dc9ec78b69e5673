"""The ``batchwire`` command: ``ingest``, ``inspect``, ``serve``, ``health``, ``bench``,
``preview``, ``demo``.

Each subcommand lives in its own module ``_<name>.py`` with ``HELP``, ``DESCRIPTION``,
``add_arguments(parser)`` and ``run(args) -> int`` (the exit code). Server-side subcommands
import DALI and LMDB only when they run, so the thin client's ``batchwire health`` works
where they are not installed. An unknown or misspelt flag is reported in the usage of the
command it was given to, with the closest known flag (``_parser.py``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import pathlib
import sys
import urllib.parse
from collections.abc import Sequence

import batchwire
from batchwire.cli import _logs, _parser

__all__ = ["build_parser", "main"]

_COMMANDS = ("ingest", "inspect", "serve", "health", "bench", "preview", "demo")
# What the [server] extra adds; the thin client has none of them.
_SERVER_PACKAGES = frozenset({"nvidia", "lmdb", "uvloop", "PIL", "yaml", "grpc_reflection"})
# Commands that need less than the whole [server] extra: `preview` only talks to a server
# and draws with Pillow, which the [preview] extra adds.
_EXTRA_OF_COMMAND = {"preview": "preview"}


def build_parser() -> argparse.ArgumentParser:
    parser = _parser.Parser(
        prog="batchwire",
        description="Remote DALI data loading: LMDB datasets, DALI pipelines, batches over gRPC.",
    )
    parser.add_argument("--version", action="version", version=f"batchwire {batchwire.__version__}")
    modules = {name: importlib.import_module(f"batchwire.cli._{name}") for name in _COMMANDS}
    quieter = sorted(n for n, m in modules.items() if hasattr(m, "DEFAULT_LOG_LEVEL"))
    _add_log_options(parser, None, f"INFO; WARNING for {' and '.join(quieter)}")
    subparsers = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_parser.Parser
    )
    for name, module in modules.items():
        # A command is a module with HELP, DESCRIPTION, add_arguments(parser) and run(args)
        # (and DEFAULT_LOG_LEVEL where it logs less than INFO by default).
        raw = getattr(module, "RAW_DESCRIPTION", False)
        command = subparsers.add_parser(
            name,
            help=module.HELP,
            description=module.DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter if raw else argparse.HelpFormatter,
        )
        module.add_arguments(command)
        command.set_defaults(
            func=module.run, default_log_level=getattr(module, "DEFAULT_LOG_LEVEL", "INFO")
        )
    # Also after the command (`batchwire serve --log-format json`), as a container's
    # arguments follow its `batchwire serve` entrypoint.
    for name, subparser in subparsers.choices.items():
        level = getattr(modules[name], "DEFAULT_LOG_LEVEL", "INFO")
        _add_log_options(subparser, argparse.SUPPRESS, level)
    return parser


def _add_log_options(parser: argparse.ArgumentParser, default: object, level: str) -> None:
    group = parser.add_argument_group("logging")
    group.add_argument(
        "--log-level",
        choices=_logs.LEVELS,
        default=default,
        help=f"log verbosity (default {level}) [BATCHWIRE_LOG_LEVEL]",
    )
    group.add_argument(
        "--log-format",
        choices=_logs.FORMATS,
        default=default,
        help="plain lines, or one JSON object per line with structured fields "
        "(default plain) [BATCHWIRE_LOG_FORMAT]",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level, log_format = _logs.choose(
        args.log_level, args.log_format, os.environ, getattr(args, "default_log_level", "INFO")
    )
    try:
        _logs.configure(level, log_format)
    except ValueError as exc:
        print(f"error: {exc} (check BATCHWIRE_LOG_LEVEL and BATCHWIRE_LOG_FORMAT)", file=sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except ImportError as exc:
        if (exc.name or "").split(".")[0] not in _SERVER_PACKAGES:
            raise
        extra = _EXTRA_OF_COMMAND.get(args.command, "server")
        print(
            f"error: {exc.name} is missing: `batchwire {args.command}` needs the {extra} extra "
            f"({_install_command(extra)})",
            file=sys.stderr,
        )
        return 2


def _install_command(extra: str) -> str:
    """The pip command that adds ``extra`` to this installation of batchwire: from the
    directory it was installed from (a checkout; editable if it was), else from the index."""
    for dist in importlib.metadata.distributions(name="batchwire"):
        try:
            origin = json.loads(dist.read_text("direct_url.json") or "null")
        except ValueError:
            continue
        if not isinstance(origin, dict) or "dir_info" not in origin:
            continue
        url = urllib.parse.urlparse(str(origin.get("url", "")))
        if url.scheme != "file":
            continue
        directory = pathlib.Path(urllib.parse.unquote(url.path))
        where = "." if directory == pathlib.Path.cwd() else str(directory)
        editable = "-e " if origin["dir_info"].get("editable") else ""
        return f'pip install {editable}"{where}[{extra}]"'
    return f'pip install "batchwire[{extra}]"'
