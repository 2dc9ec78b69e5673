"""A pass's order book: which batches are asked of which server, and which have arrived.

Batches ``first .. num_batches-1`` of a rank's share are handed to servers as they have
room (``claim``): batches a failed server gave back first, lowest first, then new ones,
never more than ``window`` beyond the batch the user takes next. So a faster server is
handed more batches, a failed one's batches go to the others, and what is asked for or
held never exceeds ``window`` batches. The user takes batches in order ``k`` whichever
server carried them. Thread-safe. Nothing polls: a wait ends when what it waits for
changes (every change notifies the book's condition, and so does :meth:`wake`, which a
stopping pass calls) or at its next deadline (the hedge, ``retry_timeout``, ``timeout``).

A server that stalls without failing (a hung disk, a paused process) would hold its
batches until ``timeout``. So when the user has waited for the next batch much longer
than batches have been arriving (``HEDGE_FACTOR`` times the median gap between recent
arrivals, and at least ``HEDGE_MIN_S``), every batch the call holding it holds is offered
to the other servers too, once one of them has capacity: a call open on it (it is not
failed or cooling down) that holds fewer batches than its credit. Whichever copy arrives
first is used; a later one is dropped. With one server, or while the others are busy or
down, nothing is offered and nothing is logged: the batch is waited for, up to
``timeout``.
"""

from __future__ import annotations

import collections
import heapq
import logging
import statistics
import threading
import time
from collections.abc import Callable

from batchwire.client._delivery import Delivery
from batchwire.client._transport import BatchwireError, StatusCode, UnavailableError, error_for
from batchwire.common.sampler import Plan

__all__ = ["HEDGE_FACTOR", "HEDGE_MIN_S", "Book", "Held"]

log = logging.getLogger(__name__)

HEDGE_FACTOR = 20  # a wait this many median gaps between arrivals means a stalled server
HEDGE_MIN_S = 2.0  # ... and never less than this


class Held(collections.deque[int]):
    """The batches one call was asked for and has not delivered yet, in the order asked."""

    __hash__ = object.__hash__  # type: ignore[assignment]  # one per call: by identity


