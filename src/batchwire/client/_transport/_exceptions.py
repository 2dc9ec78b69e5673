"""The client's exceptions and status codes. Every error a user meets is a
``BatchwireError``.

    BatchwireError                .code: StatusCode, .details: str
    ├── NotFoundError             NOT_FOUND: unknown dataset or pipeline
    ├── InvalidArgumentError      INVALID_ARGUMENT (also a ValueError): bad arguments
    │   └── BadImagesError        Preprocessed.raise_for_errors(): images that failed, in .errors
    ├── ResourceExhaustedError    RESOURCE_EXHAUSTED: a server limit was reached
    ├── UnavailableError          UNAVAILABLE, DEADLINE_EXCEEDED: no server answered in time
    └── AuthenticationError       UNAUTHENTICATED, PERMISSION_DENIED: bad or missing credentials

``StatusCode`` is the client's own: gRPC's codes by name and value, each equal to (and
hashed as) ``grpc.StatusCode``'s of the same name, so that code written against either
works; nothing here imports grpc. Each class carries its ``default_code``:
``NotFoundError("no dataset 'x'")`` has ``code == StatusCode.NOT_FOUND``. ``error_for``
picks the class for a status code; ``map_rpc_errors`` (``_grpc``) is the one place where a
``grpc.RpcError`` becomes one of these (kept as its ``rpc_error``), its code mapped to the
client's. The classes say ``batchwire.client`` is their module, where users import them
from.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar, overload

__all__ = [
    "AuthenticationError",
    "BadImagesError",
    "BatchwireError",
    "InvalidArgumentError",
    "NotFoundError",
    "ResourceExhaustedError",
    "StatusCode",
    "UnavailableError",
    "error_for",
]


class StatusCode(enum.Enum):
    """A call's outcome, as gRPC names it (the same names and values as
    ``grpc.StatusCode``). A member equals gRPC's member of the same name, and hashes as it
    does: ``error.code == StatusCode.UNAVAILABLE`` holds as
    ``error.code == StatusCode.UNAVAILABLE`` does."""

    OK = (0, "ok")
    CANCELLED = (1, "cancelled")
    UNKNOWN = (2, "unknown")
    INVALID_ARGUMENT = (3, "invalid argument")
    DEADLINE_EXCEEDED = (4, "deadline exceeded")
    NOT_FOUND = (5, "not found")
    ALREADY_EXISTS = (6, "already exists")
    PERMISSION_DENIED = (7, "permission denied")
    RESOURCE_EXHAUSTED = (8, "resource exhausted")
    FAILED_PRECONDITION = (9, "failed precondition")
    ABORTED = (10, "aborted")
    OUT_OF_RANGE = (11, "out of range")
    UNIMPLEMENTED = (12, "unimplemented")
    INTERNAL = (13, "internal")
    UNAVAILABLE = (14, "unavailable")
    DATA_LOSS = (15, "data loss")
    UNAUTHENTICATED = (16, "unauthenticated")

    @classmethod
    def of(cls, code: enum.Enum) -> StatusCode:
        """The client's code for ``code``, one of its own or gRPC's (by name)."""
        return code if isinstance(code, cls) else cls[code.name]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StatusCode):
            return self is other
        if isinstance(other, enum.Enum) and type(other).__name__ == "StatusCode":
            return self.name == other.name  # gRPC's
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._name_)  # as an Enum member hashes: gRPC's of this name does


class BatchwireError(Exception):
    """A batchwire operation failed; ``code`` is its :class:`StatusCode`.

    Raise one as ``NotFoundError("no dataset 'x'")``: ``code`` defaults to the class's
    ``default_code``; pass ``code=`` for another (``UnavailableError("...",
    code=StatusCode.DEADLINE_EXCEEDED)``; gRPC's codes are taken too). The older form
    ``BatchwireError(code, details)`` still works.
    """

    default_code: ClassVar[StatusCode] = StatusCode.UNKNOWN
    # The gRPC error this one was made from, where it was (``map_rpc_errors``).
    rpc_error: Exception | None = None

    @overload
    def __init__(self, details: str, /, *, code: enum.Enum | None = None) -> None: ...
    @overload
    def __init__(self, code: enum.Enum, details: str, /) -> None: ...
    def __init__(self, *args: enum.Enum | str, code: enum.Enum | None = None) -> None:
        if len(args) == 2 and isinstance(args[0], enum.Enum) and code is None:
            code, details = args[0], str(args[1])
        elif len(args) == 1 and isinstance(args[0], str):
            details = args[0]
        else:
            raise TypeError(
                f"{type(self).__name__}(details, *, code=None) or (code, details), got {args!r}"
            )
        status = StatusCode.of(code) if code is not None else self.default_code
        super().__init__(f"{status.name}: {details}")
        self.code = status
        self.details = details

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception pickles its args (the formatted message); rebuild from code and details.
        # gRPC's call objects do not pickle: rpc_error stays behind.
        state = {k: v for k, v in self.__dict__.items() if k != "rpc_error"}
        return type(self), (self.code, self.details), state


class NotFoundError(BatchwireError):
    default_code = StatusCode.NOT_FOUND


class InvalidArgumentError(BatchwireError, ValueError):
    default_code = StatusCode.INVALID_ARGUMENT


class BadImagesError(InvalidArgumentError):
    """Some images of a Preprocessor call failed; ``errors`` holds ``(index, reason)`` pairs."""

    def __init__(
        self,
        *args: enum.Enum | str,
        code: enum.Enum | None = None,
        errors: tuple[Any, ...] = (),
    ) -> None:
        super().__init__(*args, code=code)  # type: ignore[arg-type]  # either overload's args
        self.errors = errors


class ResourceExhaustedError(BatchwireError):
    default_code = StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(BatchwireError):
    default_code = StatusCode.UNAVAILABLE


class AuthenticationError(BatchwireError):
    default_code = StatusCode.UNAUTHENTICATED


_BY_CODE: dict[StatusCode, type[BatchwireError]] = {
    StatusCode.NOT_FOUND: NotFoundError,
    StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    StatusCode.UNAVAILABLE: UnavailableError,
    StatusCode.DEADLINE_EXCEEDED: UnavailableError,
    StatusCode.UNAUTHENTICATED: AuthenticationError,
    StatusCode.PERMISSION_DENIED: AuthenticationError,
}


# Tracebacks and reprs name the classes where users import them from.
for _error in (
    StatusCode,
    BatchwireError,
    NotFoundError,
    InvalidArgumentError,
    BadImagesError,
    ResourceExhaustedError,
    UnavailableError,
    AuthenticationError,
):
    _error.__module__ = "batchwire.client"


def error_for(code: enum.Enum, details: str) -> BatchwireError:
    """The exception class that fits ``code`` (the client's or gRPC's), built with
    ``details``."""
    status = StatusCode.of(code)
    return _BY_CODE.get(status, BatchwireError)(details, code=status)
