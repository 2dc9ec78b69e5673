"""Batches' images on a TCP connection of their own, for clients on other hosts.

A pulling client offers to read its images that way (``PullRequest.bulk``). A server
with bulk connections on grants each such stream a :class:`BulkLink` and answers in the
call's initial metadata with a port and a key good once (``BulkGrant``, see
``batchwire.common.bulk``). The client connects to the :class:`BulkBroker`'s port,
sends the key, and the connection is the stream's.

From the claim on, a batch's images are copied once, from the pipeline's buffer into a
buffer of the link's (kept for the next batch once sent), and its message carries the
header and the images' length (``BulkImages``). The stream's handler writes the message
on the call, then the images on the connection, from a thread of the broker's
(``sendall``: the interpreter lock is let go while the kernel copies), and only then the
next batch's message: the images of one batch at a time are waiting to be sent, whatever
the client asked for.

A server with TLS speaks TLS on its bulk connections too (its certificate, and its
clients' CA for mutual TLS): the images are as private as the call.

A bulk connection never fails a stream by being missing: until it is claimed, or where
it never is (a firewall between the client and the port), batches go in their messages.
One that breaks under a stream (the client died, or a network reset it) ends the stream
UNAVAILABLE (``ConnectionLost``), and a client still there resumes from its cursor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import logging
import secrets
import socket
import ssl
import threading
from collections.abc import Callable

import numpy as np

from batchwire.common.batch_codec import fill
from batchwire.common.bulk import ACK, CLAIM_TIMEOUT_S, KEY_BYTES, receive_into
from batchwire.common.shared_memory import warn_once
from batchwire.common.tls import tls_context
from batchwire.server.config import ServerConfig
from batchwire.server.engine import Batch
from batchwire.server.errors import ConnectionLost
from batchwire.server.serving._claims import MAX_CLAIMING, accept_claims, receive
from batchwire.server.serving._security import ServerSecurity
from batchwire.server.serving._streaming import EncodedBatch, encode_elsewhere
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["BulkBroker", "BulkLink", "bulk_broker"]

log = logging.getLogger(__name__)
# What the server's start says of its bulk connections, under the server's logger.
_start_log = logging.getLogger("batchwire.server.serving._server")

_SPARE_BUFFERS = 2  # sent buffers a link keeps for its next batches
# A client host that vanished (no reset, no FIN) with images unacknowledged: the send
# fails after this long, as gRPC's keepalive would end the call.
_USER_TIMEOUT_MS = 120_000


class BulkLink:
    """One stream's bulk connection, from its grant to its close (thread-safe: the
    pipeline's threads fill buffers, the event loop claims and closes, a thread of the
    broker's sends)."""

    def __init__(self, executor: concurrent.futures.Executor) -> None:
        self._executor = executor
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._closed = False
        self._sending = False
        self._spare: list[np.ndarray] = []

    @property
    def claimed(self) -> bool:
        """Whether the client holds the connection: batches may go there from now on."""
        return self._socket is not None and not self._closed

    def attach(self, connection: socket.socket) -> bool:
        """The client claimed the link with ``connection``; False if the stream ended."""
        with self._lock:
            if self._closed or self._socket is not None:
                return False
            connection.setblocking(True)
            self._socket = connection
            return True

    # -- batches (the pipeline's threads) -----------------------------------------------

    def encoder(self, fallback: Callable[[Batch], EncodedBatch]) -> Callable[[Batch], EncodedBatch]:
        """A stream's encode: each batch's images for the connection once it is claimed,
        else ``fallback(batch)`` (its images in its message)."""

        def encode(batch: Batch) -> EncodedBatch:
            return self.encode(batch) or fallback(batch)

        return encode

    def encode(self, batch: Batch) -> EncodedBatch | None:
        """``batch`` as one message and its images copied once into a buffer for the
        connection; None before the claim, after the close, or for an empty batch."""
        images = batch.images
        if not self.claimed or not images.nbytes:
            return None
        data = self._buffer(images.nbytes)
        fill(data, images)
        return encode_elsewhere(batch, bulk=data)

    def _buffer(self, nbytes: int) -> np.ndarray:
        """A flat uint8 buffer of ``nbytes``: a sent one of that size, or a new one."""
        with self._lock:
            for index, spare in enumerate(self._spare):
                if len(spare) == nbytes:
                    return self._spare.pop(index)
        return np.empty(nbytes, np.uint8)

    # -- sending (the stream's handler, on the event loop) ------------------------------

    async def send(self, data: np.ndarray) -> None:
        """Send ``data`` (a batch's images, from :meth:`encode`) on the connection; returns
        once the kernel took it all. ConnectionLost where the connection broke."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._send, data)

    def _send(self, data: np.ndarray) -> None:
        with self._lock:
            if self._closed or self._socket is None:
                raise ConnectionLost("the stream's bulk connection is closed")
            sock, self._sending = self._socket, True
        try:
            sock.sendall(memoryview(data))  # type: ignore[arg-type]  # a buffer
        except (OSError, ValueError) as exc:  # ValueError: a TLS connection shut under it
            raise ConnectionLost(
                f"the stream's bulk connection broke ({getattr(exc, 'strerror', None) or exc}): the client "
                "went away, or the network between them reset it"
            ) from None
        finally:
            with self._lock:
                self._sending = False
                if self._closed:
                    sock.close()  # close() left it to this send, in progress then
                elif len(self._spare) < _SPARE_BUFFERS:
                    self._spare.append(data)

    def close(self) -> None:
        """The stream ended: the connection is shut (a send in progress fails at once)
        and closed once no send is using it. Any thread; idempotent."""
        with self._lock:
            self._closed = True
            self._spare = []
            sock, sending = self._socket, self._sending
            if sock is None:
                return
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            if not sending:
                sock.close()


class BulkBroker:
    """The TCP port on which a server's clients claim the bulk connections granted to
    their streams; runs on the server's event loop, sends from threads of its own."""

    def __init__(self, max_streams: int, tls: ssl.SSLContext | None = None) -> None:
        """``tls``: the server's TLS, which every bulk connection then uses too (the
        handshake, then the key, in a claim thread)."""
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, max_streams), thread_name_prefix="batchwire-bulk"
        )
        # TLS claims block a thread each (at most MAX_CLAIMING at once) for up to their
        # timeouts: threads of their own, so that connections that never finish a
        # handshake hold back no stream's sends.
        self._claims = concurrent.futures.ThreadPoolExecutor(
            max_workers=MAX_CLAIMING, thread_name_prefix="batchwire-bulk-claim"
        )
        self._tls = tls
        self._sockets: list[socket.socket] = []
        self._grants: dict[bytes, BulkLink] = {}
        self._grants_lock = threading.Lock()  # the event loop's, and TLS claims' threads
        self._claiming: set[asyncio.Task[None]] = set()
        self._accepting: list[asyncio.Task[None]] = []
        self.port = 0

    def start(self, host: str, port: int) -> bool:
        """Listen on ``host`` (as the gRPC server does: each of its addresses) at ``port``
        (0: any free one); False, with a warning, where it cannot: it then grants
        nothing."""
        try:
            infos = socket.getaddrinfo(
                host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
        except OSError as exc:
            warn_once(log, "listen", _NO_BULK, host, port, exc.strerror or exc)
            return False
        failed: OSError | None = None
        for family, kind, proto, _, address in infos:
            if any(s.family == family for s in self._sockets):
                continue  # one socket a family (getaddrinfo repeats them)
            try:
                sock = socket.socket(family, kind | socket.SOCK_CLOEXEC, proto)
            except OSError as exc:
                failed = failed or exc
                continue  # a family this host lacks
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((address[0], self.port or port, *address[2:]))
                sock.listen(MAX_CLAIMING)
                sock.setblocking(False)
            except OSError as exc:
                sock.close()
                # Another family's address of the host missing (``localhost``'s ::1 where
                # IPv6 is off), or taken at the port the first got: the others serve.
                failed = failed or exc
                continue
            self._sockets.append(sock)
            self.port = sock.getsockname()[1]
        if not self._sockets:
            reason = "no address" if failed is None else failed.strerror or failed
            warn_once(log, "listen", _NO_BULK, host, port, reason)
            return False
        loop = asyncio.get_running_loop()
        self._accepting = [
            loop.create_task(accept_claims(sock, self._claim, self._claiming, log, _WHAT))
            for sock in self._sockets
        ]
        log.debug("trainers claim bulk connections on port %d", self.port)
        return True

    def grant(self) -> tuple[BulkLink, pb.BulkGrant] | None:
        """A link for a stream whose client offered to take one, and the grant that tells
        the client how to claim it; None while not listening."""
        if not self._sockets:
            return None
        link = BulkLink(self._executor)
        key = secrets.token_bytes(KEY_BYTES)
        with self._grants_lock:
            self._grants[key] = link
        return link, pb.BulkGrant(port=self.port, key=key)

    def revoke(self, link: BulkLink) -> None:
        """The stream ended: its grant, if not claimed, can be claimed no more, and its
        connection is closed."""
        with self._grants_lock:
            for key, granted in list(self._grants.items()):
                if granted is link:
                    del self._grants[key]
        link.close()

    async def _claim(self, connection: socket.socket) -> None:
        """One client's claim: its key within CLAIM_TIMEOUT_S, then ACK and the connection
        handed to the stream's link; any other connection is closed."""
        loop = asyncio.get_running_loop()
        if self._tls is not None:
            await loop.run_in_executor(self._claims, self._claim_tls, connection, self._tls)
            return
        attached = False
        try:
            connection.setblocking(False)
            key = await asyncio.wait_for(receive(loop, connection, KEY_BYTES), CLAIM_TIMEOUT_S)
            link = self._grant_for(key)
            if link is None:
                return  # no such grant (claimed, ended, or never made)
            _tune(connection)
            await asyncio.wait_for(loop.sock_sendall(connection, ACK), CLAIM_TIMEOUT_S)
            attached = link.attach(connection)
        except (OSError, TimeoutError, EOFError) as exc:
            log.debug("a bulk connection's claim ended early: %r", exc)
        finally:
            if not attached:
                connection.close()

    def _claim_tls(self, connection: socket.socket, tls: ssl.SSLContext) -> None:
        """A claim over TLS (a claim thread of the broker's): the handshake, the key and the
        answer, each within CLAIM_TIMEOUT_S; any other connection is closed."""
        secured: socket.socket = connection
        attached = False
        try:
            connection.settimeout(CLAIM_TIMEOUT_S)
            secured = tls.wrap_socket(connection, server_side=True)
            key = bytearray(KEY_BYTES)
            receive_into(secured, memoryview(key))
            link = self._grant_for(bytes(key))
            if link is None:
                return
            _tune(secured)
            secured.sendall(ACK)
            attached = link.attach(secured)
        except (OSError, EOFError, ValueError) as exc:  # ssl.SSLError is an OSError
            log.debug("a bulk connection's TLS claim ended early: %r", exc)
        finally:
            if not attached:
                secured.close()
                connection.close()

    def _grant_for(self, key: bytes) -> BulkLink | None:
        """The link granted under ``key`` (compared in constant time), taken: good once."""
        with self._grants_lock:
            for granted in list(self._grants):
                if hmac.compare_digest(granted, key):
                    return self._grants.pop(granted)
        return None

    async def close(self) -> None:
        """Stop listening (the links granted live on with their streams)."""
        tasks = [*self._accepting, *self._claiming]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with self._grants_lock:
            self._grants.clear()
        for sock in self._sockets:
            sock.close()
        self._sockets = []

    def shutdown(self) -> None:
        """The server stopped: the send threads end (each stream closed its link), and the
        claim threads, each within its timeouts."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._claims.shutdown(wait=True, cancel_futures=True)


def _tune(connection: socket.socket) -> None:
    """Keepalive, and a bound on how long unacknowledged images wait for a silent peer."""
    with contextlib.suppress(OSError, AttributeError):
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, _USER_TIMEOUT_MS)


_WHAT = "bulk connection"
_NO_BULK = (
    "cannot listen for bulk connections on %s port %s (%s): trainers on other hosts get "
    "their images in the call's messages (slower; see --bulk-port)"
)


def bulk_broker(config: ServerConfig, security: ServerSecurity) -> BulkBroker | None:
    """The broker of the server's bulk connections, where ``config`` has them: as private
    as the calls (the server's TLS), and none where Python's ssl refuses what gRPC takes."""
    if not config.bulk:
        return None
    if not security.tls:
        return BulkBroker(config.max_streams, None)
    try:
        tls = tls_context(
            server=True, cert=security.tls_cert, key=security.tls_key, ca=security.tls_client_ca
        )
    except (ssl.SSLError, ValueError) as exc:
        _start_log.warning(
            "no bulk connections: Python's ssl refuses the TLS certificate or key that gRPC "
            "takes (%s); trainers on other hosts get their images in the call's messages",
            exc,
        )
        return None
    return BulkBroker(config.max_streams, tls)
