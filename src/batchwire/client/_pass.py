"""One pass over a rank's share: a puller per server fills the pass's book, batches are
taken in order.

A pass owns its puller threads and their RPCs until ``stop()``. Behind a ``dns:///``
name, the name is resolved again every ``resolve_every`` seconds and servers that
appeared get a puller of their own, so they take batches within the epoch. Every live pass
is known to ``_at_exit``: at interpreter exit, passes still running (an iterator
left referenced, a loop abandoned mid-epoch) are stopped and their readers
joined before Python tears gRPC down, so the process neither hangs nor aborts.

A :class:`ServerPuller` is a named daemon thread that streams a pass's batches from one
server. It holds one ``PullBatches`` call at a time. The call's request stream asks for
batches from the pass's :class:`~batchwire.client._book.Book` whenever the server holds
fewer than ``credit`` (so a faster server is asked for more): from its first message on
where the server is on another host (no round trip waits for the call to open), once the
stream's shared memory is claimed where it is on this one. What arrives goes to the book,
in the order asked. When the server fails (connection lost, UNAVAILABLE from a draining
server, ...), the batches it held go back to the book for the other servers, and the
puller tries the server again with backoff. A refusal that no server can fix (bad
arguments, credentials) fails the pass. It stops promptly when ``stop`` is set (the RPC
is cancelled).
"""

from __future__ import annotations

import atexit
import logging
import secrets
import threading

from batchwire.client._at_exit import forget_at_exit, stop_at_exit, stop_everything
from batchwire.client._book import Book, Held
from batchwire.client._delivery import Delivery, Tensors
from batchwire.client._servers import RETRIABLE, ServerSet, backoff
from batchwire.client._transport import (
    BatchwireError,
    PullCall,
    PullOptions,
    Server,
    SharedMemoryFailed,
    StatusCode,
    Transport,
    rpc_details,
)
from batchwire.common.sampler import Plan
from batchwire.common.shared_memory import MAX_BUFFERS
from batchwire.common.words import counted
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["ServerPuller", "StreamPass"]

log = logging.getLogger(__name__)
# Registered once the transport has imported grpc: atexit runs it before grpc's own.
atexit.register(stop_everything)

_JOIN_TIMEOUT = 5.0  # seconds per puller; a cancelled RPC ends its puller far sooner
# A finished pass lets its calls end cleanly (half-closed, status OK) for this long
# before it cancels them.
_CLOSE_TIMEOUT = 1.0


