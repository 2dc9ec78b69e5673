"""The client's side of a stream's bulk connection (a server on another host).

Each ``PullBatches`` call to a server named by host and port offers to read its images on
a TCP connection of their own (``PullRequest.bulk``). A server that grants it answers in
the call's initial metadata with a port and a key (``BulkGrant``); the call then claims
it (:meth:`BulkReader.claim`): it connects to that port on the host it called, sends the
key and reads the server's one-byte answer (see ``batchwire.common.bulk``). A batch whose
message says its images are on the connection (``bulk_images``) is read straight into the
tensor the user gets (:meth:`BulkReader.read_into`): one copy, from the kernel, with the
interpreter lock let go.

A port this process cannot reach (a firewall, a proxy in front of the server) costs one
try: the call goes on with its images in its messages, said once, and this process's later
calls to that server do not offer. A connection that breaks under a call fails the call as
the server's failure (UNAVAILABLE): the loader resumes from its cursor. Nothing of a
connection passes to a forked child: a child never shuts its parent's connection down.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import threading

import numpy as np

from batchwire.client._transport._base import host_of
from batchwire.client._transport._exceptions import BatchwireError, StatusCode
from batchwire.common.bulk import ACK, CLAIM_TIMEOUT_S, CONNECT_TIMEOUT_S, receive_into
from batchwire.common.shared_memory import log_once, warn_once
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["BulkReader"]

log = logging.getLogger(__name__)

# Servers whose bulk port this process could not reach: its calls to them offer none.
_unreachable: set[str] = set()
_unreachable_lock = threading.Lock()


class BulkReader:
    """One call's bulk connection: claimed once the call opened, read by the puller,
    shut down by whoever stops the call (thread-safe for that)."""

    def __init__(self, timeout: float, tls: ssl.SSLContext | None = None) -> None:
        """``tls``: the calls' TLS, which the connection then speaks too."""
        self._timeout = timeout  # for each read of a batch's images
        self._tls = tls
        self._socket: socket.socket | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._server = ""

    @staticmethod
    def offered(address: str) -> bool:
        """Whether a call to ``address`` offers one: a ``host:port`` (which names the host
        to connect to, unlike a ``unix:`` or ``dns:///`` target) whose bulk port this
        process has not failed to reach."""
        with _unreachable_lock:
            return host_of(address) is not None and address not in _unreachable

    @property
    def claimed(self) -> bool:
        return self._socket is not None

    def claim(self, grant: pb.BulkGrant | None, server: str, tls_name: str | None = None) -> None:
        """Claim the connection of the server's ``grant`` (from the call's initial
        metadata), if it granted one; with TLS, the server's certificate must name
        ``tls_name`` (default: the host called), as for the call. Where the server's port
        cannot be reached, this process's later calls to it offer none (said once)."""
        host = host_of(server)
        if grant is None or not grant.port or not grant.key or host is None:
            log_once(
                log,
                logging.INFO,
                f"no bulk grant from {server}",
                "%s offers no bulk connection (--no-bulk there): its images come in the "
                "call's messages",
                server,
            )
            return
        self._server = server
        where = (host.strip("[]"), grant.port)
        try:
            sock = socket.create_connection(where, timeout=CONNECT_TIMEOUT_S)
        except OSError as exc:
            warn_once(
                log,
                f"unreachable {server}",
                "could not connect to port %d of %s, where %s sends images on a connection "
                "of their own (%s): its images come in the call's messages, which is slower. "
                "Let this host reach that port (the server's --bulk-port), or serve with "
                "--no-bulk to keep images in the call",
                grant.port,
                where[0],
                server,
                exc.strerror or exc,
            )
            with _unreachable_lock:
                _unreachable.add(server)
            return
        try:
            sock.settimeout(CLAIM_TIMEOUT_S)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=tls_name or where[0])
            sock.sendall(grant.key)
            if sock.recv(1) != ACK:
                raise OSError(0, "the server closed it (the key was refused, or the call ended)")
            sock.settimeout(self._timeout)
        except OSError as exc:  # ssl.SSLError too: a certificate the call would refuse
            sock.close()
            warn_once(
                log,
                f"claim {server}",
                "could not claim a bulk connection of %s (%s): its images come in the call's "
                "messages",
                server,
                exc.strerror or exc,
            )
            return
        with self._lock:
            self._socket = sock

    def read_into(self, out: np.ndarray) -> None:
        """The next batch's images, read into ``out`` (C-contiguous, of the batch's dtype
        and shape). UNAVAILABLE where the connection broke or stalled for the loader's
        ``timeout``."""
        sock = self._socket
        if sock is None:
            raise BatchwireError(
                "the server sent a batch on a bulk connection this call never claimed",
                code=StatusCode.INTERNAL,
            )
        view = memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # a buffer
        try:
            receive_into(sock, view)
        except EOFError:
            raise BatchwireError(
                f"{self._server}'s bulk connection broke (the server closed it mid-batch)",
                code=StatusCode.UNAVAILABLE,
            ) from None
        except TimeoutError:
            raise BatchwireError(
                f"{self._server} sent no images on the bulk connection for {self._timeout:g} "
                "seconds (the loader's timeout)",
                code=StatusCode.UNAVAILABLE,
            ) from None
        except (OSError, ValueError) as exc:  # ValueError: a TLS connection shut under it
            raise BatchwireError(
                f"{self._server}'s bulk connection broke ({getattr(exc, 'strerror', None) or exc})",
                code=StatusCode.UNAVAILABLE,
            ) from None

    def shut(self) -> None:
        """Stop a read in progress (from any thread): it fails at once."""
        with self._lock:
            if self._socket is not None and self._pid == os.getpid():
                with contextlib.suppress(OSError):
                    self._socket.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """The call is over (by the thread that reads): the connection is closed."""
        self.shut()
        with self._lock:
            sock, self._socket = self._socket, None
        if sock is not None:
            sock.close()
