"""The client's side of batches through shared memory (a server on this host).

Each ``PullBatches`` call offers shared memory (:meth:`RingReader.offer`: how many
batches it holds, and who this process is). A server that grants it answers in the
call's initial metadata; the call then claims the ring (:meth:`RingReader.claim`):
it connects to the server's Unix socket, sends the grant's key and receives the ring's
descriptor, a sealed memfd, read-only (see ``batchwire.common.shared_memory``). The
ring is mapped at the first batch the server puts there, and its descriptor closed.

Where the call may lend (``lend`` buffers at a time, a loader on the CPU), the ring is
mapped private and writable (copy on write: the server's pages until the loop writes
to one, which then becomes the loop's own), and a batch is lent to the loop where it
lies (:meth:`RingReader.lend`): its tensors are views of the ring, nothing is copied,
and its buffer is released with the next request once no view of it is left, its
pages written by the loop dropped first so that the buffer shows the server's next
batch. A batch that finds no buffer to lend (the loop keeps ``lend`` batches already,
or the server's buffers are not whole pages) is copied out, as it would be out of a
message, and its buffer released with the next request; so is every batch of a ring
mapped read-only.

A server on another host cannot be reached at the socket: the call goes on with every
batch in its messages, as does one whose claim fails for any reason (said once a
process, in a warning).

Nothing of a ring passes to a forked child but the batches lent to its parent, copied
into the child's own memory: the rest is reserved in the child, and a descriptor of a
ring (held between the claim and the first batch, or kept by Python's ``mmap``) is let
go. A ring outlives its call only in the batches its loop still holds. See
``batchwire.server.serving._shared_memory`` for the server's side.
"""

from __future__ import annotations

import dataclasses
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
from batchwire.client._transport._ring_pages import (
    MAP_NORESERVE,
    PAGE,
    fork_lock,
    keep_lent,
    mapped_at,
    readers,
)
from batchwire.common.batch_codec import DecodedBatch
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


