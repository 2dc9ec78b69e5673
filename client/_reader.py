"""A lane reader: a named daemon thread that fills a bounded queue from one stream.

It puts :class:`Delivery` items, then exactly one terminal item: ``END`` when
the stream finished, or a ``BatchwireError`` when it failed. It stops promptly
when ``stop`` is set (the RPC is cancelled) and never blocks forever on a full
queue.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable

import grpc
import numpy as np

from batchwire.client._exceptions import BatchwireError, from_rpc_error
from batchwire.common.tensors import from_proto
from batchwire.v1 import batchwire_pb2 as pb

__all__ = ["END", "Delivery", "LaneReader"]

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


def decode(message: pb.Batch) -> Delivery:
    return Delivery(
        index=message.index,
        ids=np.asarray(message.ids, dtype=np.int64),
        images=from_proto(message.images),
        labels=from_proto(message.labels),
        cursor=message.cursor,
        skipped_ids=tuple(message.skipped_ids),
        normalized=message.normalized,
        layout=message.images.layout or "NCHW",
    )


class LaneReader(threading.Thread):
    def __init__(
        self,
        *,
        open_stream: Callable[[], grpc.Call],
        address: str,
        lane: int,
        out: queue.Queue[object],
        convert: Callable[[Delivery], Delivery],
        stop: threading.Event,
    ) -> None:
        super().__init__(name=f"batchwire-lane-{lane}", daemon=True)
        self._open_stream = open_stream
        self._address = address
        self._out = out
        self._convert = convert
        self._halt = stop
        self._call: grpc.Call | None = None
        self._lock = threading.Lock()

    def run(self) -> None:
        try:
            with self._lock:
                if self._halt.is_set():
                    return
                self._call = self._open_stream()
            for message in self._call:  # type: ignore[attr-defined]
                if not self._put(self._convert(decode(message))):
                    return
            self._put(END)
        except grpc.RpcError as exc:
            if not self._halt.is_set():
                self._put(from_rpc_error(exc, self._address))
        except BatchwireError as exc:
            self._put(exc)
        except Exception as exc:  # a bug or a malformed message: surface it, never hang
            log.exception("lane reader failed")
            error = BatchwireError(grpc.StatusCode.INTERNAL, f"client reader failed: {exc!r}")
            error.__cause__ = exc
            self._put(error)

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
