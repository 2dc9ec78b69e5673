"""The one place where gRPC's errors become the client's own exceptions (see
``_exceptions``): :func:`map_rpc_errors` around a block, :func:`error_from` for an error
caught, each worded with what to do where it can; and :func:`rpc_details`, what gRPC or
the server said before it was worded for a user."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc

from batchwire.client._transport._exceptions import BatchwireError, error_for

__all__ = ["error_from", "map_rpc_errors", "rpc_details"]


@contextlib.contextmanager
def map_rpc_errors(address: str = "") -> Iterator[None]:
    """Raise a ``grpc.RpcError`` from the block as the ``BatchwireError`` that fits its
    status code, its message saying what to do where it can: a server at ``address`` that
    is down or refuses the TLS handshake, a request over the server's size limit. The
    original is the error's ``rpc_error``, not printed before it: a user's traceback
    starts with batchwire's error and its message."""
    try:
        yield
    except grpc.RpcError as exc:
        raise error_from(exc, address) from None


def error_from(exc: grpc.RpcError, address: str) -> BatchwireError:
    """``exc`` as the client's exception that fits its status code (see
    :func:`map_rpc_errors`), ``exc`` its ``rpc_error``."""
    code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (exc.details() if isinstance(exc, grpc.Call) else None) or str(exc)
    error = error_for(code, _advice(code, details, address))
    error.rpc_error = exc
    return error


def rpc_details(error: BatchwireError) -> str:
    """What gRPC or the server said, for an ``error`` from ``map_rpc_errors``, before it
    was worded for a user (a retried failure is logged as it was)."""
    cause = error.rpc_error
    return (cause.details() if isinstance(cause, grpc.Call) else None) or error.details


def _advice(code: grpc.StatusCode, details: str, address: str) -> str:
    if code == grpc.StatusCode.UNAVAILABLE and address:
        if "handshake" in details.lower():
            return (
                f"TLS handshake with {address} failed ({details}); does tls_ca hold the CA "
                "that signed the server's certificate, and does the address match a name in it?"
            )
        return f"server {address} is unavailable ({details}); is `batchwire serve` running there?"
    if code == grpc.StatusCode.NOT_FOUND and address:
        return f"server {address}: {details}"  # which server lacks it, as for a pipeline
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
        return (
            f"{details}: the request is larger than the server accepts (its "
            "max_request_bytes); an image this large cannot be sent, or ask the server's "
            "operator to raise the limit"
        )
    return details