class Book:
    def __init__(
        self, *, first: int, num_batches: int, window: int, plan: Plan | None = None
    ) -> None:
        """A book of batches ``first .. num_batches-1``; with their ``plan``, each batch
        delivered is checked against it (:meth:`_check`)."""
        self._plan = plan
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
        self._failure: tuple[float, StatusCode, str] | None = None
        # The calls open now (they claimed, and have not given back), with their credit.
        self._calls: dict[Held, int] = {}
        self._hedged: set[int] = set()  # batches offered to a second server
        self._gaps: collections.deque[float] = collections.deque(maxlen=32)
        self.duplicates = 0  # copies of hedged batches that arrived second

    @property
    def finished(self) -> bool:
        """Every batch of the pass was taken by the user."""
        return self._next >= self.num_batches

    @property
    def all_asked(self) -> bool:
        """Every batch of the pass was handed to a server at least once."""
        with self._cond:
            return self._fresh >= self.num_batches

    def widen(self, window: int) -> None:
        """From now on at most ``window`` batches beyond the next are asked for or held;
        waits for a batch count from now (a pass started ahead of its user, adopted)."""
        with self._cond:
            self._window = window
            self._progress_at = time.monotonic()
            self._cond.notify_all()

    def claim(
        self, held: Held, credit: int, over: Callable[[], bool], *, wait: bool = True
    ) -> list[int] | None:
        """Batches for a call holding ``held`` to ask for, once it holds fewer than
        ``credit`` and the window has room; they are added to ``held``. None once the
        pass is finished or ``over()`` (checked under the lock, so a call that is over
        takes nothing). ``wait`` False: ``[]`` where there is nothing to ask for now."""
        with self._cond:
            while True:
                if over() or self.finished:
                    return None
                if held not in self._calls:
                    self._cond.notify_all()  # a call with room: a stalled batch may hedge
                self._calls[held] = credit
                room = credit - len(held)
                got: list[int] = []
                mine: list[int] = []  # hedged batches this call holds already
                while room > len(got) and self._returned:
                    index = heapq.heappop(self._returned)
                    if index in held:
                        mine.append(index)
                    elif index >= self._next and index not in self._arrived:
                        got.append(index)
                for index in mine:
                    heapq.heappush(self._returned, index)
                limit = min(self.num_batches, self._next + self._window)
                while room > len(got) and self._fresh < limit:
                    got.append(self._fresh)
                    self._fresh += 1
                if got:
                    held.extend(got)
                    return got
                if not wait:
                    return got
                self._cond.wait()  # until a batch is taken, delivered or given back, or wake

    def deliver(self, held: Held, delivery: Delivery) -> None:
        """A call delivered the first batch it holds."""
        with self._cond:
            expected = held[0] if held else None
        if delivery.index != expected:
            raise BatchwireError(
                f"the server sent batch {delivery.index} where batch {expected} was asked for",
                code=StatusCode.INTERNAL,
            )
        self._check(delivery)
        with self._cond:
            held.popleft()  # the call has room for another batch either way
            self._cond.notify_all()
            if delivery.index < self._next or delivery.index in self._arrived:
                self.duplicates += 1  # the other copy of a hedged batch came first
                return
            now = time.monotonic()
            self._arrived[delivery.index] = delivery
            self._gaps.append(now - self._progress_at)
            self._progress_at = now

    def _check(self, delivery: Delivery) -> None:
        """The samples of a delivered batch are the plan's, in its order, those the server
        skipped left out, and its cursor is where the plan's batch ends: else the server
        serves another stream than this pass's (a replaced dataset, a release that splits
        epochs otherwise, a bug), and the pass ends rather than train on it."""
        if self._plan is None:
            return
        planned = self._plan.batch(delivery.index)
        expected = planned.ids.tolist()
        for sample in delivery.skipped_ids:
            if sample in expected:
                expected.remove(sample)
        if delivery.ids.tolist() == expected and delivery.cursor == planned.end:
            return
        if self._plan.origin:
            raise BatchwireError(
                f"the server sent batch {delivery.index} of its split of the whole epoch, not "
                "of the rest of the epoch that this resumed job splits: it is of a release "
                "before elastic resume (StreamBatchesRequest.origin). Upgrade the servers, or "
                "resume on the world size and batch size the state was saved with",
                code=StatusCode.FAILED_PRECONDITION,
            )
        raise BatchwireError(
            f"the server sent batch {delivery.index} with samples or a cursor that are not "
            f"the batch's (ids {delivery.ids.tolist()[:4]}..., cursor {delivery.cursor}; "
            f"planned {planned.ids.tolist()[:4]}..., cursor {planned.end}): it serves another "
            "stream than this pass's; check that every server serves the same release and "
            "dataset",
            code=StatusCode.INTERNAL,
        )

    def give_back(self, held: Held, failure: tuple[StatusCode, str] | None = None) -> list[int]:
        """A call ended holding ``held``: those batches go to other servers (the call
        must be over first, see ``claim``). ``failure`` is why, if it failed."""
        with self._cond:
            returned = sorted(i for i in held if i >= self._next and i not in self._arrived)
            for index in returned:
                heapq.heappush(self._returned, index)
            held.clear()
            self._calls.pop(held, None)
            if failure is not None:
                self._failure = (time.monotonic(), *failure)
            self._cond.notify_all()
            return returned

    def wake(self) -> None:
        """Wake every wait, to look again at what it checks (``over``, ``check``): the
        pass calls this when it stops."""
        with self._cond:
            self._cond.notify_all()

    def release(self) -> None:
        """Let go of the batches that arrived and were not taken: the pass stopped, and
        nothing takes them (a stopped pass is kept for its place, not its batches)."""
        with self._cond:
            self._arrived.clear()

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
        started = time.monotonic()
        deadline = started + timeout
        with self._cond:
            check()  # a stopped pass hands out nothing, not even batches it holds
            while index not in self._arrived:
                check()
                if self._error is not None:
                    raise self._error
                now = time.monotonic()
                wake_at = [deadline]
                if index not in self._hedged:
                    hedge_at = started + self._hedge_after()
                    if now > hedge_at:
                        self._hedge(index, now - started)  # or, with no room, at a change
                    else:
                        wake_at.append(hedge_at)
                failure = self._failure
                if failure is not None and failure[0] >= self._progress_at:
                    if now - self._progress_at > retry_timeout:
                        error = error_for(
                            failure[1],
                            f"no server delivered a batch for {retry_timeout:g}s while they "
                            f"were retried (RemoteLoader retry_timeout={retry_timeout:g}); "
                            f"last error: {failure[2]}. Check that the servers run and are "
                            "reachable, or raise retry_timeout to wait out longer outages",
                        )
                        log.error("giving up on batch %d: %s", index, error)
                        raise error
                    wake_at.append(self._progress_at + retry_timeout)
                if now >= deadline:
                    raise UnavailableError(
                        f"no batch arrived within {timeout:g}s (RemoteLoader "
                        f"timeout={timeout:g}); the server may be overloaded or stuck",
                        code=StatusCode.DEADLINE_EXCEEDED,
                    )
                # Until a change (an arrival, a failure, room, wake) or the next deadline.
                self._cond.wait(max(0.0, min(wake_at) - now) + 0.001)
            delivery = self._arrived.pop(index)
            self._next = index + 1
            self._cond.notify_all()
            return delivery

    def _hedge_after(self) -> float:
        """Seconds of waiting for one batch after which its server counts as stalled."""
        typical = statistics.median(self._gaps) if self._gaps else 0.0
        return max(HEDGE_MIN_S, HEDGE_FACTOR * typical)

    def _hedge(self, index: int, waited: float) -> None:
        """Offer every batch of the call holding ``index`` to the other calls, if one has
        room (under the lock); else it is tried again when the book next changes."""
        holder = next((held for held in self._calls if index in held), None)
        if holder is None:
            self._hedged.add(index)  # held by no call now: a failed call gave it back
            return
        if not any(h is not holder and len(h) < c for h, c in self._calls.items()):
            return  # no other server, or none with room: nothing to hedge with yet
        offered = [i for i in holder if i not in self._hedged and i not in self._arrived]
        for i in offered:
            heapq.heappush(self._returned, i)
            self._hedged.add(i)
        log.warning(
            "batch %d: waited %.1fs on a server that delivered nothing meanwhile; offering "
            "the %d batches it holds to the other servers with room",
            index,
            waited,
            len(offered),
        )
        self._cond.notify_all()
