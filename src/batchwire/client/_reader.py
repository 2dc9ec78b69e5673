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

import logging
import threading
from collections.abc import Iterable, Iterator

import grpc

from batchwire.client._book import Book, Held
from batchwire.client._delivery import Tensors
from batchwire.client._exceptions import BatchwireError
from batchwire.client._servers import RETRIABLE, Server, ServerSet, backoff
from batchwire.client._transport import Transport, map_rpc_errors, rpc_details
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["ServerPuller"]

log = logging.getLogger(__name__)

_POLL = 0.1  # seconds between checks of `stop` while waiting


class ServerPuller(threading.Thread):
    def __init__(
        self,
        *,
        server: Server,
        spec: pb.StreamBatchesRequest,
        transport: Transport,
        tensors: Tensors,
        book: Book,
        credit: int,
        servers: ServerSet,
        stop: threading.Event,
    ) -> None:
        super().__init__(name=f"batchwire-pull-{server.address}", daemon=True)
        self.server = server
        self._spec = spec
        self._transport = transport
        self._tensors = tensors
        self._book = book
        self._credit = credit
        self._servers = servers
        self._halt = stop
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
                with map_rpc_errors(self.server.address):
                    with self._lock:
                        if self._halt.is_set():
                            return
                        call = self._call = self._transport.open_pull(
                            self.server, self._requests(held, over, accepted)
                        )
                    call.initial_metadata()  # sent once it opened
                    accepted.set()
                    self._receive(call, held, recovering=attempt > 0)
                return  # the stream ended: the pass is finished
            except BatchwireError as exc:
                if self._halt.is_set():
                    return
                if exc.code not in RETRIABLE:
                    raise
                if self.delivered > before:
                    attempt = 0  # it delivered since it last failed: a new outage
                said = rpc_details(exc)
                failure = (exc.code, f"{self.server.address}: {exc.code.name}: {said}")
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
        for delivery in self._tensors.deliveries(call):
            self._book.deliver(held, delivery)
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
