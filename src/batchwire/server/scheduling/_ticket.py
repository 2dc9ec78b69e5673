"""A :class:`Ticket`: one stream's requests to the server's pipelines, and their results.

A stream (or a Preprocess queue) asks for its batches through its ticket, at most
``window`` ahead of what it has taken, so a slow client never makes the server hold more.
The scheduler takes the requests of every ticket in the order its fair queue says
(:mod:`batchwire.server.scheduling._fair`), and hands each result back to its ticket.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, Protocol

from batchwire.server.runners import Batch, Job, RunnerKey, keep

__all__ = ["Ticket"]


class _Requests(Protocol):
    """The scheduler, as a ticket sees it."""

    def request(self, ticket: Ticket, room: int, *, more: int = 0) -> None: ...

    def forget(self, ticket: Ticket) -> None: ...


class Ticket:
    """One stream's requests and results.

    ``read(seq)`` gives the job of the stream's batch ``seq`` (its records read), and
    ``finish(batch)`` what the stream hands out for the batch a pipeline made of it (by
    default the batch, :func:`keep`); results come back through :meth:`future`, each
    batch's once (:meth:`deliver` hands them in).
    A ticket is not a pipeline: the scheduler's slots run its requests on theirs.

    The fairness policy's state lives here too, kept by the fair queue under the
    scheduler's lock (see ``batchwire.server.scheduling._fair``): ``allowed`` and
    ``requested`` (batches before these may be, and have been, asked of the pipelines),
    ``pending``, the batches asked for and not yet taken by a pipeline, with when each was
    asked, and ``served``, those taken. The ticket itself only moves its window, through
    the scheduler (:meth:`start`, :meth:`extend`, :meth:`more`).
    """

    def __init__(
        self,
        key: RunnerKey,
        count: int,
        read: Callable[[int], Job],
        window: int,
        scheduler: _Requests,
        finish: Callable[[Batch], Any] = keep,
    ) -> None:
        self.key = key
        self.count = count
        self.read = read
        self.finish = finish
        self._window = window
        self._scheduler = scheduler
        self.allowed = 0
        self.requested = 0
        self.pending: collections.deque[tuple[int, float]] = collections.deque()
        self.served = 0
        self.queued: int | None = None  # the fair queue's entry for this ticket, if any
        self._results: dict[int, Any] = {}
        # Results someone awaits (``future``): set on delivery instead of kept.
        self._futures: dict[int, concurrent.futures.Future[Any]] = {}
        self._lock = threading.Lock()
        self._started = False
        self.closed = False

    def start(self, first: int) -> None:
        """Ask for batches ``first``, ``first + 1``, … (``window`` of them to begin with)."""
        self.requested = self.allowed = first
        self._started = True
        self._scheduler.request(self, self._window)

    def extend(self, count: int) -> None:
        """The stream has ``count`` more batches (a pulling client asked for them); they are
        asked of the pipelines as the window allows."""
        self._scheduler.request(self, 0, more=count)

    def deliver(self, seq: int, result: Any) -> None:
        """Batch ``seq`` ran: ``result`` is what ``finish`` made of it, or the exception
        that failed it."""
        with self._lock:
            if self.closed:
                return
            future = self._futures.pop(seq, None)
            if future is None:
                self._results[seq] = result
        if future is not None:
            _settle(future, result)

    def future(self, seq: int) -> concurrent.futures.Future[Any]:
        """Batch ``seq``'s result as a future (None once the ticket is closed); for a
        caller that awaits it instead of holding a thread. Ask for the next batch with
        :meth:`more` once it is taken."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self.closed:
                _settle(future, None)
                return future
            if seq not in self._results:
                self._futures[seq] = future
                return future
            result = self._results.pop(seq)
        _settle(future, result)
        return future

    def more(self) -> None:
        """One batch taken: ask for one more (once :meth:`start` was called)."""
        if self._started:
            self._scheduler.request(self, 1)

    def close(self) -> None:
        """Drop what is asked for and not yet run; results still running are discarded."""
        with self._lock:
            self.closed = True
            self._results.clear()
            waiting = list(self._futures.values())
            self._futures.clear()
        for future in waiting:
            _settle(future, None)
        self._scheduler.forget(self)


def _settle(future: concurrent.futures.Future[Any], result: Any) -> None:
    """Set ``future``, unless its awaiter gave up on it (the stream's handler was cancelled,
    which cancels the future)."""
    try:
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass
