"""Batches through shared memory, for clients on the server's host.

A pulling client offers to read its batches from shared memory (``SharedMemoryOffer``).
A server with shared memory on grants each such stream a :class:`SharedRing` and answers
in the call's initial metadata with where and how to claim it (``SharedMemoryGrant``, see
``batchwire.common.shared_memory``): the ``RingBroker``'s Unix socket and a key
good once (``_ring_broker.py``). A client on another host cannot reach the socket and never claims; its
batches go in their messages, as they would without an offer.

A claim hands over a memfd, not a name: nothing is made in /dev/shm, another user's
process cannot find the ring, and the kernel frees it when the server and its one client
have both let go, at the stream's end or at either one's death. The claiming process
must be who the offer said (its pid and uid, where the server shares its namespaces).

From the claim on, a batch's images are copied once, from the pipeline's buffer into a
free buffer of ``buffers`` batch-sized ones, and its message carries the header and where
the images lie (``SharedImages``): the pixels are neither copied into gRPC's buffers nor
sent through the kernel's TCP stack, on either side. The client reads a batch there (a
loader on the CPU hands it to its loop where it lies, copy-on-write) and releases its
buffer with a later request, once done with it. The ring is sized, mapped and sealed at
its first batch, in the pipeline's thread (its buffers a quarter larger than that batch
where it is a payload of named outputs, whose ragged ones vary from batch to batch; whole
pages each, so that a client's writes to one batch's pages touch no other); its buffers
are backed with memory as first used.

Shared memory never fails a stream: a batch that finds no free buffer, or is larger than
a buffer, or a ring that could not be made or claimed (no memory to spare within the
``RingBudget`` of ``_ring_budget.py``, no descriptors, a refusal) travels in its message as to a client on
another host, and the server says why once.

This module holds the ring, what a batch runs through; the broker that grants and hands
rings over, and the budget they are held to, have modules of their own.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterable

import numpy as np

from batchwire.common.batch_codec import fill
from batchwire.common.outputs import Payload
from batchwire.common.shared_memory import (
    MAX_BUFFERS,
    MEMFD_NAME,
    SEALS,
    log_once,
    namespace,
    warn_once,
)
from batchwire.server.engine import Batch
from batchwire.server.errors import InvalidRequest
from batchwire.server.serving._ring_budget import RingBudget
from batchwire.server.serving._streaming import EncodedBatch, encode_elsewhere
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["MAX_BUFFERS", "SharedRing"]

log = logging.getLogger(__name__)

# Room a ring's buffers leave beyond its first batch, when the batch is a payload of
# named outputs: ragged ones (a detection batch's boxes, captions) make each batch a
# little larger or smaller than the first, and a batch that does not fit goes in its
# message. A batch of images alone is never larger than the first (only the last is short).
PAYLOAD_ROOM = 0.25
PAYLOAD_ROOM_MIN = 1 << 20
_PAGE = mmap.PAGESIZE


def buffer_bytes(images: np.ndarray | Payload) -> int:
    """The bytes of each buffer of a ring whose first batch is ``images``: its size, with
    room for later batches where it is a payload of named outputs (:data:`PAYLOAD_ROOM`),
    in whole pages: no page holds two buffers, so that a client may keep a batch where it
    lies while the buffers beside it take others (``SharedImages.buffer_bytes``)."""
    nbytes = images.nbytes
    if isinstance(images, Payload):
        nbytes += max(int(images.nbytes * PAYLOAD_ROOM), PAYLOAD_ROOM_MIN)
    return -(-nbytes // _PAGE) * _PAGE


class SharedRing:
    """``buffers`` batch-sized buffers of shared memory for one stream's batches, used
    once its client has claimed them (thread-safe: the pipeline fills buffers, the event
    loop releases them and hands the memfd over)."""

    def __init__(
        self, buffers: int, budget: RingBudget, offer: pb.SharedMemoryOffer | None = None
    ) -> None:
        self.buffers = buffers
        self._budget = budget
        self._offer = offer or pb.SharedMemoryOffer()
        self._lock = threading.Lock()
        # Popped from the end, where a released buffer goes back: the buffers in use are
        # reused, and one more is backed by memory only when they are all taken.
        self._free = list(range(buffers - 1, -1, -1))
        self._taken: set[int] = set()
        self._backed: set[int] = set()  # buffers whose pages are reserved
        self._memory: mmap.mmap | None = None
        self._fd = -1  # the memfd, from the claim to the close
        self._identity = (0, 0)  # its (st_dev, st_ino): what self._fd must still be
        self._size = 0  # bytes reserved in the budget
        self._buffer_bytes = 0
        self._claimed = False
        self._usable = True  # False once closed, or once the ring could not be made
        self._writing = 0  # batches being copied in now

    # -- the claim (the broker, on the event loop) --------------------------------------

    def checks_out(self, pid: int, uid: int) -> str | None:
        """Why a process with ``pid`` and ``uid`` (its socket's credentials, in this
        server's namespaces) is not the one that made the offer; None if it is. Compared
        where this server shares the client's namespace (pid 0: not visible here)."""
        offer = self._offer
        same_users = bool(offer.user_namespace) and offer.user_namespace == namespace("user")
        if same_users and uid != offer.uid:
            return f"uid {uid} claimed the shared memory offered to uid {offer.uid}"
        same_pids = bool(offer.pid_namespace) and offer.pid_namespace == namespace("pid")
        if same_pids and pid and pid != offer.pid:
            return f"pid {pid} claimed the shared memory offered to pid {offer.pid}"
        return None

    def descriptor(self) -> int:
        """The ring's memfd, made now, read-only for the client (OSError where it cannot
        be made): the caller sends it and closes it."""
        with self._lock:
            if not self._usable or self._fd >= 0:
                raise OSError(0, "the stream's shared memory was claimed already, or ended")
            self._fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            self._identity = _identity(self._fd)
            try:
                # The same memory through a description that cannot write: the client's.
                return os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:  # no /proc: the seals alone keep it from writing
                return os.dup(self._fd)

    def claimed(self) -> None:
        """The client holds the memfd: batches may go in the ring from now on."""
        with self._lock:
            self._claimed = self._fd >= 0

    # -- batches (the pipeline's threads) -----------------------------------------------

    def encoder(self, fallback: Callable[[Batch], EncodedBatch]) -> Callable[[Batch], EncodedBatch]:
        """A stream's encode: each batch in a free buffer, else ``fallback(batch)``."""

        def encode(batch: Batch) -> EncodedBatch:
            try:
                encoded = self.encode(batch)
            except Exception:  # a fault of shared memory never fails the stream
                with self._lock:
                    self._usable = False  # unmapped at the close; nothing more goes there
                warn_once(
                    log,
                    "fault",
                    "a batch could not go in a stream's shared memory, for a reason not "
                    "foreseen (below): such streams send their batches in their messages; "
                    "please report it",
                    exc_info=True,
                )
                encoded = None
            return encoded or fallback(batch)

        return encode

    def encode(self, batch: Batch) -> EncodedBatch | None:
        """``batch`` as one message whose images lie in a buffer (copied there once), or
        None when the ring is not claimed, no buffer is free or it does not fit."""
        images = batch.images
        buffer = self._acquire(images.nbytes, buffer_bytes(images))
        if buffer is None:
            return None
        assert self._memory is not None
        offset = buffer * self._buffer_bytes
        try:
            target = np.frombuffer(self._memory, np.uint8, images.nbytes, offset)
            fill(target, images)
            del target
        finally:
            self._written()
        where = pb.SharedImages(
            buffer=buffer, offset=offset, length=images.nbytes, buffer_bytes=self._buffer_bytes
        )
        return encode_elsewhere(batch, shared=where)

    def _acquire(self, nbytes: int, buffer_bytes: int) -> int | None:
        """A free buffer for a batch of ``nbytes``, the ring made first with buffers of
        ``buffer_bytes`` (at its first batch); None if none."""
        with self._lock:
            if not self._usable or not self._claimed or not nbytes:
                return None
            if self._memory is None and not self._make(buffer_bytes):
                return None
            if nbytes > self._buffer_bytes:
                log_once(
                    log,
                    logging.INFO,
                    "larger",
                    "a batch of %.1f MiB is larger than its stream's shared-memory buffers "
                    "(%.1f MiB, made for its first batch): it goes in its message, as do "
                    "others of a pipeline whose outputs vary in size this much",
                    nbytes / 2**20,
                    self._buffer_bytes / 2**20,
                )
                return None
            if not self._free:
                return None
            buffer = self._free.pop()
            if buffer not in self._backed and not self._back(buffer):
                return None  # no memory for it: this buffer is not used
            self._taken.add(buffer)
            self._writing += 1
            return buffer

    def _written(self) -> None:
        with self._lock:
            self._writing -= 1
            if not self._usable:
                self._unmap()

    def _make(self, buffer_bytes: int) -> bool:
        """Size, map and seal the memfd for ``buffer_bytes`` a buffer (under the lock);
        a buffer's pages are reserved as it is first used (:meth:`_back`)."""
        size = buffer_bytes * self.buffers
        if not self._budget.reserve(size):
            self._usable = False
            return False
        memory = None
        try:
            if _identity(self._fd) != self._identity:
                # Some code of this process closed the memfd's number, and something else
                # was opened there: that file must not be resized or written.
                raise OSError(
                    errno.EBADF,
                    f"descriptor {self._fd} is no longer the ring's memfd (now "
                    f"{_describe(self._fd)}): some code in this process closed it",
                )
            os.ftruncate(self._fd, size)
            memory = mmap.mmap(self._fd, size)
            # A process this one forks (a custom pipeline's helper) does not inherit it.
            memory.madvise(mmap.MADV_DONTFORK)
            # This mapping is the only writable one there will ever be.
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, SEALS)
        except BaseException as exc:  # nothing reserved or mapped is kept
            if memory is not None:
                memory.close()
            self._budget.release(size)
            self._usable = False
            if not isinstance(exc, (OSError, ValueError)):  # ValueError: resized meanwhile
                raise
            warn_once(
                log,
                "make",
                "could not make a stream's shared memory (%s): such streams send their "
                "batches in their messages",
                getattr(exc, "strerror", None) or exc,
            )
            return False
        self._memory, self._size, self._buffer_bytes = memory, size, buffer_bytes
        return True

    def _back(self, buffer: int) -> bool:
        """Reserve ``buffer``'s pages (under the lock): no memory fails here, not with
        SIGBUS at a write. A buffer that cannot be reserved is not used again."""
        try:
            os.posix_fallocate(self._fd, buffer * self._buffer_bytes, self._buffer_bytes)
        except OSError as exc:
            warn_once(
                log,
                "back",
                "could not reserve %.0f MiB of shared memory (%s): batches that find no other "
                "buffer go in their messages; give the server more memory to send batches to "
                "trainers on this host without copies",
                self._buffer_bytes / 2**20,
                exc.strerror or exc,
            )
            return False
        self._backed.add(buffer)
        return True

    # -- releases and the end (the event loop, and a thread for the unmap) --------------

    def release(self, buffers: Iterable[int]) -> None:
        """The client copied out the batches in ``buffers``: they take other batches now.
        InvalidRequest for a buffer that holds no batch of this stream."""
        with self._lock:
            for buffer in buffers:
                if buffer not in self._taken:
                    raise InvalidRequest(
                        f"released shared memory buffer {buffer}, which holds no batch of this "
                        "stream; release each buffer once, after its batch arrived"
                    )
                self._taken.remove(buffer)
                self._free.append(buffer)

    def close(self) -> None:
        """No more batches go in the ring: its memory is unmapped and its memfd closed now
        or, if a pipeline still draining writes a batch to it, once that is done (the
        client keeps its own mapping for as long as it reads). Unmapping a large ring
        takes milliseconds: call it off the event loop."""
        with self._lock:
            self._usable = False
            self._unmap()

    def _unmap(self) -> None:
        if self._writing:
            return
        if self._memory is not None:
            self._memory.close()
            self._memory = None
            self._budget.release(self._size)
            self._size = 0
        if self._fd >= 0:
            if _identity(self._fd) == self._identity:
                os.close(self._fd)
            else:  # closed by other code already: its number is someone else's now
                log.error(
                    "descriptor %d is no longer a ring's memfd (now %s): some code in this "
                    "process closed it; left open",
                    self._fd,
                    _describe(self._fd),
                )
            self._fd = -1


def _identity(fd: int) -> tuple[int, int]:
    """The file ``fd`` refers to now, as (st_dev, st_ino); (0, 0) where it is closed."""
    try:
        status = os.fstat(fd)
    except OSError:
        return (0, 0)
    return (status.st_dev, status.st_ino)


def _describe(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError as exc:
        return exc.strerror or str(exc)
