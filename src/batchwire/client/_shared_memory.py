"""The client's side of batches through shared memory (a server on this host).

Each ``PullBatches`` call offers shared memory (:meth:`SharedMemory.offer`): the call
writes a random token into a file of its own under /dev/shm and names the file and the
token in its first request. A server that reads the same token there shares this
process's /dev/shm and user; it then puts each batch's images in a buffer of a file of its
own and sends only where they lie (``Batch.shared_images``). The call maps that file at
the first such batch (and removes it: the mapping outlives it), copies each batch out
once, as it would copy it out of a message, and releases the batch's buffer with its next
request. A server that cannot share memory ignores the offer: nothing changes.

See ``batchwire.server.serving._shared_memory`` for the server's side.
"""

from __future__ import annotations

import mmap
import os
import pathlib
import secrets
import threading

import grpc
import numpy as np

from batchwire.client._exceptions import BatchwireError
from batchwire.common.shared_memory import PROBE_PREFIX, RING_NAME, SHM_DIR
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["SharedMemory"]


class SharedMemory:
    """One call's offer of shared memory, the server's ring once a batch arrives through
    it, and the ring's buffers copied out and not yet released (thread-safe: the puller
    reads batches, gRPC's thread sends the releases)."""

    def __init__(self, probe: pathlib.Path, token: bytes, buffers: int) -> None:
        self._probe: pathlib.Path | None = probe
        self._directory = probe.parent
        self._probe_name = probe.name
        self._token = token
        self._buffers = buffers
        self._ring: mmap.mmap | None = None
        self._name = ""
        self._released: list[int] = []
        self._lock = threading.Lock()

    @classmethod
    def offer(cls, buffers: int, directory: pathlib.Path = SHM_DIR) -> SharedMemory | None:
        """An offer for a call that holds at most ``buffers`` batches; None where this host
        has no /dev/shm to write to (the call then asks for batches in their messages)."""
        token = secrets.token_bytes(16)
        probe = directory / f"{PROBE_PREFIX}{secrets.token_hex(16)}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError:
            return None
        try:
            os.write(fd, token)
        finally:
            os.close(fd)
        return cls(probe, token, buffers)

    def message(self) -> pb.SharedMemoryOffer:
        """The offer as the first request carries it."""
        return pb.SharedMemoryOffer(
            probe=self._probe_name, token=self._token, buffers=self._buffers
        )

    def remove_probe(self) -> None:
        """The server answered the offer (it opened the stream), or never will."""
        if self._probe is not None:
            self._probe.unlink(missing_ok=True)
            self._probe = None

    def view(self, where: pb.SharedImages, dtype: np.dtype, count: int) -> np.ndarray:
        """A batch's images where the server put them: a read-only flat view, valid
        until its buffer is released (:meth:`copied`)."""
        ring = self._map(where.name)
        if where.offset + where.length > len(ring):
            raise BatchwireError(
                f"a batch lies past the end of the server's shared memory {where.name}",
                code=grpc.StatusCode.INTERNAL,
            )
        return np.frombuffer(ring, dtype, count, where.offset)

    def _map(self, name: str) -> mmap.mmap:
        if self._ring is not None:
            if name != self._name:
                raise BatchwireError(
                    f"the server moved a stream's shared memory from {self._name} to {name}",
                    code=grpc.StatusCode.INTERNAL,
                )
            return self._ring
        if not RING_NAME.fullmatch(name):
            raise BatchwireError(
                f"the server named shared memory {name!r}, not one of its rings",
                code=grpc.StatusCode.INTERNAL,
            )
        path = self._directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            # The server ended the stream (it stopped, or died) before this process
            # mapped the file: the batches it held are asked again, here or elsewhere.
            raise BatchwireError(
                f"the server's shared memory {path} is gone ({exc.strerror}); its batches "
                "are asked for again",
                code=grpc.StatusCode.UNAVAILABLE,
            ) from None
        try:
            self._ring = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        path.unlink(missing_ok=True)  # mapped: the file is not needed any more
        self._name = name
        return self._ring

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
        """The call is over: its probe goes, its ring is unmapped once no view is left."""
        self.remove_probe()
        self._ring = None
