"""``batchwire health --address HOST:PORT``: exit 0 only when the server reports SERVING.

For a secured server: ``--tls-ca`` (and ``--tls-cert``/``--tls-key`` for mutual
TLS) and a token from ``--token-file`` or ``BATCHWIRE_TOKEN``, which the server
needs unless it runs with ``--health-open``.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from batchwire.cli import _credentials as credentials

if TYPE_CHECKING:
    from batchwire.client._security import ChannelSecurity

__all__ = ["add_parser", "check", "run"]


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


def check(
    address: str,
    service: str = "",
    timeout: float = 5.0,
    security: ChannelSecurity | None = None,
    *,
    tls_name: str | None = None,
) -> str:
    """The status name the server reports, e.g. "SERVING"; raises grpc.RpcError."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from batchwire.client._channel import open_channel

    with open_channel(address, security, tls_name=tls_name) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service),
            timeout=timeout,
            metadata=security.metadata() if security is not None else (),
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def run(args: argparse.Namespace) -> int:
    import grpc

    from batchwire.client import BatchwireError
    from batchwire.client._security import ChannelSecurity

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
        status = check(args.address, args.service, args.timeout, security, tls_name=args.tls_name)
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
        what = (
            "credentials refused"
            if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
            else "no answer"
        )
        details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        print(f"{args.address}: {what} ({code.name}: {details})", file=sys.stderr)
        return 1
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1
