"""``batchwire health --address HOST:PORT``: exit 0 only when the server reports SERVING.

For a secured server: ``--tls-ca`` (and ``--tls-cert``/``--tls-key`` for mutual
TLS) and a token from ``--token-file`` or ``BATCHWIRE_TOKEN``, which the server
needs unless it runs with ``--health-open``.
"""

from __future__ import annotations

import argparse
import sys

from batchwire.cli import _credentials as credentials

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "health",
        help="ask a server's gRPC health service; exit 0 only when SERVING",
        description="Query the standard grpc.health.v1.Health service (for probes and healthchecks).",
    )
    parser.add_argument(
        "--address", default="localhost:50051", help="HOST:PORT (default localhost:50051)"
    )
    parser.add_argument("--service", default="", help="service name ('' = the whole server)")
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for an answer (default 5)"
    )
    credentials.add_arguments(parser, tls_name=True)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from batchwire.client import BatchwireError, ChannelSecurity, check_health

    try:
        security = ChannelSecurity.from_options(
            token_file=args.token_file,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        )
    except BatchwireError as exc:
        print(f"error: {exc.details}", file=sys.stderr)
        return 2
    try:
        status = check_health(
            args.address,
            service=args.service,
            timeout=args.timeout,
            security=security,
            tls_name=args.tls_name,
        )
    except BatchwireError as exc:
        print(f"{args.address}: {exc.code.name}: {exc.details}", file=sys.stderr)
        return 1
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1
