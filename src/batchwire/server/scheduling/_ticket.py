"""A :class:`Ticket`: one stream's requests to the server's pipelines, and their results.

A stream (or a Preprocess queue) asks for its batches through its ticket, at most
``window`` ahead of what it has taken, so a slow client never makes the server hold more.
The scheduler takes the requests of every ticket in the order its fair queue says
(:mod:`batchwire.server.scheduling._fair`), reads and finishes each batch through the
ticket's stream (:class:`StreamPort`), and hands each result back to its ticket.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from typing import Any, Protocol

from batchwire.server.runners import Batch, Job, RunnerKey

__all__ = ["StreamPort", "Ticket"]


class StreamPort(Protocol):
    """A stream, as the scheduler sees it: the one object a ticket is given, whose batches
    a slot reads and finishes, on its own thread."""

    def read(self, seq: int) -> Job:
        """The job of the stream's batch ``seq``: its records read, as a pipeline asks for
        its next input."""
        ...

    def finish(self, batch: Batch) -> Any:
        """What the stream hands out for ``batch``, the run of its job: its ticket is given
        it (:meth:`Ticket.deliver`). Called before the runner runs on, while
        ``batch.images`` is a view of DALI's buffer: what it keeps of them it copies."""
        ...


class _Requests(Protocol):
    """The scheduler, as a ticket sees it."""

    def request(self, ticket: Ticket, room: int, *, more: int = 0) -> None: ...

    def forget(self, ticket: Ticket) -> None: ...


class Ticket:
    """One stream's requests and results.

    A slot reads the stream's batch ``seq`` through ``stream.read(seq)`` and finishes what
    a pipeline made of it through ``stream.finish(batch)`` (:class:`StreamPort`); results
    come back through :meth:`future`, each batch's once (:meth:`deliver` hands them in).
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
        stream: StreamPort,
        window: int,
        scheduler: _Requests,
    ) -> None:
        self.key = key
        self.count = count
        self.stream = stream
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
        """Batch ``seq`` ran: ``result`` is what the stream's ``finish`` made of it, or the
        exception that failed it."""
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