class StreamPass:
    """The batches of ``plan`` (a rank's share of one epoch), from batch ``first`` (where
    the plan's ``start`` falls) to its last, pulled from every server of ``servers``.

    ``spec`` is the stream every server is asked for; ``cursor`` is the position after
    the last batch handed out (kept by the caller). ``tensors.options`` sets the rest:
    each server is asked for at most ``prefetch + 2`` batches at a time, ``take(k)``
    blocks for at most ``timeout`` seconds (``retry_timeout`` of failed servers), and a
    ``dns:///`` name is resolved again every ``resolve_every`` seconds. At most
    ``window`` batches beyond the one taken next are asked for or held.
    """

    def __init__(
        self,
        *,
        plan: Plan,
        spec: pb.StreamBatchesRequest,
        transport: Transport,
        tensors: Tensors,
        servers: ServerSet,
        window: int,
    ) -> None:
        self.id = secrets.randbits(62) + 1  # names the pass in the ledger; 0 is none
        self.plan = plan
        self.spec = spec  # the stream asked of every server
        self.cursor = plan.start
        self.first = plan.start // plan.batch_size
        options = tensors.options
        self._timeout = options.timeout
        self._retry_timeout = options.retry_timeout
        self._resolve_every = options.resolve_every
        self._stop = threading.Event()
        self._superseded = False
        self.book = Book(first=self.first, num_batches=plan.num_batches, window=window, plan=plan)
        self._servers = servers

        def puller(server: Server) -> ServerPuller:
            return ServerPuller(
                server=server,
                spec=spec,
                transport=transport,
                tensors=tensors,
                book=self.book,
                credit=options.prefetch + 2,
                servers=servers,
                stop=self._stop,
            )

        self._puller = puller
        self.pullers: dict[Server, ServerPuller] = {}
        self._pullers_lock = threading.Lock()
        self._resolver: threading.Thread | None = None
        self._stopped = False
        self._stop_lock = threading.Lock()
        stop_at_exit(self)

    def start_readers(self) -> None:
        self._add_pullers(self._servers.servers())
        if self._servers.dynamic:
            self._resolver = threading.Thread(
                target=self._resolve, name="batchwire-resolve", daemon=True
            )
            self._resolver.start()

    def _add_pullers(self, servers: list[Server]) -> None:
        with self._pullers_lock:
            if self._stopped:
                return
            joining = bool(self.pullers)  # servers found after the pass started
            for server in servers:
                if server not in self.pullers:
                    if joining:
                        log.info("%s joined: it takes batches from now on", server.address)
                    self.pullers[server] = self._puller(server)
                    self.pullers[server].start()

    def _resolve(self) -> None:
        """Resolve the name again every few seconds: new servers take batches at once."""
        while not self._stop.wait(self._resolve_every) and not self.book.finished:
            try:
                self._add_pullers(self._servers.refresh())
            except BatchwireError as exc:  # the name does not resolve now: keep the others
                log.warning("resolving the servers again failed: %s", exc)

    def take(self, index: int) -> Delivery:
        """Batch ``index`` (in order), or the error that ended the pass."""
        return self.book.take(
            index,
            timeout=self._timeout,
            retry_timeout=self._retry_timeout,
            check=self._raise_if_stopped,
        )

    def _raise_if_stopped(self) -> None:
        if self._superseded:
            raise BatchwireError(
                "this iterator was replaced: a newer iter() of the same RemoteLoader started a "
                "new pass, which stopped this one (each iter() is a pass; use one at a time)",
                code=StatusCode.FAILED_PRECONDITION,
            )
        if self._stop.is_set():
            raise BatchwireError(
                "this iterator's pass was stopped by RemoteLoader.close(); iterate the loader "
                "again to start a new pass",
                code=StatusCode.CANCELLED,
            )

    def supersede(self) -> None:
        """Stop this pass because a newer one started; taking from it raises."""
        self._superseded = True
        self.stop()

    def stop(self) -> None:
        """End the calls and join the pullers (idempotent, from any thread). A finished
        pass's calls first get a moment to end cleanly; others are cancelled at once."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        with self._pullers_lock:  # no puller is added once _stopped is set
            pullers = list(self.pullers.values())
            finished = self.book.finished
        me = threading.current_thread()
        if finished:  # their request streams have ended: the servers end the calls
            for puller in pullers:
                if puller.is_alive() and puller is not me:
                    puller.join(_CLOSE_TIMEOUT)
        # The calls are cancelled before _stop is set: _stop ends their request streams,
        # and a server that saw that half-close first would end the stream OK.
        for puller in pullers:
            puller.cancel()
        self._stop.set()
        self.book.wake()  # waits in the book look at the stop
        for puller in pullers:
            if puller.is_alive() and puller is not me:
                puller.join(_JOIN_TIMEOUT)
        if self._resolver is not None and self._resolver is not me:
            self._resolver.join(_JOIN_TIMEOUT)
        self.book.release()
        forget_at_exit(self)


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
        self._pass_stop = stop  # the pass's (not _stop: Thread has one)
        self._cancelled = threading.Event()  # this puller's: set before the pass's stop
        self._call: PullCall | None = None
        self._lock = threading.Lock()
        self.delivered = 0  # batches this server delivered in this pass
        # Off for this pass once the server's shared memory could not be read.
        self._shared_memory = tensors.options.shared_memory

    def _what_now(self, returned: int) -> str:
        """What the loader does about this server's outage, for the line that says it
        began."""
        retry = f"retry_timeout={self._tensors.options.retry_timeout:g}s"
        if len(self._servers.servers()) == 1:
            return (
                "it is the loader's only server: retrying it until it delivers, for up to "
                f"{retry} without a batch before the loop raises UnavailableError; a line "
                "follows when it serves again"
            )
        moved = (
            f"the {counted(returned, 'batch', 'batches')} it held go to the other servers"
            if returned
            else "its batches go to the other servers"
        )
        return (
            f"{moved}, and it is retried meanwhile (the loop raises UnavailableError only if "
            f"no server delivers for {retry}); a line follows when it serves again"
        )

    def _say_failure(self, failure: str, returned: int, retry_in: float) -> None:
        """One WARNING when an outage of this server begins (by any pass of the loader),
        with what the loader does; a DEBUG line for each failure after it."""
        failures = self._servers.outage(self.server)
        if failures == 1:
            log.warning(
                "%s failed (%s); %s", self.server.address, failure, self._what_now(returned)
            )
            return
        log.debug(
            "%s failed again (%s), failure %d of this outage; %s back to the book, retrying "
            "in %.1fs",
            self.server.address,
            failure,
            failures,
            counted(returned, "batch", "batches"),
            retry_in,
        )

    def _served_again(self) -> None:
        """This server delivered on a call: one INFO line if that ends an outage."""
        ended = self._servers.mark_ok(self.server)
        if ended is not None:
            seconds, failures = ended
            log.info(
                "%s serves again, after %.1fs and %s: the loader goes on with it",
                self.server.address,
                seconds,
                counted(failures, "failed call"),
            )

    def run(self) -> None:
        try:
            self._pull()
        except BatchwireError as exc:
            self._book.fail(exc)
        except Exception as exc:  # a bug or a malformed message: surface it, never hang
            log.exception("puller of %s failed", self.server.address)
            error = BatchwireError(f"client reader failed: {exc!r}", code=StatusCode.INTERNAL)
            error.__cause__ = exc
            self._book.fail(error)

    def _pull(self) -> None:
        attempt = 0
        while not self._halted() and not self._book.finished:
            held = Held()
            over = threading.Event()  # the call is over: its request stream asks for nothing
            failure: tuple[StatusCode, str] | None = None
            before = self.delivered
            try:
                self._call_once(held, over)
                return  # the stream ended (the pass is finished), or the puller halted
            except SharedMemoryFailed as exc:
                if self._halted():
                    return
                # Not the server's failure: the call is made again at once, without
                # shared memory, and the batches it held are asked for again.
                with self._lock:
                    if self._call is not None:
                        self._call.cancel()
                log.warning(
                    "%s: %s; this pass's batches from it come in their messages",
                    self.server.address,
                    exc,
                )
                self._shared_memory = False
            except BatchwireError as exc:
                if self._halted():
                    return
                if exc.code not in RETRIABLE:
                    raise
                if self.delivered > before:
                    attempt = 0  # it delivered since it last failed: a new outage
                said = rpc_details(exc)
                failure = (exc.code, f"{self.server.address}: {exc.code.name}: {said}")
            finally:
                over.set()  # before giving back, so that its request stream claims no more
                returned = self._book.give_back(held, failure)
            if failure is None:
                continue  # shared memory failed: again at once, over the socket
            self._servers.mark_failed(self.server)
            retry_in = backoff(attempt)
            self._say_failure(failure[1], len(returned), retry_in)
            if self._pass_stop.wait(retry_in):
                return
            attempt += 1

    def _call_once(self, held: Held, over: threading.Event) -> None:
        """One call to the server until its stream ends (or at once if the puller
        halted), asking for batches as it has room; what the call raises comes out as a
        BatchwireError."""

        def ended() -> bool:
            return over.is_set() or self._pass_stop.is_set()

        def claim(wait: bool) -> list[int] | None:
            return self._book.claim(held, self._credit, ended, wait=wait)

        options = self._tensors.options
        # Shared memory for the batches the call holds and, where they are lent to the loop
        # (on the CPU), as much as a server grants: the rest for the batches the window
        # and the loop keep where they lie (a window of 10 batches by default, 11 lent).
        holds = self._credit + 1
        buffers = max(holds, MAX_BUFFERS) if self._tensors.lends else holds
        offers = PullOptions(
            shared_memory=self._shared_memory,
            bulk=options.bulk,
            buffers=buffers,
            lend=buffers - holds,
            timeout=options.timeout,
        )
        with self._lock:
            if self._halted():
                return
            call = self._call = self._transport.open_pull(self.server, self._spec, claim, offers)
        with call:
            first = True
            for delivery in self._tensors.deliveries(call, call.read_images):
                self._book.deliver(held, delivery)
                # Not held here while the next arrives (nor by a traceback of this frame):
                # a batch lent where it lies goes back once the loop lets go of it.
                del delivery
                self.delivered += 1
                if first:  # the server serves: an outage of it (of any pass) ended
                    first = False
                    self._served_again()

    def _halted(self) -> bool:
        return self._cancelled.is_set() or self._pass_stop.is_set()

    def cancel(self) -> None:
        """Stop pulling and cancel the call (from any thread), before its request stream
        ends: the server logs and counts the stream as cancelled, not as finished."""
        with self._lock:
            self._cancelled.set()
            if self._call is not None:
                self._call.cancel()  # and its bulk connection: a read waiting on it ends
