"""One pass over a rank's share: lane readers fill bounded queues, batches are taken in order.

A pass owns its reader threads and their RPCs until ``stop()``. Every live pass
is known to this module: at interpreter exit, passes still running (an iterator
left referenced, a loop abandoned mid-epoch) are stopped and their readers
joined before Python tears gRPC down, so the process neither hangs nor aborts.
"""

from __future__ import annotations

import atexit
import queue
import secrets
import threading
import time
import weakref
from collections.abc import Callable

import grpc

from batchwire.client._exceptions import BatchwireError, UnavailableError
from batchwire.client._reader import END, Allocator, Delivery, LaneReader, TransferStats
from batchwire.client._servers import Server, ServerSet

__all__ = ["StreamPass", "close_at_exit"]

_JOIN_TIMEOUT = 5.0  # seconds per reader; a cancelled RPC ends its reader far sooner
_POLL = 0.1  # seconds between checks for a stopped pass while waiting for a batch

# Opens (and after a failure re-opens) a lane's stream on a server from a cursor.
Opener = Callable[[Server, int], grpc.Call]

_live_passes: weakref.WeakSet[StreamPass] = weakref.WeakSet()
_live_channels: weakref.WeakSet[grpc.Channel] = weakref.WeakSet()
_live_lock = threading.Lock()


def close_at_exit(channel: grpc.Channel) -> None:
    """Close ``channel`` at interpreter exit if it is still open then."""
    with _live_lock:
        _live_channels.add(channel)


@atexit.register
def _stop_everything() -> None:
    with _live_lock:
        passes, channels = list(_live_passes), list(_live_channels)
    for stream_pass in passes:
        stream_pass.stop()
    for channel in channels:
        channel.close()


class StreamPass:
    """Batches ``first .. num_batches-1`` of one pass, from ``lanes`` lane readers.

    ``epoch``, ``start``, ``share_size`` and ``num_batches`` describe the pass; ``cursor`` is the
    position after the last batch handed out (kept by the caller). ``take(k)``
    blocks for at most ``timeout`` seconds.
    """

    def __init__(
        self,
        *,
        epoch: int,
        start: int,
        share_size: int,
        num_batches: int,
        batch_size: int,
        lanes: int,
        opener: Callable[[int, int], Opener],
        servers: ServerSet,
        convert: Callable[[Delivery], Delivery],
        allocate: Allocator,
        stats: TransferStats,
        prefetch: int,
        retry_timeout: float,
        timeout: float,
    ) -> None:
        self.id = secrets.randbits(62) + 1  # names the pass in the ledger; 0 is none
        self.epoch = epoch
        self.cursor = start
        self.share_size = share_size
        self.first = start // batch_size
        self.num_batches = num_batches
        self._lanes = lanes
        self._timeout = timeout
        self._stop = threading.Event()
        self._superseded = False
        self._queues = [queue.Queue[object](maxsize=prefetch) for _ in range(lanes)]
        self._readers = [
            LaneReader(
                lane=lane,
                start=start,
                open_stream=opener(lanes, lane),
                servers=servers,
                out=self._queues[lane],
                convert=convert,
                stop=self._stop,
                retry_timeout=retry_timeout,
                allocate=allocate,
                stats=stats,
            )
            for lane in range(lanes)
        ]
        self._stopped = False
        self._stop_lock = threading.Lock()
        with _live_lock:
            _live_passes.add(self)

    def start_readers(self) -> None:
        for reader in self._readers:
            reader.start()

    def take(self, index: int) -> Delivery:
        """Batch ``index`` (in order), or the error that ended its lane."""
        lane_queue = self._queues[index % self._lanes]
        deadline = time.monotonic() + self._timeout
        while True:
            self._raise_if_stopped()
            try:
                item = lane_queue.get(timeout=min(_POLL, max(deadline - time.monotonic(), 0)))
                break
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise UnavailableError(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"no batch arrived within {self._timeout:.0f}s (timeout=); the server "
                        "may be overloaded or stuck",
                    ) from None
        if isinstance(item, BatchwireError):
            raise item
        if item is END or not isinstance(item, Delivery) or item.index != index:
            got = "the end of the stream" if item is END else f"batch {getattr(item, 'index', '?')}"
            raise BatchwireError(
                grpc.StatusCode.INTERNAL, f"expected batch {index} but received {got}"
            )
        return item

    def _raise_if_stopped(self) -> None:
        if self._superseded:
            raise BatchwireError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this iterator was replaced: a newer iter() of the same RemoteLoader started a "
                "new pass, which stopped this one (each iter() is a pass; use one at a time)",
            )
        if self._stop.is_set():
            raise BatchwireError(
                grpc.StatusCode.CANCELLED,
                "this iterator's pass was stopped by RemoteLoader.close(); iterate the loader "
                "again to start a new pass",
            )

    def supersede(self) -> None:
        """Stop this pass because a newer one started; taking from it raises."""
        self._superseded = True
        self.stop()

    def stop(self) -> None:
        """Cancel the RPCs and join the readers (idempotent, from any thread)."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        self._stop.set()
        for reader in self._readers:
            reader.cancel()
        for reader in self._readers:
            if reader.is_alive() and reader is not threading.current_thread():
                reader.join(_JOIN_TIMEOUT)
        with _live_lock:
            _live_passes.discard(self)
