"""Batches through shared memory, for clients on the server's host.

A pulling client offers to read its batches from shared memory (``SharedMemoryOffer``):
it wrote a random token into a file of its own under /dev/shm. A server that finds the
same token there, in a file owned by the user it runs as, shares the client's /dev/shm
(same host, same container or ``ipc: host``, same user) and gives the stream a
:class:`SharedRing`: one file of ``buffers`` batch-sized buffers under /dev/shm, made at the
stream's first batch. A batch's images are copied once, from the pipeline's buffer into a
free buffer, and its message carries the header and where the images lie
(``SharedImages``): the pixels are neither copied into gRPC's buffers nor sent through the
kernel's TCP stack, on either side. The client copies a batch out and releases its buffer
with its next request.

A batch that finds no free buffer, or is larger than a buffer, or a ring that could not be
made (/dev/shm full), travels in its message as to a client on another host: a ring
never holds a pipeline up. The file is removed once the client has mapped it (its first
release) and when the stream ends; a mapping outlives its file.

Written on ``os``/``mmap`` rather than ``multiprocessing.shared_memory``: on Python 3.11
that registers every segment a process attaches with its resource tracker, which
unlinks it at the process's exit and warns of a leak.
"""

from __future__ import annotations

import hmac
import logging
import mmap
import os
import pathlib
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np

from batchwire.common.batch_codec import images_head
from batchwire.common.shared_memory import PROBE_NAME, RING_NAME, RING_PREFIX, SHM_DIR
from batchwire.server.core import Batch
from batchwire.server.errors import InvalidRequest
from batchwire.server.serving._streaming import EncodedBatch, batch_header
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["MAX_BUFFERS", "SharedRing", "accept_offer", "remove_stale"]

log = logging.getLogger(__name__)

MAX_BUFFERS = 16  # batches one stream may hold in shared memory
_MIN_TOKEN = 16  # bytes
# A ring's file lives until its client maps it, a probe until its server answers: both
# well under a second. One this old was left by a process that died in between.
STALE_S = 600.0
# This process's rings take at most half of /dev/shm, and a new one at most half of what
# is free: the rest is left to others (trainers' DataLoader workers share memory there too).
_rings_lock = threading.Lock()
_rings_bytes = 0  # bytes of this process's rings, mapped now
_room_warned = False  # the warning that /dev/shm is too small: once a process


def remove_stale(directory: pathlib.Path = SHM_DIR, older_than: float = STALE_S) -> int:
    """Remove the rings and probes that processes which died left in ``directory`` (a
    server killed before its client mapped a ring); returns how many."""
    removed = 0
    limit = time.time() - older_than
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        if not (RING_NAME.fullmatch(entry.name) or PROBE_NAME.fullmatch(entry.name)):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_mtime < limit:
                os.unlink(entry.path)
                removed += 1
        except OSError:
            continue  # removed meanwhile, or another user's
    if removed:
        log.info(
            "removed %d shared memory files that stopped processes left in %s", removed, directory
        )
    return removed


