"""The client's side of batches through shared memory (a server on this host).

Each ``PullBatches`` call offers shared memory (:meth:`RingReader.offer`: how many
batches it holds, and who this process is). A server that grants it answers in the
call's initial metadata; the call then claims the ring (:meth:`RingReader.claim`):
it connects to the server's Unix socket, sends the grant's key and receives the ring's
descriptor, a sealed memfd, read-only (see ``batchwire.common.shared_memory``). The
ring is mapped read-only at the first batch the server puts there, and its descriptor
closed; each batch is copied out once, as it would be out of a message, and its buffer
released with the next request. A server on another host cannot be reached at the
socket: the call goes on with every batch in its messages, as does one whose claim
fails for any reason (said once a process, in a warning).

Nothing of a ring outlives the call, nor passes to a forked child: the mapping is not
inherited (``MADV_DONTFORK``), and a descriptor of a ring (held between the claim and
the first batch, or kept by Python's ``mmap``) is let go in the child. See ``batchwire.server.serving._shared_memory`` for the
server's side.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import mmap
import os
import select
import socket
import struct
import threading
import weakref

import numpy as np

from batchwire.client._transport._exceptions import BatchwireError, StatusCode
from batchwire.common.shared_memory import (
    ACK,
    CLAIM_TIMEOUT_S,
    MEMFD_NAME,
    SEALS,
    log_once,
    namespace,
    socket_address,
    warn_once,
)
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["RingReader", "SharedMemoryFailed"]

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid
# Not there: the server is on another host (or network namespace), the usual case.
_ELSEWHERE = (errno.ENOENT, errno.ECONNREFUSED)

# A fork waits while a descriptor is being received or a ring mapped, so that a child
# never inherits one that is not yet accounted for below.
_fork_lock = threading.Lock()
_calls: weakref.WeakSet[RingReader] = weakref.WeakSet()


class SharedMemoryFailed(BatchwireError):
    """The call's shared memory cannot be read (it could not be mapped, or is not what
    the server said): the call is made again with every batch in its messages."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code=StatusCode.UNAVAILABLE)