class SharedMemoryFailed(BatchwireError):
    """The call's shared memory cannot be read (it could not be mapped, or is not what
    the server said): the call is made again with every batch in its messages."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code=StatusCode.UNAVAILABLE)


class RingReader:
    """One call's reader of a server's ring (the server's ``SharedRing``): the offer of
    shared memory the call makes, the ring it claims, the batches lent to the loop, and
    the ring's buffers done with and not yet released (thread-safe: the puller claims
    and reads batches, gRPC's thread sends the releases, and a lent batch comes back in
    whichever thread lets go of its last view)."""

    def __init__(self, buffers: int, lend: int = 0) -> None:
        self._buffers = buffers
        self._lend = lend  # buffers that may be lent to the loop at once
        self._fd = -1  # the ring's memfd, from the claim until it is mapped
        self._ring: mmap.mmap | None = None
        self._private = False  # mapped private and writable: batches may be lent
        self._span = (0, 0)  # the ring's address and length, in this process
        self._lent: dict[int, tuple[int, int]] = {}  # buffer -> its (offset, bytes), lent now
        self._released: list[int] = []
        self._lock = threading.Lock()
        readers.add(self)

    @classmethod
    def offer(cls, buffers: int, lend: int = 0) -> RingReader:
        """An offer for a call that holds at most ``buffers`` batches, ``lend`` of them
        at a time lent to the loop."""
        return cls(buffers, lend)

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
        with fork_lock:
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
        with fork_lock:
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
            with fork_lock:
                ring = self._map_private() if self._lend else None
                if ring is None:
                    ring = mmap.mmap(self._fd, 0, prot=mmap.PROT_READ)
                    # A child copies its batches from a private ring (_forked); this one it
                    # does not inherit.
                    ring.madvise(mmap.MADV_DONTFORK)
                self._span = (mapped_at(ring), len(ring))
                self._ring = ring
            return ring
        except (OSError, ValueError) as exc:  # ValueError: an empty memfd
            raise SharedMemoryFailed(
                f"could not map the server's shared memory ({getattr(exc, 'strerror', 0) or exc})"
            ) from None
        finally:
            self._drop_descriptor()  # mapped, or never will be

    def _map_private(self) -> mmap.mmap | None:
        """The ring mapped private and writable (copy on write), or None where the kernel
        refuses it: its batches are then copied out."""
        try:
            ring = mmap.mmap(
                self._fd,
                0,
                flags=mmap.MAP_PRIVATE | MAP_NORESERVE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        except OSError as exc:
            log_once(
                log,
                logging.INFO,
                "private",
                "could not map a server's shared memory copy-on-write (%s): its batches are "
                "copied out of it",
                exc.strerror or exc,
            )
            return None
        self._private = True
        return ring

    def lend(self, part: DecodedBatch) -> DecodedBatch | None:
        """``part`` (a batch in the ring) with its images lent to the loop where they
        lie: writable, its buffer released once no view of them is left (whichever
        thread lets go of the last). None where it is not lent (it is then copied out
        and :meth:`copied`): the ring is read-only, ``lend`` batches are lent already,
        or the server's buffers are not whole pages (one of them would share a page
        with the next, which a write would keep from the server's next batch)."""
        where = part.header.shared_images
        ring = self._ring
        size = where.buffer_bytes
        if (
            ring is None
            or not self._private
            or not size
            or size % PAGE
            or where.offset != where.buffer * size
            or where.length > size
            or where.offset + size > len(ring)
        ):
            return None
        with self._lock:
            if len(self._lent) >= self._lend or where.buffer in self._lent:
                return None
            self._lent[where.buffer] = (where.offset, size)
        flat = np.frombuffer(ring, np.uint8, where.length, where.offset)
        # The views the loop gets are views of ``flat`` (NumPy stops a view's base at an
        # array over another object's memory): it dies with the last of them.
        returned = weakref.finalize(flat, self._returned, where.buffer)
        returned.atexit = False  # nothing to give back to a server as the process exits
        images = flat.view(part.images.dtype).reshape(part.images.shape)
        return dataclasses.replace(part, images=images, lent=True)

    def _returned(self, buffer: int) -> None:
        """No view is left of the batch lent in ``buffer``: the pages the loop wrote to
        are dropped (the server's show again) and the next request releases it, if the
        call is still on (after it, the server writes no more there)."""
        with self._lock:
            span = self._lent.pop(buffer, None)
        ring = self._ring
        if span is None or ring is None:
            return
        offset, size = span
        if _written(self._span[0] + offset, size):
            ring.madvise(mmap.MADV_DONTNEED, offset, size)
        self.copied(buffer)

    def copied(self, buffer: int) -> None:
        """The batch in ``buffer`` is done with: the next request releases it."""
        with self._lock:
            self._released.append(buffer)

    def take_released(self) -> list[int]:
        """The buffers to release with the next request."""
        with self._lock:
            released, self._released = self._released, []
        return released

    def close(self) -> None:
        """The call is over: its descriptor is closed, its ring unmapped once no view
        of it is left (a batch the loop still holds keeps it)."""
        self._drop_descriptor()
        self._ring = None

    def _forked(self) -> None:
        # In a forked child. A read-only ring was not inherited (MADV_DONTFORK), but its
        # mmap object was, and would unmap its range when dropped, wherever the child has
        # put something else meanwhile: a placeholder keeps the range the child's own. A
        # private ring was inherited, and would show the server's next batches where its
        # parent releases buffers: the batches lent to the parent are copied into the
        # child's own memory, in place, and the rest reserved. (After the call, the server
        # writes no more to the ring: what the parent holds of it stays as it is.)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        start, length = self._span
        if self._ring is not None and length:
            keep_lent(start, length, [(start + at, size) for at, size in self._lent.values()])


class _Refused(Exception):
    """A claim this process will not complete (a wrong peer, a wrong descriptor)."""


# /proc/self/pagemap: an entry a page; bits 63 present, 62 swapped, 61 the file's page
_PRESENT, _SWAPPED, _FILE = np.uint64(1 << 63), np.uint64(1 << 62), np.uint64(1 << 61)


def _written(address: int, length: int) -> bool:
    """Whether a page of ``length`` bytes at ``address`` (page-aligned, in a private
    mapping of a file) became this process's own copy: written to, present or swapped
    out. True where /proc/self/pagemap cannot be read."""
    pages = -(-length // PAGE)
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        try:
            raw = os.pread(fd, pages * 8, address // PAGE * 8)
        finally:
            os.close(fd)
    except OSError:
        return True
    if len(raw) != pages * 8:
        return True
    entries = np.frombuffer(raw, np.uint64)
    own = ((entries & _PRESENT) != 0) & ((entries & _FILE) == 0)
    return bool(own.any() or (entries & _SWAPPED).any())