def accept_offer(
    offer: pb.SharedMemoryOffer, directory: pathlib.Path = SHM_DIR
) -> SharedRing | None:
    """A ring for a client whose ``offer`` proves that it shares this server's
    ``directory`` and user; None (its batches go in their messages) otherwise."""
    if not PROBE_NAME.fullmatch(offer.probe) or len(offer.token) < _MIN_TOKEN or offer.buffers < 1:
        log.debug("a malformed shared memory offer: batches go in their messages")
        return None
    try:
        fd = os.open(directory / offer.probe, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # another host or container: the usual case for a remote client
        return None
    try:
        info = os.fstat(fd)
        same_user = info.st_uid == os.geteuid() and stat.S_ISREG(info.st_mode)
        token = os.read(fd, 2 * len(offer.token)) if same_user else b""
    finally:
        os.close(fd)
    if not same_user or not hmac.compare_digest(token, offer.token):
        return None
    return SharedRing(min(offer.buffers, MAX_BUFFERS), directory)


class SharedRing:
    """``buffers`` batch-sized buffers of shared memory for one stream's batches (thread-safe:
    the pipeline fills buffers, the event loop releases them)."""

    def __init__(self, buffers: int, directory: pathlib.Path = SHM_DIR) -> None:
        self.buffers = buffers
        self._directory = directory
        self._lock = threading.Lock()
        # Popped from the end, where a released buffer goes back: the buffers in use are
        # reused, and one more is backed by memory only when they are all taken.
        self._free = list(range(buffers - 1, -1, -1))
        self._taken: set[int] = set()
        self._backed: set[int] = set()  # buffers whose pages are reserved
        self._memory: mmap.mmap | None = None
        self._fd = -1
        self._buffer_bytes = 0
        self._path: pathlib.Path | None = None  # until removed
        self._name = ""
        self._usable = True  # False once closed, or when the file could not be made
        self._writing = 0  # batches being copied in now

    def encoder(self, fallback: Callable[[Batch], EncodedBatch]) -> Callable[[Batch], EncodedBatch]:
        """A stream's encode: each batch in a free buffer, else ``fallback(batch)``."""

        def encode(batch: Batch) -> EncodedBatch:
            return self.encode(batch) or fallback(batch)

        return encode

    def encode(self, batch: Batch) -> EncodedBatch | None:
        """``batch`` as one message whose images lie in a buffer (copied there once), or
        None when no buffer is free or it does not fit."""
        images = batch.images
        buffer = self._acquire(images.nbytes)
        if buffer is None:
            return None
        assert self._memory is not None
        offset = buffer * self._buffer_bytes
        try:
            target = np.frombuffer(self._memory, images.dtype, images.size, offset)
            np.copyto(target.reshape(images.shape), images)
            del target
        finally:
            self._written()
        header = batch_header(batch, slice(None), 0, 1)
        header.images.CopyFrom(images_head(images, batch.layout))
        header.shared_images.name = self._name
        header.shared_images.buffer = buffer
        header.shared_images.offset = offset
        header.shared_images.length = images.nbytes
        message = header.SerializeToString()
        return EncodedBatch(
            [message],
            len(batch.ids),
            len(message),
            skipped=len(batch.skipped_ids),
            shared=images.nbytes,
        )

    def _acquire(self, nbytes: int) -> int | None:
        with self._lock:
            if not self._usable or not nbytes:
                return None
            if self._memory is None and not self._make(nbytes):
                return None
            if nbytes > self._buffer_bytes or not self._free:
                return None
            buffer = self._free.pop()
            if buffer not in self._backed and not self._back(buffer):
                return None  # no room in /dev/shm for it: this buffer is not used
            self._taken.add(buffer)
            self._writing += 1
            return buffer

    def _written(self) -> None:
        with self._lock:
            self._writing -= 1
            if not self._usable:
                self._unmap()

    def _make(self, buffer_bytes: int) -> bool:
        """The ring's file and its mapping, sized for ``buffer_bytes`` a buffer; a
        buffer's pages are reserved as it is first used (:meth:`_back`)."""
        size = buffer_bytes * self.buffers
        if not _reserve(self._directory, size):
            self._usable = False
            return False
        name = f"{RING_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        path = self._directory / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, size)
            self._memory = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            _unreserve(size)
            self._usable = False
            log.warning("could not map shared memory under %s (%s)", self._directory, exc)
            return False
        self._fd, self._path, self._name, self._buffer_bytes = fd, path, name, buffer_bytes
        return True

    def _back(self, buffer: int) -> bool:
        """Reserve ``buffer``'s pages (under the lock): a /dev/shm without room fails here,
        not with SIGBUS at a write. A buffer that cannot be reserved is not used again."""
        try:
            os.posix_fallocate(self._fd, buffer * self._buffer_bytes, self._buffer_bytes)
        except OSError as exc:
            log.warning(
                "could not reserve %.0f MiB of shared memory under %s (%s): batches that "
                "find no other buffer go in their messages; give the server a larger "
                "/dev/shm (Docker: shm_size) to send batches to clients on this host "
                "without copies",
                self._buffer_bytes / 2**20,
                self._directory,
                exc.strerror or exc,
            )
            return False
        self._backed.add(buffer)
        return True

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
            self._remove_file()  # the client has mapped it: the file is no longer needed

    def close(self) -> None:
        """No more batches go in the ring; its file is removed, and its memory unmapped
        now or, if a pipeline still draining writes a batch to it, once that is done
        (the client keeps its own mapping for as long as it reads)."""
        with self._lock:
            self._usable = False
            self._remove_file()
            self._unmap()

    def _unmap(self) -> None:
        if self._memory is not None and not self._writing:
            _unreserve(len(self._memory))
            self._memory.close()
            self._memory = None
            os.close(self._fd)
            self._fd = -1

    def _remove_file(self) -> None:
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            self._path = None


def _reserve(directory: pathlib.Path, size: int) -> bool:
    """Whether a ring of ``size`` bytes fits this process's share of ``directory``
    (counted as taken if so); warns once a process when it does not."""
    global _rings_bytes, _room_warned
    try:
        stats = os.statvfs(directory)
    except OSError:
        return False
    free, total = stats.f_bavail * stats.f_frsize, stats.f_blocks * stats.f_frsize
    with _rings_lock:
        if size <= free // 2 and _rings_bytes + size <= total // 2:
            _rings_bytes += size
            return True
        warn, _room_warned = not _room_warned, True
    if warn:
        log.warning(
            "%s has %.0f MiB free of %.0f MiB, too little for a stream's %.0f MiB of shared "
            "memory (a server takes at most half of what is free, and half of all): such "
            "streams send their batches in their messages; give the host or container a "
            "larger /dev/shm (Docker: shm_size) to send batches to clients on this host "
            "without copies",
            directory,
            free / 2**20,
            total / 2**20,
            size / 2**20,
        )
    return False


def _unreserve(size: int) -> None:
    global _rings_bytes
    with _rings_lock:
        _rings_bytes -= size
