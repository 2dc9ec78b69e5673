"""``batchwire health --address HOST:PORT``: exit 0 only when the server reports SERVING.

``--wait SECONDS`` asks again until the server is SERVING or the time is up, for
scripts that start a server and go on once it is warm; when it gives up it says,
in one line, the last answer and what the server is waiting for where it can tell.

For a secured server: ``--tls-ca`` (and ``--tls-cert``/``--tls-key`` for mutual
TLS) and a token from ``--token-file`` or ``BATCHWIRE_TOKEN``, which the server
needs unless it runs with ``--health-open``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from batchwire.cli import _credentials as credentials

__all__ = ["DESCRIPTION", "HELP", "add_arguments", "run"]


HELP = "ask a server's gRPC health service; exit 0 only when SERVING"
DESCRIPTION = "Query the standard grpc.health.v1.Health service (for probes and healthchecks)."
# Between two questions while --wait runs.
_POLL_S = 0.5
_BUSY = " (warming up, draining, or its device is broken: see the server's log)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address", default="localhost:50051", help="HOST:PORT (default localhost:50051)"
    )
    parser.add_argument("--service", default="", help="service name ('' = the whole server)")
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for an answer (default 5)"
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="ask again until SERVING, for up to SECONDS (default 0: ask once)",
    )
    credentials.add_arguments(parser, tls_name=True)


def run(args: argparse.Namespace) -> int:
    from batchwire.client import BatchwireError, check_health

    if args.wait < 0:
        print("error: --wait must be 0 or more seconds", file=sys.stderr)
        return 2
    try:
        security = credentials.security(args)
    except BatchwireError as exc:
        print(f"error: {exc.details}", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.wait
    while True:
        timeout = max(0.1, min(args.timeout, deadline - time.monotonic()))
        try:
            status = check_health(
                args.address,
                service=args.service,
                timeout=args.timeout if args.wait == 0 else timeout,
                security=security,
                tls_name=args.tls_name,
            )
        except BatchwireError as exc:
            # Bad flags (an unreadable credentials file, an address without a port) exit 2, as
            # argparse's errors do; a server that does not answer SERVING exits 1.
            if exc.code.name == "INVALID_ARGUMENT":
                print(f"error: {_one_line(exc.details)}", file=sys.stderr)
                return 2
            answer = f"{exc.code.name}: {_one_line(exc.details)}"
            final = exc.code.name == "UNAUTHENTICATED"  # asking again will not help
        else:
            if status == "SERVING":
                print(f"{args.address}: {status}")
                return 0
            answer, final = status, False
        if final or time.monotonic() + _POLL_S > deadline:
            break
        time.sleep(_POLL_S)
    waited = f" after {args.wait:g} s" if args.wait > 0 else ""
    reason = _why_not_serving(args, security) if answer == "NOT_SERVING" else ""
    print(f"{args.address}: {answer}{waited}{reason}", file=sys.stderr)
    return 1


def _one_line(text: str) -> str:
    """gRPC's details can span lines (one per address tried); a probe prints one."""
    return " ".join(text.split())


def _why_not_serving(args: argparse.Namespace, security: Any) -> str:
    """What a server that answers NOT_SERVING is waiting for, where the client can tell."""
    from batchwire.client import BatchwireError, list_datasets

    try:
        names = list_datasets(
            args.address,
            timeout=args.timeout,
            security=security,
            tls_name=args.tls_name,
        )
    except BatchwireError:
        return _BUSY
    if not names:
        return (
            ": it found no datasets under its --data-dir; `batchwire ingest` one there (its "
            "log says which directory): the server serves it after its next rescan, within "
            "--rescan-interval seconds or at once on SIGHUP"
        )
    return f"{_BUSY[:-1]}; it serves {', '.join(names)})"
