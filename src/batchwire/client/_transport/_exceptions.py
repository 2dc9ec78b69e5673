"""The client's exceptions. Every error a user meets is a ``BatchwireError``.

    BatchwireError                .code: grpc.StatusCode, .details: str
    ├── NotFoundError             NOT_FOUND: unknown dataset or pipeline
    ├── InvalidArgumentError      INVALID_ARGUMENT (also a ValueError): bad arguments
    │   └── BadImagesError        Preprocessed.raise_for_errors(): images that failed, in .errors
    ├── ResourceExhaustedError    RESOURCE_EXHAUSTED: a server limit was reached
    ├── UnavailableError          UNAVAILABLE, DEADLINE_EXCEEDED: no server answered in time
    └── AuthenticationError       UNAUTHENTICATED, PERMISSION_DENIED: bad or missing credentials

Each class carries its ``default_code``: ``NotFoundError("no dataset 'x'")`` has
``code == grpc.StatusCode.NOT_FOUND``. ``error_for`` picks the class for a status code;
``map_rpc_errors`` (``_grpc``) is the one place where a ``grpc.RpcError`` becomes one of
these (kept as its ``rpc_error``). They are the transport's because their codes are
gRPC's: the rest of the client takes them, and ``StatusCode``, from the transport. The
classes say ``batchwire.client`` is their module, where users import them from.
"""

from __future__ import annotations

from typing import Any, ClassVar, overload

import grpc

__all__ = [
    "AuthenticationError",
    "BadImagesError",
    "BatchwireError",
    "InvalidArgumentError",
    "NotFoundError",
    "ResourceExhaustedError",
    "UnavailableError",
    "error_for",
]


class BatchwireError(Exception):
    """A batchwire operation failed; ``code`` is the ``grpc.StatusCode``.

    Raise one as ``NotFoundError("no dataset 'x'")``: ``code`` defaults to the class's
    ``default_code``; pass ``code=`` for another (``UnavailableError("...",
    code=grpc.StatusCode.DEADLINE_EXCEEDED)``). The older form ``BatchwireError(code,
    details)`` still works.
    """

    default_code: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN
    # The gRPC error this one was made from, where it was (``map_rpc_errors``).
    rpc_error: grpc.RpcError | None = None

    @overload
    def __init__(self, details: str, /, *, code: grpc.StatusCode | None = None) -> None: ...
    @overload
    def __init__(self, code: grpc.StatusCode, details: str, /) -> None: ...
    def __init__(self, *args: grpc.StatusCode | str, code: grpc.StatusCode | None = None) -> None:
        if len(args) == 2 and isinstance(args[0], grpc.StatusCode) and code is None:
            code, details = args[0], str(args[1])
        elif len(args) == 1 and isinstance(args[0], str):
            details = args[0]
        else:
            raise TypeError(
                f"{type(self).__name__}(details, *, code=None) or (code, details), got {args!r}"
            )
        code = code if code is not None else self.default_code
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception pickles its args (the formatted message); rebuild from code and details.
        # gRPC's call objects do not pickle: rpc_error stays behind.
        state = {k: v for k, v in self.__dict__.items() if k != "rpc_error"}
        return type(self), (self.code, self.details), state


class NotFoundError(BatchwireError):
    default_code = grpc.StatusCode.NOT_FOUND


class InvalidArgumentError(BatchwireError, ValueError):
    default_code = grpc.StatusCode.INVALID_ARGUMENT


class BadImagesError(InvalidArgumentError):
    """Some images of a Preprocessor call failed; ``errors`` holds ``(index, reason)`` pairs."""

    def __init__(
        self,
        *args: grpc.StatusCode | str,
        code: grpc.StatusCode | None = None,
        errors: tuple[Any, ...] = (),
    ) -> None:
        super().__init__(*args, code=code)
        self.errors = errors


class ResourceExhaustedError(BatchwireError):
    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(BatchwireError):
    default_code = grpc.StatusCode.UNAVAILABLE


class AuthenticationError(BatchwireError):
    default_code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: dict[grpc.StatusCode, type[BatchwireError]] = {
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: UnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
}


# Tracebacks and reprs name the classes where users import them from.
for _error in (
    BatchwireError,
    NotFoundError,
    InvalidArgumentError,
    BadImagesError,
    ResourceExhaustedError,
    UnavailableError,
    AuthenticationError,
):
    _error.__module__ = "batchwire.client"


def error_for(code: grpc.StatusCode, details: str) -> BatchwireError:
    """The exception class that fits ``code``, built with ``details``."""
    return _BY_CODE.get(code, BatchwireError)(details, code=code)
