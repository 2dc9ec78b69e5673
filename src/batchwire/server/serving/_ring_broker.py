"""The Unix socket through which a server's clients on its host claim the shared memory
rings granted to their streams (:class:`RingBroker`): a ring and the key good once that
claims it granted for a call, the claim checked (the key, then the claiming process's
credentials) and answered with the ring's memfd (``SCM_RIGHTS``), and the rings a
stopping server must still close. The rings themselves are ``_shared_memory.py``'s; what
this broker shares with the bulk connections' is ``_claims.py``'s."""

from __future__ import annotations

import array
import asyncio
import logging
import os
import pathlib
import secrets
import socket
import struct
import threading

from batchwire.common.shared_memory import (
    ACK,
    CLAIM_TIMEOUT_S,
    KEY_BYTES,
    socket_address,
    warn_once,
)
from batchwire.server.config import ServerConfig
from batchwire.server.serving._claims import MAX_CLAIMING, accept_claims, receive
from batchwire.server.serving._ring_budget import RingBudget
from batchwire.server.serving._shared_memory import MAX_BUFFERS, SharedRing
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["RingBroker", "ring_broker"]

# Shared memory's one logger, not this module's: its warnings keep the logger operators
# filter them by, and each is said once a process on it (warn_once).
log = logging.getLogger("batchwire.server.serving._shared_memory")

_UCRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid


def ring_broker(
    config: ServerConfig, ring_budget: RingBudget | None, worker: int
) -> RingBroker | None:
    """The broker of a server's rings, where ``config`` has shared memory, held to
    ``ring_budget`` (a unit's) or to ``config.shared_memory_mib`` of its own; ``worker``:
    the server's index in its unit (0 alone)."""
    if not config.shared_memory:
        return None
    budget = ring_budget or RingBudget(config.shared_memory_mib * 2**20)
    return RingBroker(budget, config.shared_memory_socket_dir, worker)


class RingBroker:
    """The Unix socket through which a server's clients on its host claim the rings
    granted to their streams; runs on the server's event loop.

    ``directory`` None: a name in the abstract namespace, reachable from this server's
    network namespace (its host, with host networking, or its pod). A directory: the
    socket ``batchwire-<port>-<worker>.sock`` there, for trainers in other containers that
    mount the same directory at the same path."""

    def __init__(
        self, budget: RingBudget, directory: pathlib.Path | None = None, worker: int = 0
    ) -> None:
        self.budget = budget
        self._directory = directory
        self._worker = worker
        self._socket: socket.socket | None = None
        self._path: pathlib.Path | None = None
        self._address = ""
        self._grants: dict[bytes, SharedRing] = {}
        # Every ring granted and not yet closed: what a stopping server closes if a
        # stream's own close never ran (its handler cut short, its close left queued).
        self._open: set[SharedRing] = set()
        self._open_lock = threading.Lock()
        self._claiming: set[asyncio.Task[None]] = set()
        self._accepting: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        """The socket as a grant names it ("" until started)."""
        return self._address

    def start(self, port: int) -> bool:
        """Listen (on the running event loop) beside the gRPC server's ``port``; False,
        with a warning, where the socket cannot be made: it then grants nothing."""
        if self._directory is None:
            address = f"@batchwire-{os.getpid()}-{secrets.token_hex(8)}"
        else:
            self._path = self._directory / f"batchwire-{port}-{self._worker}.sock"
            address = str(self._path)
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        except OSError as exc:
            warn_once(log, "broker", _NO_BROKER, address, exc.strerror or exc)
            return False
        try:
            if self._path is not None:
                self._path.unlink(missing_ok=True)  # a killed server's of the same name
            sock.bind(socket_address(address))
            if self._path is not None:
                os.chmod(self._path, 0o666)  # any user may connect: the key is the credential
            sock.listen(MAX_CLAIMING)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            warn_once(log, "broker", _NO_BROKER, address, exc.strerror or exc)
            return False
        self._socket, self._address = sock, address
        self._accepting = asyncio.get_running_loop().create_task(
            accept_claims(sock, self._claim, self._claiming, log, "shared memory claim")
        )
        log.debug("trainers on this host claim shared memory at %s", address)
        return True

    def grant(self, offer: pb.SharedMemoryOffer) -> tuple[SharedRing, pb.SharedMemoryGrant] | None:
        """A ring for a stream whose client offered ``offer``, and the grant that tells
        the client how to claim it; None while not listening."""
        if self._socket is None or offer.buffers < 1:
            return None
        ring = SharedRing(min(offer.buffers, MAX_BUFFERS), self.budget, offer)
        key = secrets.token_bytes(KEY_BYTES)
        self._grants[key] = ring
        with self._open_lock:
            self._open.add(ring)
        return ring, pb.SharedMemoryGrant(socket=self._address, key=key, uid=os.geteuid())

    def revoke(self, ring: SharedRing) -> None:
        """The stream ended: its grant, if not claimed, can be claimed no more."""
        for key, granted in list(self._grants.items()):
            if granted is ring:
                del self._grants[key]

    def close_ring(self, ring: SharedRing) -> None:
        """Close a ring this broker granted (its stream ended); any thread."""
        ring.close()
        with self._open_lock:
            self._open.discard(ring)

    def close_rings(self) -> None:
        """Close every ring granted and not closed yet: the server is stopping, and a
        stream whose handler was cut short never closed its own."""
        with self._open_lock:
            rings, self._open = self._open, set()
        for ring in rings:
            ring.close()

    async def _claim(self, connection: socket.socket) -> None:
        """One client's claim: its key, then its credentials checked, the memfd sent, and
        its acknowledgement awaited (each step within CLAIM_TIMEOUT_S)."""
        loop = asyncio.get_running_loop()
        ring = None
        try:
            connection.setblocking(False)
            key = await asyncio.wait_for(receive(loop, connection, KEY_BYTES), CLAIM_TIMEOUT_S)
            ring = self._grants.pop(key, None)
            if ring is None:
                return  # no such grant (claimed, ended, or never made): the client goes on
            pid, uid, _ = _UCRED.unpack(
                connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            )
            wrong = ring.checks_out(pid, uid)
            if wrong is not None:
                log.warning("refused a shared memory claim: %s", wrong)
                return
            try:
                fd = ring.descriptor()
            except OSError as exc:
                warn_once(
                    log,
                    "memfd",
                    "could not make shared memory for a trainer on this host (%s): its "
                    "batches go in their messages",
                    exc.strerror or exc,
                )
                return
            try:
                connection.sendmsg(
                    [ACK], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
                )
            finally:
                os.close(fd)
            if await asyncio.wait_for(receive(loop, connection, 1), CLAIM_TIMEOUT_S) == ACK:
                ring.claimed()
        except (OSError, TimeoutError, EOFError) as exc:
            log.debug("a shared memory claim ended early: %r", exc)
        finally:
            connection.close()

    async def close(self) -> None:
        """Stop listening (the rings granted live on with their streams)."""
        tasks = [task for task in (self._accepting, *self._claiming) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._grants.clear()
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            self._path = None


_NO_BROKER = (
    "cannot listen for shared memory claims at %s (%s): trainers on this host get their "
    "batches in their messages, as over the network"
)
