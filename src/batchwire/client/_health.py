"""Asking a server's standard gRPC health service, with the client's errors and credentials."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchwire.client._channel import open_channel, stub
from batchwire.client._exceptions import from_rpc_error
from batchwire.client._security import ChannelSecurity
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["check_health", "list_datasets"]


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
    with open_channel(address, security, tls_name=tls_name) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service),
                timeout=timeout,
                metadata=security.metadata() if security is not None else (),
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, address) from exc
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
    with open_channel(address, security, tls_name=tls_name) as channel:
        try:
            response = stub(channel).ListDatasets(
                pb.ListDatasetsRequest(),
                timeout=timeout,
                metadata=security.metadata() if security is not None else (),
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, address) from exc
    return sorted(dataset.name for dataset in response.datasets)
