"""What the client asks of servers, as the rest of the client sees it: the interface its
loader, passes and ``Preprocessor`` call. ``GrpcTransport`` (``_grpc``) is the one
implementation that talks to servers; a test can put one of its own in its place.

What comes out of a transport is the client's own: ``batchwire.v1`` messages and batches
decoded from them (``DecodedBatch``), and errors as ``BatchwireError`` and its kinds.
How a batch's images travel beside its message (a server's shared memory on this host, a
bulk connection to one on another) is the transport's: a pass says what it may offer
(``PullOptions``) and takes each batch's images where the transport shows them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Protocol, TypeVar

import numpy as np

from batchwire.common.batch_codec import DecodedBatch
from batchwire.v1 import batchwire_pb2 as pb

__all__ = [
    "Claim",
    "Pending",
    "PullCall",
    "PullOptions",
    "Server",
    "Transport",
    "host_of",
]

# host:port or [v6]:port; anything with a scheme (dns:///, unix:, ipv4:) is gRPC's to parse.
HOST_PORT = re.compile(r"(\[[^\]]+\]|[^:\[\]/]+):\d{1,5}")

# The pass's side of a call's request stream: the batches to ask for next (``True``:
# waiting until the server has room for one), or None once the call asks for no more.
Claim = Callable[[bool], Sequence[int] | None]

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


@dataclasses.dataclass(frozen=True)
class PullOptions:
    """What a ``PullBatches`` call may offer beside its messages, where the server can
    take it: its shared memory (a server on this host), holding ``buffers`` batches, of
    which ``lend`` at a time may be lent to the loop where they lie (not copied out); a
    bulk connection (a server on another host), whose reads wait at most ``timeout``."""

    shared_memory: bool = False
    bulk: bool = False
    buffers: int = 1
    lend: int = 0
    timeout: float = 300.0


class PullCall(Protocol):
    """One ``PullBatches`` call under way, used as a context manager: within its block,
    what the call raises comes out as the ``BatchwireError`` that fits. Iterated within
    it, it yields each ``Batch`` message decoded (``decode_batch``: its images a view, not
    a copy, of the message or of the server's shared memory, valid until the next is
    taken, or, ``lent``, for as long as a view of them is kept) until the server ends the
    call; the block's end lets go of what the call held beside it."""

    def __enter__(self) -> PullCall: ...

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...

    def __iter__(self) -> Iterator[DecodedBatch]: ...

    def read_images(self, out: np.ndarray) -> None:
        """The images of the batch just taken, which the server sent on the call's bulk
        connection (its header's ``bulk_images``), read into ``out``."""
        ...

    def cancel(self) -> None:
        """End the call now (from any thread): the server sees it cancelled, and what
        receives its batches gets a CANCELLED error."""
        ...


class Transport(Protocol):
    """Calls to servers. Thread-safe: every puller of every pass uses one."""

    def open_pull(
        self, server: Server, stream: pb.StreamBatchesRequest, claim: Claim, options: PullOptions
    ) -> PullCall:
        """A ``PullBatches`` call on ``server`` for ``stream``: its first request names
        the stream and asks for the first batches ``claim(False)`` has room for, each
        later one for those ``claim(True)`` gives (called by a thread of the transport's)
        until it gives None (the request stream then ends) or the call does."""
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


def host_of(address: str) -> str | None:
    """The host of a ``host:port`` (or ``[v6]:port``) address; None for another gRPC
    target (``unix:``, ``ipv4:``, ``dns:///``), which names no one host."""
    return address.rpartition(":")[0] if HOST_PORT.fullmatch(address) else None
