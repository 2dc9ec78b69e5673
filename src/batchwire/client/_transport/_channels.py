"""A channel to a server: its address checked (:func:`check_target`), opened with the
client's options (:data:`CHANNEL_OPTIONS`) and credentials (:func:`open_channel`), the
service's stub on it (:func:`stub`); and the calls made on a channel opened for them
alone, with no transport: :func:`check_health` and :func:`list_datasets`."""

from __future__ import annotations

import json
import re

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchwire.client._transport._base import HOST_PORT
from batchwire.client._transport._exceptions import InvalidArgumentError
from batchwire.client._transport._rpc_errors import map_rpc_errors
from batchwire.client._transport._security import ChannelSecurity
from batchwire.v1 import batchwire_pb2 as pb
from batchwire.v1 import batchwire_pb2_grpc

__all__ = [
    "CHANNEL_OPTIONS",
    "check_health",
    "check_target",
    "list_datasets",
    "open_channel",
    "stub",
]

# The calls that change nothing on a server, which gRPC itself makes again (its retry
# policy: up to 5 attempts, 0.1 s to 1 s apart, within the call's deadline) when an attempt
# ends before the server answered: UNAVAILABLE (a server restarting), or the first calls of
# a process forked from one that used gRPC (a DataLoader worker), which gRPC's handling of
# the fork ends now and then with "Stream removed" (UNAVAILABLE: "sendmsg: Wrong file
# descriptor generation"; CANCELLED: "Closed on fork"), about one in seven in a test that
# forks and calls at once. gRPC never retries a call the caller cancelled. A pulled stream
# is not among them: the loader makes a failed call again itself, from its cursor.
_RETRIED = ("ListDatasets", "DescribeDataset", "Preprocess")
SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "batchwire.v1.Batchwire", "method": m} for m in _RETRIED],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"],
                },
            }
        ]
    }
)
# A batch (e.g. 512 x 3 x 224 x 224 uint8 = 77 MB) is one message, far above
# gRPC's 4 MB default; the server caps batch sizes, so the client need not.
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", -1),
    # Preprocess requests carry encoded images; the server bounds what it
    # accepts (max_request_bytes) and answers RESOURCE_EXHAUSTED beyond it.
    ("grpc.max_send_message_length", -1),
    ("grpc.so_reuseport", 0),
    ("grpc.service_config", SERVICE_CONFIG),
)
# Web URLs, which gRPC would take for a DNS name ("Misformatted domain name").
_URL_SCHEME = re.compile(r"(https?|grpcs?)://", re.IGNORECASE)


def check_target(target: str) -> str:
    """``target`` if it names a port; InvalidArgumentError if it is a bare host, which gRPC
    would dial on port 443, or a web URL (``http://host:port``), which gRPC cannot resolve."""
    scheme = _URL_SCHEME.match(target)
    if scheme:
        bare = target[scheme.end() :].rstrip("/")
        raise InvalidArgumentError(
            f"address {target!r} is a URL: write HOST:PORT without {scheme.group()!r}, "
            f"e.g. {bare or 'gpu-host:50051'}"
        )
    if ":/" in target or target.startswith(("unix:", "ipv4:", "ipv6:", "unix-abstract:")):
        return target
    if not HOST_PORT.fullmatch(target):
        raise InvalidArgumentError(
            f"address {target!r} has no port: write HOST:PORT, e.g. gpu-host:50051 "
            "(batchwire serve's default port), or dns:///NAME:PORT"
        )
    return target


def open_channel(
    address: str, security: ChannelSecurity | None = None, *, tls_name: str | None = None
) -> grpc.Channel:
    """A channel to ``address`` ("host:port" or a gRPC target such as "dns:///name:port").

    With TLS, ``tls_name`` is the host name the server certificate must carry
    when ``address`` is an IP address resolved from that name.
    """
    check_target(address)
    credentials = security.channel_credentials() if security is not None else None
    if credentials is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    options: list[tuple[str, int | str]] = list(CHANNEL_OPTIONS)
    if tls_name:
        options.append(("grpc.ssl_target_name_override", tls_name))
    return grpc.secure_channel(address, credentials, options=options)


def stub(channel: grpc.Channel) -> batchwire_pb2_grpc.BatchwireStub:
    # protoc's gRPC gencode (batchwire_pb2_grpc) carries no annotations, and no stubs.
    return batchwire_pb2_grpc.BatchwireStub(channel)  # type: ignore[no-untyped-call]


def check_health(
    address: str,
    *,
    service: str = "",
    timeout: float = 5.0,
    security: ChannelSecurity | None = None,
    tls_name: str | None = None,
) -> str:
    """The status ``address`` reports for ``service`` ("" is the whole server), e.g. "SERVING".

    Raises the ``BatchwireError`` that fits, e.g. ``UnavailableError`` when nothing
    answers and ``AuthenticationError`` when the server refuses the credentials.
    """
    with open_channel(address, security, tls_name=tls_name) as channel, map_rpc_errors(address):
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service),
            timeout=timeout,
            metadata=security.metadata() if security is not None else (),
        )
    status: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return status


def list_datasets(
    address: str,
    *,
    timeout: float = 5.0,
    security: ChannelSecurity | None = None,
    tls_name: str | None = None,
) -> list[str]:
    """The names of the datasets ``address`` serves, sorted; ``[]`` for a server that found
    none under its data directory (its health then stays NOT_SERVING).

    Raises the ``BatchwireError`` that fits, as ``check_health`` does.
    """
    with open_channel(address, security, tls_name=tls_name) as channel, map_rpc_errors(address):
        response = stub(channel).ListDatasets(
            pb.ListDatasetsRequest(),
            timeout=timeout,
            metadata=security.metadata() if security is not None else (),
        )
    return sorted(dataset.name for dataset in response.datasets)
