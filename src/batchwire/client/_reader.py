"""A server puller: a named daemon thread that streams a pass's batches from one server.

It holds one ``PullBatches`` call at a time. The call's request stream asks for batches
from the pass's :class:`~batchwire.client._book.Book` whenever the server holds fewer than
``credit`` (so a faster server is asked for more), once the server has accepted the
stream; what arrives goes to the book, in the order asked. When the server fails
(connection lost, UNAVAILABLE from a draining server, ...), the batches it held go back
to the book for the other servers, and the puller tries the server again with backoff.
A refusal that no server can fix (bad arguments, credentials) fails the pass. It stops
promptly when ``stop`` is set (the RPC is cancelled).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable, Iterator

import grpc
import numpy as np

from batchwire.client._book import Book, Held
from batchwire.client._exceptions import BatchwireError, from_rpc_error
from batchwire.client._servers import RETRIABLE, Server, ServerSet, backoff
from batchwire.common.batch_codec import DecodedBatch, decode_batch
from batchwire.common.tensors import from_proto
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["Allocator", "Delivery", "ServerPuller", "TransferStats", "assemble"]

log = logging.getLogger(__name__)

_POLL = 0.1  # seconds between checks of `stop` while waiting


@dataclasses.dataclass(frozen=True)
class Delivery:
    """One received batch, decoded to arrays (or to tensors by ``convert``)."""

    index: int
    ids: np.ndarray
    images: object
    labels: object
    cursor: int
    skipped_ids: tuple[int, ...]
    normalized: bool
    layout: str


@dataclasses.dataclass
class TransferStats:
    """Image payload bytes received, and bytes copied on their way to tensors.

    ``copied == received`` means each payload byte was copied exactly once
    between the bytes gRPC hands over and the tensor the user gets.
    """

    received: int = 0
    copied: int = 0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def add(self, received: int, copied: int) -> None:
        with self.lock:
            self.received += received
            self.copied += copied


# allocate(shape, dtype) -> (owner, writable NumPy view of the owner's memory)
Allocator = Callable[[tuple[int, ...], np.dtype], tuple[object, np.ndarray]]


def _numpy_allocator(shape: tuple[int, ...], dtype: np.dtype) -> tuple[object, np.ndarray]:
    array = np.empty(shape, dtype)
    return array, array


def assemble(
    parts: list[DecodedBatch],
    allocate: Allocator = _numpy_allocator,
    stats: TransferStats | None = None,
) -> Delivery:
    """One Delivery from a batch's parts: image data copied once, into ``allocate``'d memory."""
    first, last = parts[0].header, parts[-1].header
    views = [p.images for p in parts]
    samples = sum(len(v) for v in views)
    owner, out = allocate((samples, *views[0].shape[1:]), views[0].dtype)
    position = 0
    for view in views:
        out[position : position + len(view)] = view
        position += len(view)
    if stats is not None:
        stats.add(sum(v.nbytes for v in views), out.nbytes)
    labels = [from_proto(p.header.labels) for p in parts]
    return Delivery(
        index=first.index,
        ids=np.concatenate([np.asarray(p.header.ids, dtype=np.int64) for p in parts]),
        images=owner,
        labels=np.concatenate(labels) if labels else np.zeros((0,), np.int64),
        cursor=last.cursor,
        skipped_ids=tuple(last.skipped_ids),
        normalized=first.normalized,
        layout=parts[0].layout,
    )


# Opens a PullBatches call on a server with a request stream.
OpenCall = Callable[[Server, Iterator[pb.PullRequest]], grpc.Call]


class ServerPuller(threading.Thread):
    def __init__(
        self,
        *,
        server: Server,
        spec: pb.StreamBatchesRequest,
        open_call: OpenCall,
        book: Book,
        credit: int,
        servers: ServerSet,
        convert: Callable[[Delivery], Delivery],
        stop: threading.Event,
        allocate: Allocator = _numpy_allocator,
        stats: TransferStats | None = None,
    ) -> None:
        super().__init__(name=f"batchwire-pull-{server.address}", daemon=True)
        self.server = server
        self._spec = spec
        self._open_call = open_call
        self._book = book
        self._credit = credit
        self._servers = servers
        self._convert = convert
        self._halt = stop
        self._allocate = allocate
        self._stats = stats
        self._call: grpc.Call | None = None
        self._lock = threading.Lock()
        self.delivered = 0  # batches this server delivered in this pass

    def run(self) -> None:
        try:
            self._pull()
        except BatchwireError as exc:
            self._book.fail(exc)
        except Exception as exc:  # a bug or a malformed message: surface it, never hang
            log.exception("puller of %s failed", self.server.address)
            error = BatchwireError(f"client reader failed: {exc!r}", code=grpc.StatusCode.INTERNAL)
            error.__cause__ = exc
            self._book.fail(error)

    def _pull(self) -> None:
        attempt = 0
        while not self._halt.is_set() and not self._book.finished:
            held = Held()
            over = threading.Event()  # the call is over: its request stream asks for nothing
            accepted = threading.Event()  # the server opened the stream: ask it for batches
            failure: tuple[grpc.StatusCode, str] | None = None
            before = self.delivered
            try:
                with self._lock:
                    if self._halt.is_set():
                        return
                    call = self._call = self._open_call(
                        self.server, self._requests(held, over, accepted)
                    )
                call.initial_metadata()  # sent once it opened
                accepted.set()
                self._receive(call, held, recovering=attempt > 0)
                return  # the stream ended: the pass is finished
            except grpc.RpcError as exc:
                if self._halt.is_set():
                    return
                if self.delivered > before:
                    attempt = 0  # it delivered since it last failed: a new outage
                code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
                if code not in RETRIABLE:
                    raise from_rpc_error(exc, self.server.address) from exc
                details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
                failure = (code, f"{self.server.address}: {code.name}: {details}")
            finally:
                over.set()  # before giving back, so the request stream claims no more
                returned = self._book.give_back(held, failure)
            assert failure is not None  # the one way here: a failure to retry
            self._servers.mark_failed(self.server)
            # Once per outage, and whenever batches move: not every retry of a dead server.
            log.log(
                logging.WARNING if returned or not attempt else logging.DEBUG,
                "%s failed (%s); %d batches it held go to other servers",
                self.server.address,
                failure[1],
                len(returned),
            )
            if self._halt.wait(backoff(attempt)):
                return
            attempt += 1

    def _receive(self, call: Iterable[bytes], held: Held, *, recovering: bool) -> None:
        """Hand the call's batches to the book as their last parts arrive, until it ends."""
        parts: list[DecodedBatch] = []
        for raw in call:
            part = decode_batch(raw)
            if part.header.part != len(parts):
                raise BatchwireError(
                    f"batch {part.header.index}: part {part.header.part} arrived "
                    f"after {len(parts)} parts",
                    code=grpc.StatusCode.INTERNAL,
                )
            parts.append(part)
            if len(parts) < (part.header.parts or 1):
                continue
            self._book.deliver(held, self._convert(assemble(parts, self._allocate, self._stats)))
            parts = []
            self.delivered += 1
            if recovering:
                recovering = False
                self._servers.mark_ok(self.server)

    def _requests(
        self, held: Held, over: threading.Event, accepted: threading.Event
    ) -> Iterator[pb.PullRequest]:
        """The call's request stream (read by gRPC's own thread): the stream, then batches
        as the server has room. Ends (half-closes) once the pass is finished or the call
        is over."""
        yield pb.PullRequest(stream=self._spec)
        while not accepted.wait(_POLL):
            if over.is_set() or self._halt.is_set():
                return
        while True:
            batches = self._book.claim(
                held, self._credit, lambda: over.is_set() or self._halt.is_set()
            )
            if batches is None:
                return
            yield pb.PullRequest(batches=batches)

    def cancel(self) -> None:
        """Stop pulling and cancel the call (from any thread)."""
        self._halt.set()
        with self._lock:
            if self._call is not None:
                self._call.cancel()
