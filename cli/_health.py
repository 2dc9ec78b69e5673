"""``batchwire health --address HOST:PORT``: exit 0 only when the server reports SERVING."""

from __future__ import annotations

import argparse
import sys

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
    parser.set_defaults(func=run)
    return parser


def check(address: str, service: str = "", timeout: float = 5.0) -> str:
    """The status name the server reports, e.g. "SERVING"; raises grpc.RpcError."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def run(args: argparse.Namespace) -> int:
    import grpc

    try:
        status = check(args.address, args.service, args.timeout)
    except grpc.RpcError as exc:
        print(f"{args.address}: no answer ({exc.code().name}: {exc.details()})", file=sys.stderr)
        return 1
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1
