"""Domain errors of the server core, each meaning one thing to a client.

The servicer maps them to gRPC status codes in one table; the core never
imports grpc.

    ServiceError
    ├── NotFound           unknown dataset or pipeline
    ├── InvalidRequest     a request field is out of range or inconsistent
    ├── OverCapacity       a server limit (streams, batch size) is reached
    └── Draining           the server is shutting down; retry elsewhere
"""

from __future__ import annotations

__all__ = ["Draining", "InvalidRequest", "NotFound", "OverCapacity", "ServiceError"]


class ServiceError(Exception):
    """Base of the errors a request can meet; the message is for the user."""


class NotFound(ServiceError):
    pass


class InvalidRequest(ServiceError):
    pass


class OverCapacity(ServiceError):
    pass


class Draining(ServiceError):
    pass
