"""The client's one seam to the servers, and the only part of the client that imports grpc
(``tests/test_layout.py`` holds that)::

    Transport, PullCall, Pending   what the client asks of servers (``_base``): a pull
                                   stream for a pass, dataset descriptions, preprocessing
    GrpcTransport                  the one that talks to servers (``_grpc``): channels with
                                   the client's options and credentials (``_channels``,
                                   ``_security``), calls, status codes mapped to
                                   exceptions (``_rpc_errors``)
    BatchwireError and its kinds   what comes out of a transport that failed
                                   (``_exceptions``), ``code`` the client's ``StatusCode``
                                   (gRPC's codes, by name, mapped in ``_rpc_errors``)

The loader, its passes and the ``Preprocessor`` hold a ``Transport``: they send and
receive ``batchwire.v1`` messages, and catch the client's own exceptions.
``check_health`` and ``list_datasets`` are the public calls of their own.
"""

from __future__ import annotations

from batchwire.client._transport._base import (
    Claim,
    Pending,
    PullCall,
    PullOptions,
    Server,
    Transport,
    host_of,
)
from batchwire.client._transport._channels import (
    CHANNEL_OPTIONS,
    check_health,
    check_target,
    list_datasets,
)
from batchwire.client._transport._exceptions import (
    AuthenticationError,
    BadImagesError,
    BatchwireError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    StatusCode,
    UnavailableError,
    error_for,
)
from batchwire.client._transport._grpc import GrpcTransport, read_bulk_grant, read_grant
from batchwire.client._transport._rpc_errors import rpc_details
from batchwire.client._transport._security import ChannelSecurity, PemSource
from batchwire.client._transport._shared_memory import SharedMemoryFailed

__all__ = [
    "CHANNEL_OPTIONS",
    "AuthenticationError",
    "BadImagesError",
    "BatchwireError",
    "ChannelSecurity",
    "Claim",
    "GrpcTransport",
    "InvalidArgumentError",
    "NotFoundError",
    "PemSource",
    "Pending",
    "PullCall",
    "PullOptions",
    "ResourceExhaustedError",
    "Server",
    "SharedMemoryFailed",
    "StatusCode",
    "Transport",
    "UnavailableError",
    "check_health",
    "check_target",
    "error_for",
    "host_of",
    "list_datasets",
    "read_bulk_grant",
    "read_grant",
    "rpc_details",
]
