"""A pass's order book: which batches are asked of which server, and which have arrived.

Batches ``first .. num_batches-1`` of a rank's share are handed to servers as they have
room (``claim``): batches a failed server gave back first, lowest first, then new ones,
never more than ``window`` beyond the batch the user takes next. So a faster server is
handed more batches, a failed one's batches go to the others, and what is asked for or
held never exceeds ``window`` batches. The user takes batches in order ``k`` whichever
server carried them. Thread-safe; every wait is bounded.
"""

from __future__ import annotations

import collections
import heapq
import threading
import time
from collections.abc import Callable

import grpc

from batchwire.client._exceptions import BatchwireError, UnavailableError, error_for
from batchwire.client._reader import Delivery

__all__ = ["Book", "Held"]

_POLL = 0.1  # seconds between checks of a stop condition while waiting

# The batches one call was asked for and has not delivered yet, in the order asked.
Held = collections.deque[int]


class Book:
    def __init__(self, *, first: int, num_batches: int, window: int) -> None:
        self.num_batches = num_batches
        self._window = window
        self._cond = threading.Condition()
        self._fresh = first  # the lowest batch never handed out
        self._returned: list[int] = []  # a heap: batches a failed server gave back
        self._next = first  # the batch the user takes next
        self._arrived: dict[int, Delivery] = {}
        self._error: BatchwireError | None = None
        self._progress_at = time.monotonic()
        # The latest failure: (when, status code, message), for retry_timeout.
        self._failure: tuple[float, grpc.StatusCode, str] | None = None

    @property
    def finished(self) -> bool:
        """Every batch of the pass was taken by the user."""
        return self._next >= self.num_batches

    def claim(self, held: Held, credit: int, over: Callable[[], bool]) -> list[int] | None:
        """Batches for a call holding ``held`` to ask for, once it holds fewer than
        ``credit`` and the window has room; they are added to ``held``. None once the
        pass is finished or ``over()`` (checked under the lock, so a call that is over
        takes nothing)."""
        with self._cond:
            while True:
                if over() or self.finished:
                    return None
                room = credit - len(held)
                got: list[int] = []
                while room > len(got) and self._returned:
                    got.append(heapq.heappop(self._returned))
                limit = min(self.num_batches, self._next + self._window)
                while room > len(got) and self._fresh < limit:
                    got.append(self._fresh)
                    self._fresh += 1
                if got:
                    held.extend(got)
                    return got
                self._cond.wait(_POLL)

    def deliver(self, held: Held, delivery: Delivery) -> None:
        """A call delivered the first batch it holds."""
        with self._cond:
            expected = held[0] if held else None
            if delivery.index != expected:
                raise BatchwireError(
                    grpc.StatusCode.INTERNAL,
                    f"the server sent batch {delivery.index} where batch {expected} was asked for",
                )
            held.popleft()
            self._arrived[delivery.index] = delivery
            self._progress_at = time.monotonic()
            self._cond.notify_all()

    def give_back(
        self, held: Held, failure: tuple[grpc.StatusCode, str] | None = None
    ) -> list[int]:
        """A call ended holding ``held``: those batches go to other servers (the call
        must be over first, see ``claim``). ``failure`` is why, if it failed."""
        with self._cond:
            returned = sorted(held)
            for index in returned:
                heapq.heappush(self._returned, index)
            held.clear()
            if failure is not None:
                self._failure = (time.monotonic(), *failure)
            self._cond.notify_all()
            return returned

    def fail(self, error: BatchwireError) -> None:
        """The pass cannot go on: ``take`` raises ``error``."""
        with self._cond:
            self._error = self._error or error
            self._cond.notify_all()

    def take(
        self,
        index: int,
        *,
        timeout: float,
        retry_timeout: float,
        check: Callable[[], None],
    ) -> Delivery:
        """Batch ``index`` (the next in order) once it arrived. Raises the pass's error;
        ``UnavailableError`` after ``timeout`` seconds, or when servers failed and none
        delivered a batch for ``retry_timeout`` seconds; whatever ``check()`` raises."""
        deadline = time.monotonic() + timeout
        with self._cond:
            check()  # a stopped pass hands out nothing, not even batches it holds
            while index not in self._arrived:
                check()
                if self._error is not None:
                    raise self._error
                now = time.monotonic()
                failure = self._failure
                stalled = now - self._progress_at > retry_timeout
                if failure is not None and failure[0] >= self._progress_at and stalled:
                    raise error_for(
                        failure[1],
                        f"no server delivered a batch within {retry_timeout:.0f}s "
                        f"(retry_timeout=); last error: {failure[2]}",
                    )
                if now >= deadline:
                    raise UnavailableError(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"no batch arrived within {timeout:.0f}s (timeout=); the server "
                        "may be overloaded or stuck",
                    )
                self._cond.wait(min(_POLL, deadline - now))
            delivery = self._arrived.pop(index)
            self._next = index + 1
            self._cond.notify_all()
            return delivery
