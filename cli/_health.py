"""``batchwire health --address HOST:PORT``: exit 0 only when the server reports SERVING.

For a secured server: ``--tls-ca`` (and ``--tls-cert``/``--tls-key`` for mutual
TLS) and a token from ``--token-file`` or ``BATCHWIRE_TOKEN``, which the server
needs unless it runs with ``--health-open``.
"""

from __future__ import annotations

import argparse
import sys

from batchwire.cli import _credentials as credentials

__all__ = ["DESCRIPTION", "HELP", "add_arguments", "run"]


HELP = "ask a server's gRPC health service; exit 0 only when SERVING"
DESCRIPTION = "Query the standard grpc.health.v1.Health service (for probes and healthchecks)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address", default="localhost:50051", help="HOST:PORT (default localhost:50051)"
    )
    parser.add_argument("--service", default="", help="service name ('' = the whole server)")
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for an answer (default 5)"
    )
    credentials.add_arguments(parser, tls_name=True)


def run(args: argparse.Namespace) -> int:
    from batchwire.client import BatchwireError, check_health

    try:
        status = check_health(
            args.address,
            service=args.service,
            timeout=args.timeout,
            security=credentials.security(args),
            tls_name=args.tls_name,
        )
    except BatchwireError as exc:
        # Bad flags (an unreadable credentials file, an address without a port) exit 2, as
        # argparse's errors do; a server that does not answer SERVING exits 1.
        if exc.code.name == "INVALID_ARGUMENT":
            print(f"error: {exc.details}", file=sys.stderr)
            return 2
        print(f"{args.address}: {exc.code.name}: {exc.details}", file=sys.stderr)
        return 1
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1
