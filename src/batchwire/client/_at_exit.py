"""What the client ends at interpreter exit, before Python tears gRPC down: the passes still
running (an iterator left referenced, a loop abandoned mid-epoch) stopped, their readers
joined, then the channels still open closed, so that the process neither hangs nor
aborts. A pass is known here from its start to its stop, a channel from its opening.
``_pass`` registers :func:`stop_everything` with ``atexit`` once the transport has
imported grpc, so that it runs before whatever grpc registered."""

from __future__ import annotations

import threading
import weakref
from typing import Protocol

__all__ = ["Closable", "close_at_exit", "forget_at_exit", "stop_at_exit", "stop_everything"]


class Closable(Protocol):
    """What a transport opens to reach a server (a gRPC channel)."""

    def close(self) -> None: ...


class Stoppable(Protocol):
    """A pass, as the exit stops it."""

    def stop(self) -> None: ...


_live_passes: weakref.WeakSet[Stoppable] = weakref.WeakSet()
_live_channels: weakref.WeakSet[Closable] = weakref.WeakSet()
_live_lock = threading.Lock()


def close_at_exit(channel: Closable) -> None:
    """Close ``channel`` at interpreter exit if it is still open then."""
    with _live_lock:
        _live_channels.add(channel)


def stop_at_exit(stream_pass: Stoppable) -> None:
    """Stop ``stream_pass`` at interpreter exit unless it is forgotten before."""
    with _live_lock:
        _live_passes.add(stream_pass)


def forget_at_exit(stream_pass: Stoppable) -> None:
    """``stream_pass`` has stopped: nothing is left to stop at exit."""
    with _live_lock:
        _live_passes.discard(stream_pass)


def stop_everything() -> None:
    """Stop every pass not yet stopped, then close every channel."""
    with _live_lock:
        passes, channels = list(_live_passes), list(_live_channels)
    for stream_pass in passes:
        stream_pass.stop()
    for channel in channels:
        channel.close()
