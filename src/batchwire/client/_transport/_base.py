"""What the client asks of servers, as the rest of the client sees it: the interface its
loader, passes and ``Preprocessor`` call. ``GrpcTransport`` (``_grpc``) is the one
implementation that talks to servers; a test can put one of its own in its place.

What comes out of a transport is the client's own: ``batchwire.v1`` messages (the wire's
data), and errors as ``BatchwireError`` and its kinds.
"""

from __future__ import annotations

import dataclasses
import ssl
from collections.abc import Iterator
from types import TracebackType
from typing import Protocol, TypeVar

from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["Pending", "PullCall", "Server", "Transport"]

_T_co = TypeVar("_T_co", covariant=True)


@dataclasses.dataclass(frozen=True)
class Server:
    """One server: the address to dial and, for resolved names, the TLS host name."""

    address: str
    tls_name: str | None = None


class Pending(Protocol[_T_co]):
    """A unary call under way."""

    def result(self) -> _T_co:
        """The response, once it came (blocks); raises the ``BatchwireError`` that fits
        if the call failed."""
        ...

    def cancel(self) -> None:
        """Cancel the call if it is still under way."""
        ...


class PullCall(Protocol):
    """One ``PullBatches`` call under way, used as a context manager: within its block,
    what the call raises (its grant, the messages received) comes out as the
    ``BatchwireError`` that fits. Iterated within it, it yields each ``Batch`` message as
    the bytes received (the client parses them without copying the images) until the
    server ends the call."""

    def __enter__(self) -> PullCall: ...

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...

    def __iter__(self) -> Iterator[bytes]: ...

    def grant(self) -> pb.SharedMemoryGrant | None:
        """The server's grant of shared memory, from the call's initial metadata (waits
        until the call opened); None where it granted none."""
        ...

    def bulk_grant(self) -> pb.BulkGrant | None:
        """The server's grant of a bulk connection, from the call's initial metadata
        (waits until the call opened); None where it granted none."""
        ...

    def cancel(self) -> None:
        """End the call now (from any thread): the server sees it cancelled, and what
        receives its messages gets a CANCELLED error."""
        ...


class Transport(Protocol):
    """Calls to servers. Thread-safe: every puller of every pass uses one."""

    # Whether a server's last call gave this process its shared memory (it is on this
    # host): a call to one that did not asks for batches without waiting for a ring.
    shares_memory: dict[Server, bool]

    def tls_context(self) -> ssl.SSLContext | None:
        """TLS for a call's bulk connection, from the calls' own credentials; None where
        the calls are plaintext."""
        ...

    def open_pull(self, server: Server, requests: Iterator[pb.PullRequest]) -> PullCall:
        """A ``PullBatches`` call on ``server`` that sends ``requests`` (read by a thread
        of the transport's) until they end or the call does."""
        ...

    def describe(self, server: Server, dataset: str, *, timeout: float) -> Pending[pb.DatasetInfo]:
        """A ``DescribeDataset`` call for ``dataset`` on ``server``."""
        ...

    def preprocess(
        self, server: Server, request: pb.PreprocessRequest, *, timeout: float
    ) -> Pending[pb.PreprocessResponse]:
        """A ``Preprocess`` call on ``server``."""
        ...

    def close(self) -> None:
        """Let go of what this process holds to reach the servers; a later call opens
        it again."""
        ...