class RingReader:
    """One call's reader of a server's ring (the server's ``SharedRing``): the offer of
    shared memory the call makes, the ring it claims, and the ring's buffers copied out
    and not yet released (thread-safe: the puller claims and reads batches, gRPC's thread
    sends the releases)."""

    def __init__(self, buffers: int) -> None:
        self._buffers = buffers
        self._fd = -1  # the ring's memfd, from the claim until it is mapped
        self._ring: mmap.mmap | None = None
        self._span = (0, 0)  # the ring's address and length, in this process
        self._released: list[int] = []
        self._lock = threading.Lock()
        _calls.add(self)

    @classmethod
    def offer(cls, buffers: int) -> RingReader:
        """An offer for a call that holds at most ``buffers`` batches."""
        return cls(buffers)

    def message(self) -> pb.SharedMemoryOffer:
        """The offer as the first request carries it."""
        return pb.SharedMemoryOffer(
            buffers=self._buffers,
            pid=os.getpid(),
            uid=os.geteuid(),
            pid_namespace=namespace("pid"),
            user_namespace=namespace("user"),
        )

    @property
    def claimed(self) -> bool:
        """Whether this call holds the server's ring (its batches may come there)."""
        return self._fd >= 0 or self._ring is not None

    def claim(self, grant: pb.SharedMemoryGrant | None, server: str) -> None:
        """Claim the ring of the server's ``grant`` (from the call's initial metadata),
        if it granted one and this process can reach it; otherwise the call goes on with
        its batches in their messages (said once a process where that is not the usual
        case of a server on another host). Waits at most CLAIM_TIMEOUT_S a step."""
        if grant is None or not grant.socket or not grant.key:
            log_once(
                log,
                logging.INFO,
                f"no grant from {server}",
                "%s offers no shared memory (off there, or this process is another user's "
                "than it serves shared memory to): its batches come in their messages",
                server,
            )
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(CLAIM_TIMEOUT_S)
                sock.connect(socket_address(grant.socket))
                _, uid, _ = _UCRED.unpack(
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
                )
                if uid != grant.uid:
                    raise _Refused(f"{grant.socket} belongs to uid {uid}, not the server's")
                sock.sendall(grant.key)
                self._receive(sock)
                sock.sendall(ACK)
        except OSError as exc:
            self._drop_descriptor()
            if exc.errno in _ELSEWHERE:
                log_once(
                    log,
                    logging.INFO,
                    f"elsewhere {server}",
                    "%s's shared memory cannot be reached from this process, so its batches "
                    "come in their messages: the server is on another host, or in another "
                    "network namespace or container (where it is on this host, its "
                    "--shared-memory-socket-dir, mounted here too, lets this process reach it)",
                    server,
                )
                return
            warn_once(
                log,
                "claim",
                "could not take shared memory from %s, a server on this host (%s): batches "
                "come in their messages",
                server,
                exc.strerror or exc,
            )
        except _Refused as exc:
            self._drop_descriptor()
            warn_once(
                log,
                "refused",
                "refused shared memory from %s (%s): batches come in their messages",
                server,
                exc,
            )

    def _receive(self, sock: socket.socket) -> None:
        """The ring's descriptor, received and checked (under the fork lock)."""
        if not select.select([sock], [], [], CLAIM_TIMEOUT_S)[0]:
            raise OSError(errno.ETIMEDOUT, "the server did not answer the claim")
        with _fork_lock:
            message, fds, flags, _ = socket.recv_fds(sock, 1, 1, socket.MSG_CMSG_CLOEXEC)
            self._fd = fds[0] if fds else -1
            for extra in fds[1:]:
                os.close(extra)
        if flags & socket.MSG_CTRUNC:
            raise OSError(errno.EMFILE, "no descriptor left to receive the shared memory")
        if message != ACK or self._fd < 0:
            raise _Refused("the server gave no shared memory (its log says why)")
        link = os.readlink(f"/proc/self/fd/{self._fd}")
        if not link.startswith(f"/memfd:{MEMFD_NAME}"):
            raise _Refused(f"the server sent {link!r}, not its shared memory")

    def _drop_descriptor(self) -> None:
        with _fork_lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def view(self, where: pb.SharedImages, dtype: np.dtype, count: int) -> np.ndarray:
        """A batch's images where the server put them: a read-only flat view, valid
        until its buffer is released (:meth:`copied`). SharedMemoryFailed where the ring
        cannot be read."""
        ring = self._ring if self._ring is not None else self._map()
        if where.offset + where.length > len(ring) or count * dtype.itemsize > where.length:
            raise SharedMemoryFailed(
                f"a batch lies past the end of the server's shared memory ({len(ring)} bytes)"
            )
        return np.frombuffer(ring, dtype, count, where.offset)

    def _map(self) -> mmap.mmap:
        """The claimed ring, mapped read-only once the server has sized and sealed it."""
        if self._fd < 0:
            raise SharedMemoryFailed(
                "the server sent a batch in shared memory this call never took"
            )
        try:
            seals = fcntl.fcntl(self._fd, fcntl.F_GET_SEALS)
            if seals & SEALS != SEALS:
                raise SharedMemoryFailed(
                    "the server's shared memory is not sealed against writes and resizing"
                )
            with _fork_lock:
                ring = mmap.mmap(self._fd, 0, prot=mmap.PROT_READ)
                ring.madvise(mmap.MADV_DONTFORK)
                self._span = (_address(ring), len(ring))
                self._ring = ring
            return ring
        except (OSError, ValueError) as exc:  # ValueError: an empty memfd
            raise SharedMemoryFailed(
                f"could not map the server's shared memory ({getattr(exc, 'strerror', 0) or exc})"
            ) from None
        finally:
            self._drop_descriptor()  # mapped, or never will be

    def copied(self, buffer: int) -> None:
        """The batch in ``buffer`` is copied out: the next request releases it."""
        with self._lock:
            self._released.append(buffer)

    def take_released(self) -> list[int]:
        """The buffers to release with the next request."""
        with self._lock:
            released, self._released = self._released, []
        return released

    def close(self) -> None:
        """The call is over: its descriptor is closed, its ring unmapped once no view
        of it is left."""
        self._drop_descriptor()
        self._ring = None

    def _forked(self) -> None:
        # In a forked child: the ring was not inherited (MADV_DONTFORK), but its mmap
        # object was, and would unmap its range when dropped, wherever the child has
        # put something else meanwhile. A placeholder keeps the range the child's own.
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        address, length = self._span
        if self._ring is not None and length:
            _reserve(address, length)


class _Refused(Exception):
    """A claim this process will not complete (a wrong peer, a wrong descriptor)."""


def _address(ring: mmap.mmap) -> int:
    view = np.frombuffer(ring, np.uint8)
    try:
        return int(view.ctypes.data)
    finally:
        del view


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_MAP_FIXED_NORESERVE = 0x10 | 0x4000  # MAP_FIXED | MAP_NORESERVE (Linux)


def _reserve(address: int, length: int) -> None:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED_NORESERVE
    _libc.mmap(address, length, 0, flags, -1, 0)  # PROT_NONE


def _before_fork() -> None:
    _fork_lock.acquire()


def _after_fork_in_parent() -> None:
    _fork_lock.release()


def _after_fork_in_child() -> None:
    _fork_lock.release()
    for call in list(_calls):
        call._forked()
    # Python's mmap keeps a duplicate of the descriptor it mapped, which a fork copies.
    # Its number is put to /dev/null rather than closed: the mmap object closes it
    # when dropped, and must not close whatever the child opens there meanwhile.
    try:
        descriptors = os.listdir("/proc/self/fd")
    except OSError:
        return
    devnull = -1
    for name in descriptors:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith(f"/memfd:{MEMFD_NAME}"):
                continue
            if devnull < 0:
                devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            os.dup2(devnull, int(name))
        except OSError:
            continue
    if devnull >= 0:
        os.close(devnull)


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
)
