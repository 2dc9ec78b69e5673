"""A lane reader: a named daemon thread that fills a bounded queue from one lane's stream.

It puts :class:`Delivery` items, then exactly one terminal item: ``END`` when
the lane finished, or a ``BatchwireError`` when it failed for good. When a
server fails (connection lost, UNAVAILABLE from a draining server, ...), the
lane continues on another server from the cursor of the last batch it
received, with backoff, for at most ``retry_timeout`` seconds without
progress. It stops promptly when ``stop`` is set (the RPC is cancelled) and
never blocks forever on a full queue.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np

from batchwire.client._exceptions import BatchwireError, error_for, from_rpc_error
from batchwire.client._servers import RETRIABLE, Server, ServerSet, backoff
from batchwire.common.batch_codec import DecodedBatch, decode_batch
from batchwire.common.tensors import from_proto

__all__ = ["END", "Allocator", "Delivery", "LaneReader", "TransferStats", "assemble"]

log = logging.getLogger(__name__)

END = object()
_PUT_POLL = 0.1  # seconds between checks of `stop` while the queue is full


@dataclasses.dataclass(frozen=True)
class Delivery:
    """One received batch, decoded to arrays (or to tensors by ``convert``)."""

    index: int
    ids: np.ndarray
    images: object
    labels: object
    cursor: int
    skipped_ids: tuple[int, ...]
    normalized: bool
    layout: str


@dataclasses.dataclass
class TransferStats:
    """Image payload bytes received, and bytes copied on their way to tensors.

    ``copied == received`` means each payload byte was copied exactly once
    between the bytes gRPC hands over and the tensor the user gets.
    """

    received: int = 0
    copied: int = 0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def add(self, received: int, copied: int) -> None:
        with self.lock:
            self.received += received
            self.copied += copied


# allocate(shape, dtype) -> (owner, writable NumPy view of the owner's memory)
Allocator = Callable[[tuple[int, ...], np.dtype], tuple[object, np.ndarray]]


def _numpy_allocator(shape: tuple[int, ...], dtype: np.dtype) -> tuple[object, np.ndarray]:
    array = np.empty(shape, dtype)
    return array, array


def assemble(
    parts: list[DecodedBatch],
    allocate: Allocator = _numpy_allocator,
    stats: TransferStats | None = None,
) -> Delivery:
    """One Delivery from a batch's parts: image data copied once, into ``allocate``'d memory."""
    first, last = parts[0].header, parts[-1].header
    views = [p.images for p in parts]
    samples = sum(len(v) for v in views)
    owner, out = allocate((samples, *views[0].shape[1:]), views[0].dtype)
    position = 0
    for view in views:
        out[position : position + len(view)] = view
        position += len(view)
    if stats is not None:
        stats.add(sum(v.nbytes for v in views), out.nbytes)
    labels = [from_proto(p.header.labels) for p in parts]
    return Delivery(
        index=first.index,
        ids=np.concatenate([np.asarray(p.header.ids, dtype=np.int64) for p in parts]),
        images=owner,
        labels=np.concatenate(labels) if labels else np.zeros((0,), np.int64),
        cursor=last.cursor,
        skipped_ids=tuple(last.skipped_ids),
        normalized=first.normalized,
        layout=parts[0].layout,
    )


class LaneReader(threading.Thread):
    def __init__(
        self,
        *,
        lane: int,
        start: int,
        open_stream: Callable[[Server, int], grpc.Call],
        servers: ServerSet,
        out: queue.Queue[object],
        convert: Callable[[Delivery], Delivery],
        stop: threading.Event,
        retry_timeout: float,
        allocate: Allocator = _numpy_allocator,
        stats: TransferStats | None = None,
    ) -> None:
        super().__init__(name=f"batchwire-lane-{lane}", daemon=True)
        self._lane = lane
        self._cursor = start
        self._open_stream = open_stream
        self._servers = servers
        self._out = out
        self._convert = convert
        self._halt = stop
        self._retry_timeout = retry_timeout
        self._allocate = allocate
        self._stats = stats
        self._call: grpc.Call | None = None
        self._lock = threading.Lock()

    def run(self) -> None:
        try:
            self._stream()
        except BatchwireError as exc:
            self._put(exc)
        except Exception as exc:  # a bug or a malformed message: surface it, never hang
            log.exception("lane reader failed")
            error = BatchwireError(grpc.StatusCode.INTERNAL, f"client reader failed: {exc!r}")
            error.__cause__ = exc
            self._put(error)

    def _stream(self) -> None:
        attempt = 0
        stalled_since: float | None = None
        while not self._halt.is_set():
            server = self._servers.pick(self._lane)
            try:
                with self._lock:
                    if self._halt.is_set():
                        return
                    self._call = self._open_stream(server, self._cursor)
                parts: list[DecodedBatch] = []
                for raw in self._call:  # type: ignore[attr-defined]
                    part = decode_batch(raw)
                    if part.header.part != len(parts):
                        raise BatchwireError(
                            grpc.StatusCode.INTERNAL,
                            f"batch {part.header.index}: part {part.header.part} arrived "
                            f"after {len(parts)} parts",
                        )
                    parts.append(part)
                    if len(parts) < (part.header.parts or 1):
                        continue
                    delivery = self._convert(assemble(parts, self._allocate, self._stats))
                    parts = []
                    self._cursor = delivery.cursor
                    attempt, stalled_since = 0, None
                    self._servers.mark_ok(server)
                    if not self._put(delivery):
                        return
                self._put(END)
                return
            except grpc.RpcError as exc:
                if self._halt.is_set():
                    return
                code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
                if code not in RETRIABLE:
                    raise from_rpc_error(exc, server.address) from exc
                self._servers.mark_failed(server)
                now = time.monotonic()
                stalled_since = stalled_since or now
                details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
                if now - stalled_since > self._retry_timeout:
                    raise error_for(
                        code,
                        f"lane {self._lane}: no server continued the stream within "
                        f"{self._retry_timeout:.0f}s (retry_timeout=); last error from "
                        f"{server.address}: {code.name}: {details}",
                    ) from exc
                log.warning(
                    "lane %d: %s failed (%s: %s); resuming from cursor %d",
                    self._lane,
                    server.address,
                    code.name,
                    details,
                    self._cursor,
                )
                if self._halt.wait(backoff(attempt)):
                    return
                attempt += 1

    def _put(self, item: object) -> bool:
        while not self._halt.is_set():
            try:
                self._out.put(item, timeout=_PUT_POLL)
                return True
            except queue.Full:
                continue
        return False

    def cancel(self) -> None:
        """Stop reading and cancel the RPC (from any thread)."""
        self._halt.set()
        with self._lock:
            if self._call is not None:
                self._call.cancel()
