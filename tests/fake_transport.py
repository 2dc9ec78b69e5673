"""A transport with no network, for tests of what the client does over one.

``FakeTransport(handler)`` answers each ``PullBatches`` call with ``handler(call)``, run
in a thread of the call's own as a server's handler runs: it reads ``call.requests`` (the
pass's request stream) and yields ``Batch`` messages as bytes (``batch_message``), or
raises the ``BatchwireError`` the call ends with. Every call made is kept in ``calls``,
in the order opened, with the requests its handler read and whether it was cancelled.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from batchwire.client._transport import (
    BatchwireError,
    NotFoundError,
    Server,
    StatusCode,
    UnavailableError,
)
from batchwire.common.batch_codec import encode_batch
from batchwire.common.tensors import to_proto
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["FakeCall", "FakeTransport", "batch_message"]

_END = object()  # the handler returned: the server ended the call
_GUARD_S = 60.0  # a hang guard, not a speed check


def batch_message(index: int, batch_size: int) -> bytes:
    """Batch ``index`` of a share as a server sends it: samples ``100 * index + j``, each
    image filled with its batch's index, labels the sample ids' last digits, and the
    cursor after the batch."""
    ids = [100 * index + j for j in range(batch_size)]
    header = pb.Batch(
        index=index,
        ids=ids,
        labels=to_proto("labels", np.array(ids, np.int64) % 10, "N"),
        cursor=(index + 1) * batch_size,
    )
    images = np.full((batch_size, 1, 2, 2), index % 256, np.uint8)
    return encode_batch(header, images, "NCHW")


class FakeCall:
    """One ``PullBatches`` call to a fake server (a ``PullCall``)."""

    def __init__(
        self,
        server: Server,
        requests: Iterator[pb.PullRequest],
        handler: Callable[[FakeCall], Iterable[bytes]],
    ) -> None:
        self.server = server
        self.read: list[pb.PullRequest] = []  # the requests the handler read
        self.cancelled = threading.Event()
        self.ended = threading.Event()  # the handler returned or raised
        self.cancelled_while_open = False
        self._requests = requests
        self._out: queue.Queue[object] = queue.Queue()
        self._thread = threading.Thread(
            target=self._serve, args=(handler,), name=f"fake-{server.address}", daemon=True
        )

    @property
    def requests(self) -> Iterator[pb.PullRequest]:
        """The pass's request stream, as the handler reads it (each one kept in ``read``)."""
        for request in self._requests:
            self.read.append(request)
            yield request

    def asked(self) -> list[int]:
        """The batches the requests read so far asked for, in order."""
        return [index for request in self.read for index in request.batches]

    def _serve(self, handler: Callable[[FakeCall], Iterable[bytes]]) -> None:
        try:
            for message in handler(self):
                if self.cancelled.is_set():
                    return
                self._out.put(message)
            self._out.put(_END)
        except BatchwireError as exc:
            self._out.put(exc)
        finally:
            self.ended.set()

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self._thread.join(_GUARD_S)

    def __enter__(self) -> FakeCall:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None  # what the call raises is a BatchwireError already

    def __iter__(self) -> Iterator[bytes]:
        while True:
            item = self._out.get(timeout=_GUARD_S)
            if item is _END:
                return
            if isinstance(item, BatchwireError):
                raise item
            assert isinstance(item, bytes)
            yield item

    def grant(self) -> pb.SharedMemoryGrant | None:
        return None  # a server on another host: no shared memory

    def bulk_grant(self) -> pb.BulkGrant | None:
        return None  # a server that keeps images in the call's messages

    def cancel(self) -> None:
        self.cancelled_while_open = self.cancelled_while_open or not self.ended.is_set()
        self.cancelled.set()
        self._out.put(BatchwireError("the call was cancelled", code=StatusCode.CANCELLED))


class _Answered:
    """A unary call that already has its answer (a ``Pending``)."""

    def __init__(self, answer: Callable[[], object]) -> None:
        self._answer = answer

    def result(self) -> object:
        return self._answer()

    def cancel(self) -> None:
        pass


class FakeTransport:
    """A ``Transport`` whose servers are ``handler`` (one for all; it sees
    ``call.server``). ``describe`` knows the datasets in ``datasets``."""

    def __init__(
        self,
        handler: Callable[[FakeCall], Iterable[bytes]],
        datasets: dict[str, pb.DatasetInfo] | None = None,
    ) -> None:
        self.handler = handler
        self.datasets = datasets or {}
        self.calls: list[FakeCall] = []
        self.shares_memory: dict[Server, bool] = {}
        self._lock = threading.Lock()

    def tls_context(self) -> None:
        return None

    def open_pull(self, server: Server, requests: Iterator[pb.PullRequest]) -> FakeCall:
        call = FakeCall(server, requests, self.handler)
        with self._lock:
            self.calls.append(call)
        call.start()
        return call

    def calls_to(self, address: str) -> list[FakeCall]:
        with self._lock:
            return [call for call in self.calls if call.server.address == address]

    def describe(self, server: Server, dataset: str, *, timeout: float) -> _Answered:
        def answer() -> pb.DatasetInfo:
            if dataset not in self.datasets:
                raise NotFoundError(f"server {server.address}: no dataset {dataset!r}")
            return self.datasets[dataset]

        return _Answered(answer)

    def preprocess(
        self, server: Server, request: pb.PreprocessRequest, *, timeout: float
    ) -> _Answered:
        def answer() -> pb.PreprocessResponse:
            raise UnavailableError(f"server {server.address} preprocesses nothing")

        return _Answered(answer)

    def close(self) -> None:
        pass
